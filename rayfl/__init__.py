"""rayfl: personalized federated learning experiments on Ray, tracked in MLflow."""

__version__ = "0.1.0"
