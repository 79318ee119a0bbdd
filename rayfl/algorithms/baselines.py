"""The baselines every comparison needs: Local (no federation), FedAvg, and FedAvg + local fine-tuning.

FedAvg (McMahan et al. 2017): each sampled client trains from the global model, the server averages
the uploads weighted by training-set size. A FedAvg client keeps no model of its own: it trains a working
copy of the global model and is evaluated on the global model. FedAvg-FT: the same rounds, then one stage in which every
client fine-tunes the final global model on its own training split and keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfl.algorithms.base import Algorithm, ClientLogic, NoParams, Server, Stage
from rayfl.algorithms.common import weighted_mean
from rayfl.reduce import WeightedMean


class FedAvgServer(Server):
    averages = "global_ref"  # user-level DP: the uploads it averages are models trained from this handle's model

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.global_ref = self.initial

    def train_and_average(self, call, messages: dict) -> dict:
        """Clients train from the global model; it becomes the size-weighted mean Σ_k n_k θ_k / Σ_k n_k of
        the trained models (summed inside each client actor, one partial sum per actor)."""
        ups = call("train", messages, reduce=WeightedMean("weights", by="n"))
        self.global_ref = self.put(ups.reduced["weights"])
        return ups

    def run_round(self, stage, rnd, participants, call):
        ups = self.train_and_average(call, dict.fromkeys(participants, {"models": {"global": self.global_ref}}))
        return {"train_loss": weighted_mean(ups, "train_loss")}

    def eval_messages(self, stage, rnd, cids):
        return dict.fromkeys(cids, {"models": {"global": self.global_ref}})  # one message, to every client

    def final_model(self):
        return self.global_ref

    def state_dict(self):
        return {"global": self.get([self.global_ref])[0]}

    def load_state_dict(self, state):
        self.global_ref = self.put(state["global"])


class FedAvgClient(ClientLogic):
    private_training = True  # every step trains through client.fit (rayfl.privacy)
    local_buffers = True  # and loads through client.scratch / model_of: config buffers=local can hold

    def step_train(self, client, msg, models):
        model = client.scratch(models["global"])
        result = self.local_fit(client, model, msg)
        return {"weights": client.vector(model), **result}

    def local_fit(self, client, model, msg) -> dict:
        """The local training of a working copy of the global model: the run's epochs of SGD on the training
        split (a FedAvg variant that changes only this, FedProx's objective or FedAvg + Data's data, overrides it)."""
        return client.fit(model)

    def eval_weights(self, msg, models):
        return models.get("global")  # the global model while there is one (fine-tuned clients: their own)


@dataclass
class FineTuneParams:
    ft_epochs: int = 1  # local epochs of fine-tuning after the FedAvg rounds
    ft_lr: float = 0.0  # 0: the run's learning rate

    def check(self, n_clients: int) -> None:
        if self.ft_epochs < 1:
            raise ValueError(f"ft_epochs={self.ft_epochs}: must be >= 1")
        if self.ft_lr < 0:
            raise ValueError(f"ft_lr={self.ft_lr}: must be >= 0 (0 means the run's lr)")


class FineTuneServer(FedAvgServer):
    averages = "global_ref"

    def stages(self):
        return [Stage("fedavg", self.info.rounds, depends_on=()), Stage("finetune", 1, sample=False)]

    def run_round(self, stage, rnd, participants, call):
        if stage.name == "fedavg":
            return super().run_round(stage, rnd, participants, call)
        ups = call("finetune", {c: {"models": {"global": self.global_ref}} for c in participants})
        return {"train_loss": weighted_mean(ups, "train_loss")}

    def eval_messages(self, stage, rnd, cids):
        return super().eval_messages(stage, rnd, cids) if stage.name == "fedavg" else {c: {} for c in cids}


class FineTuneClient(FedAvgClient):
    private_training = True
    local_buffers = True

    def step_finetune(self, client, msg, models):
        client.load(models["global"])
        return client.fit(epochs=self.params.ft_epochs, lr=self.params.ft_lr or None)


class LocalServer(Server):
    """No federation: every client trains its own model from the common initialisation, every round."""

    def stages(self):
        return [Stage("local", self.info.rounds, sample=False)]

    def run_round(self, stage, rnd, participants, call):
        ups = call("train", {c: {} for c in participants})
        return {"train_loss": weighted_mean(ups, "train_loss")}


class LocalClient(ClientLogic):
    private_training = True

    def step_train(self, client, msg, models):
        return client.fit()


ALGORITHMS = [
    Algorithm("local", NoParams, LocalServer, LocalClient, "each client trains alone"),
    Algorithm("fedavg", NoParams, FedAvgServer, FedAvgClient, "federated averaging"),
    Algorithm("fedavg-ft", FineTuneParams, FineTuneServer, FineTuneClient, "FedAvg, then local fine-tuning",
              work="FedAvg's, then ft_epochs of fine-tuning on every client"),
]
