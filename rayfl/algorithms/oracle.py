"""The oracle: one FedAvg per known latent group, the upper reference of user-centric federated learning
(Mestoukirdi et al., "User-Centric Federated Learning", arXiv 2110.09869, 2021/2023, Fig. 2:
"the oracle", which knows which users share a distribution).

Each group g of the partition (``RunInfo.groups``: the latent, label-groups, rotation and permutation
partitions) runs its own FedAvg (McMahan et al. 2017): the group's sampled clients train from the group's
model, which becomes the size-weighted mean Σ_k n_k θ_k / Σ_k n_k of their uploads; every client is evaluated on
its own group's model. A group none of whose clients was sampled in a round keeps its model. The server's state is
the groups' models, all from the common initial model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayfl.algorithms.base import Algorithm, Server
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import weighted_mean
from rayfl.reduce import WeightedMean

GROUPED_PARTITIONS = ("latent", "label-groups", "rotation", "permutation")  # those that set RunInfo.groups
GROUP_MEANS = WeightedMean("weights", by="n", group="group")  # one FedAvg average per group


@dataclass
class OracleParams:
    """No knobs; the partition must have latent groups."""

    def check(self, n_clients: int) -> None:
        return None

    def check_config(self, cfg) -> None:
        if cfg.partition not in GROUPED_PARTITIONS:
            raise ValueError(f"partition={cfg.partition}: the oracle needs a partition with latent groups; "
                             f"allowed: {', '.join(GROUPED_PARTITIONS)}")


class OracleServer(Server):
    def __init__(self, params, info, put, get, rng, initial):
        super().__init__(params, info, put, get, rng, initial)
        if info.groups is None:
            raise ValueError("the oracle needs a partition with latent groups; this federation has none; allowed "
                             f"partitions: {', '.join(GROUPED_PARTITIONS)}")
        self.fedavg = {g: FedAvgServer(params, info, put, get, rng, initial) for g in sorted(set(info.groups))}

    def members(self, g, cids) -> list[int]:
        return [c for c in cids if self.info.groups[c] == g]

    def run_round(self, stage, rnd, participants, call):
        """Every group's FedAvg round in one call (the groups train at once), each group's model then the
        size-weighted mean of its sampled members' uploads (summed by their hosts, group by group); a group with
        none sampled keeps its model."""
        messages = {}
        for g, fedavg in self.fedavg.items():  # one message per group: it travels once per host
            messages.update(dict.fromkeys(self.members(g, participants),
                                          {"models": {"global": fedavg.global_ref}, "group": g}))
        ups = call("train", messages, reduce=GROUP_MEANS)
        for g, mean in ups.reduced["weights"].items():
            self.fedavg[g].global_ref = self.put(mean)
        return {"train_loss": weighted_mean(ups, "train_loss")}

    def eval_messages(self, stage, rnd, cids):
        out = {}
        for g, fedavg in self.fedavg.items():  # each client: its group's model (one message per group)
            out.update(fedavg.eval_messages(stage, rnd, self.members(g, cids)))
        return out

    def state_dict(self):
        return {"groups": np.stack([fedavg.state_dict()["global"] for fedavg in self.fedavg.values()])}

    def load_state_dict(self, state):
        for fedavg, vec in zip(self.fedavg.values(), state["groups"]):
            fedavg.load_state_dict({"global": vec})


ALGORITHMS = [
    Algorithm("oracle", OracleParams, OracleServer, FedAvgClient,
              "one FedAvg per known latent group: the user-centric paper's oracle (Mestoukirdi et al. 2021)"),
]
