"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally, Act Globally:
Federated Learning with Local and Global Representations", arXiv 2001.01523, 2020; NeurIPS 2019 FL workshop):
each device keeps a *local* model that maps its data to a representation, and a *global* model on top of the
representations is averaged by the server, as FedAvg does.

Device m's model is g(l_m(x; θ^l_m); θ^g): the bottom layers θ^l_m are its own (the local representation),
the top G layers θ^g (the global model, the head) are shared. Round t, for the round's devices S_t (Algorithm 1):

    device m:  θ^g <- θ^g_t                                       receive the global model, keep θ^l_m
               (θ^l_m, θ^g_{t+1,m}) <- E epochs of SGD on L_m(g(l_m(x; θ^l_m); θ^g), y)     trained end to end
               send θ^g_{t+1,m}
    server:    θ^g_{t+1} = sum_{m in S_t} n_m θ^g_{t+1,m} / sum_{m in S_t} n_m

and device m is evaluated with g(l_m(x; θ^l_m); θ^g_{t+1}): its own local layers under the current global head
(the paper's "local test" accuracy).

It is FedPer's machinery with the opposite mask (:class:`rayfl.algorithms.common.SplitClient`): the server is
FedAvg's and averages the whole vector; a device overwrites only the shared (global) entries of its own model,
so the averaged local entries travel but are never read (the paper's saving in communication is not modelled).

Choices, and what the authors' code does:
- Which layers are global (``global_layers``, G). The paper: the local models are the lower layers, the global
  model the upper ones. The authors' code (``num_layers_keep``) makes the top 3 of the 5 layers of its MNIST MLP
  global and, on its CIFAR-10 LeNet-style CNN (conv, conv, fc, fc, fc), 2 layers; but that CNN lists its layers
  as fc1, fc2, fc3, conv2, conv1, so the code's 2 "top" layers are the two *convolutions*, against the paper
  (an open question on the authors' tracker). The paper wins: the top layers are global. ``global_layers=0``
  is the model's default: the top 2 layers (the authors' count for their CNN; rayfl's lenet5 is that CNN,
  tf-cnn and mcmahan-cnn also end in two fully connected layers), capped at L - 1 for a model of L
  layers (rayfl's MLPs have 2: their output layer is the global model, their hidden layer the representation).
  A 1-layer model (logreg, sine-mlp) has no split and is refused. (FL-bench's LG-FedAvg shares the *bottom*
  ``num_global_layers`` layers: the same inversion.)
- FedAvg warm start (``fedavg_rounds``). The authors' code starts LG-FedAvg from a FedAvg checkpoint: the
  README's runs load the best of 400 FedAvg rounds (MNIST) or 1,200 (CIFAR-10), then run 200 LG-FedAvg
  rounds, every device starting with the whole FedAvg model. Here the first ``fedavg_rounds`` of the run's
  rounds are plain FedAvg (clients evaluated on the global model), then every client, participant or not,
  takes the last FedAvg model as its own, and the remaining rounds are LG-FedAvg. Default 0: Algorithm 1 from
  the common initialisation. The code's checkpoint is the FedAvg round with the best *test* accuracy, and its
  LG phase keeps each device's best round on test: both read the test split, so neither is done here (the
  warm start is the last FedAvg model, the report the last round).
- The server weighs devices by training-set size, as FedAvg does; the code takes the plain mean over the
  round's devices, the same thing on its equal-sized shards.
- The local layers are trained only through the task loss (the paper's supervised image experiments); the
  paper's auxiliary local objectives (unsupervised, fair/adversarial representations) and its "new device"
  test are not implemented.
- Local work per round is FedAvg's (the run's epochs, batch size, optimizer and lr; the code: SGD with
  momentum 0.5, 1 epoch, batch 10 / 50, lr 0.05 / 0.1 on MNIST / CIFAR-10).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfl.algorithms.base import Algorithm, Stage
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import SplitClient, check_layers, check_split, split_size, weighted_mean
from rayfl.algorithms.layers import layer_slices, top_mask


@dataclass
class LGFedAvgParams:
    global_layers: int = 0  # G, the top layers averaged by the server; 0: the model's default, 2 capped at L-1
    fedavg_rounds: int = 0  # rounds of plain FedAvg first, out of the run's rounds (authors' code: 400 + 200)

    def check(self, n_clients: int) -> None:
        check_layers("global_layers", self.global_layers)
        if isinstance(self.fedavg_rounds, bool) or not isinstance(self.fedavg_rounds, int) or self.fedavg_rounds < 0:
            raise ValueError(f"fedavg_rounds={self.fedavg_rounds!r}: must be an integer >= 0")

    def check_run(self, info, model) -> None:
        check_split("global_layers", self.global_layers, info.model, model, "LG-FedAvg",
                    "local layers and a global head")

    def check_config(self, cfg) -> None:
        if self.fedavg_rounds >= cfg.rounds:
            raise ValueError(f"fedavg_rounds={self.fedavg_rounds}: must be below rounds={cfg.rounds} (at least one "
                             f"LG-FedAvg round)")


def global_mask(model, g: int):
    """LG-FedAvg's shared entries: the top G layers, the global model θ^g (Algorithm 1)."""
    return top_mask(model, split_size(g, len(layer_slices(model))))


# ------------------------------------------------------------------------------------------- driver

class LGFedAvgServer(FedAvgServer):
    """FedAvg's server with the warm start. Like FedPer's, it does not declare ``Server.averages`` (user-level
    DP): the uploads' local entries are not updates of the global model's."""

    def stages(self):
        warm = self.params.fedavg_rounds
        return ([Stage("fedavg", warm, depends_on=())] if warm else []) + [Stage("lg", self.info.rounds - warm)]

    def message(self, stage) -> dict:
        return {"models": {"global": self.global_ref}, "fedavg": stage.name == "fedavg"}

    def run_round(self, stage, rnd, participants, call):
        if stage.name == "lg" and self.params.fedavg_rounds and rnd == self.params.fedavg_rounds:
            self.hand_over(call)
        ups = self.train_and_average(call, dict.fromkeys(participants, self.message(stage)))
        return {"train_loss": weighted_mean(ups, "train_loss")}

    def hand_over(self, call) -> None:
        """After the FedAvg warm start, every device takes the whole FedAvg model as its own (authors' code)."""
        call("adopt", dict.fromkeys(range(self.info.n_clients), {"models": {"global": self.global_ref}}))

    def eval_messages(self, stage, rnd, cids):
        return dict.fromkeys(cids, self.message(stage))


# ------------------------------------------------------------------------------------------- client

class LGFedAvgClient(SplitClient, FedAvgClient):
    private_training = True  # every step trains through client.fit (rayfl.privacy), the warm start's too

    def shared_mask(self, model):
        return global_mask(model, self.params.global_layers)

    def step_train(self, client, msg, models):
        if msg["fedavg"]:  # the warm start: FedAvg's step, the whole model shared
            return FedAvgClient.step_train(self, client, msg, models)
        return super().step_train(client, msg, models)

    def step_adopt(self, client, msg, models):
        client.load(models["global"])
        return {}

    def step_evaluate(self, client, msg, models):
        if msg["fedavg"]:  # FedAvg's evaluation: the global model
            return client.evaluate(client.model_of(models["global"]))
        return super().step_evaluate(client, msg, models)


ALGORITHMS = [Algorithm("lg-fedavg", LGFedAvgParams, LGFedAvgServer, LGFedAvgClient,
                        "local representation layers, a global head averaged by FedAvg (Liang et al. 2020)")]
