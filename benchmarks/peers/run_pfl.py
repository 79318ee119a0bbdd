"""pfl-research 0.6 FedAvg on the benchmark workload; run under torchrun, one process per core.
Prints one JSON line on rank 0: the wall-clock time at the end of every central iteration."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    from workload import worker_args

    args = worker_args()
    torch.set_num_threads(1)

    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from workload import BATCH, EPOCHS, LR, federation

    from rayfl.training import load_vector

    clients, spec, initial = federation(args.workload, args.data_root)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = load_vector(spec.build(), initial)

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return torch.nn.functional.cross_entropy(self(x), y)

        def metrics(self, x, y, eval=False):
            self.eval() if eval else self.train()
            out = self(x)
            loss = torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct = (out.argmax(1) == y).sum().item()
            return {"loss": Weighted(loss, len(y)), "accuracy": Weighted(correct, len(y))}

    get_default_framework_module()
    t = lambda a: torch.as_tensor(a)  # noqa: E731
    train = {i: (t(c[0]), t(c[1])) for i, c in enumerate(clients)}
    evals = {i: (t(c[2]), t(c[3])) for i, c in enumerate(clients)}
    ids = list(range(len(clients)))
    train_fd = FederatedDataset(lambda uid: Dataset(raw_data=list(train[uid]), user_id=str(uid)),
                                get_user_sampler("minimize_reuse", ids))
    val_fd = FederatedDataset(lambda uid: Dataset(raw_data=list(evals[uid]), user_id=str(uid),
                                                  eval_kwargs={"eval": True}),
                              get_user_sampler("minimize_reuse", ids))
    net = Net()
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    stamps: list[float] = []

    class Stamp(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.time())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=1,
                                           train_cohort_size=len(ids), val_cohort_size=len(ids)),
        backend=SimulatedBackend(training_data=train_fd, val_data=val_fd),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=LR, local_num_epochs=EPOCHS,
                                              local_batch_size=BATCH),
        model_eval_params=NNEvalHyperParams(local_batch_size=1024),
        callbacks=[Stamp()])
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps({"stamps": stamps}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # the run is over and reported; a normal interpreter exit sometimes aborts a rank here ("terminate called
    # without an active exception", SIGABRT: a native thread still joinable at exit), which torchrun reports as
    # a failed run, so the ranks leave without running exit handlers
    os._exit(0)


if __name__ == "__main__":
    main()
