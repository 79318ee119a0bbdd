"""Each paper's headline setting, scaled to data we have, with the paper's numbers to print beside ours.

A preset fixes the federation and training (config keys, as ``rayfl run`` flags set them), the algorithms
compared, per-algorithm knobs, and the paper's reported values (percent, keyed by the table's columns).
Flags the user types override the preset. The datasets are smaller than the papers' (MNIST's 10,000-image
test set in ``--data-root`` stands in for CIFAR / EMNIST / FMNIST), so the paper's numbers are there for
the *direction* of the comparison, not its level.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    name: str
    what: str  # the paper's setting and how it is scaled here
    algos: tuple[str, ...]
    config: dict
    params: dict = field(default_factory=dict)  # algo -> its knobs
    paper: dict = field(default_factory=dict)  # algo -> {column: value in %}
    paper_source: str = ""
    # (config key, value) -> another ``paper`` dict, where the paper reports the setting at that value too
    # (FedeRiCo's Table 1 at 2, 3 and 4 groups); a value the paper has no column for shows no paper numbers
    paper_by: tuple = ()

    def paper_for(self, config: dict) -> dict:
        """The paper's numbers for the setting actually run (the preset's config with the user's flags)."""
        if not self.paper_by:
            return self.paper
        key = self.paper_by[0]
        value = config.get(key, self.config.get(key))
        return dict(self.paper_by[1]).get(value, {})


MNIST = {"dataset": "mnist", "model": "mlp-784-100"}

PRESETS = {p.name: p for p in [
    Preset("fedfomo-ood",
           "FedFomo Fig. 5 table: 15 clients, 5 latent distributions, (val, test) targets shuffled among clients "
           "(CIFAR-10 in the paper; MNIST here). FedFomo's extra update-only round is shown both ways.",
           ("local", "fedavg", "fedfomo"),
           {**MNIST, "partition": "latent", "groups": 5, "clients": 15, "ood": True, "rounds": 20,
            "local_epochs": 5, "lr": 0.01, "batch_size": 50},
           {"fedfomo": {"M": 5}},
           {"local": {"test_acc_mean": 20.39}, "fedavg": {"test_acc_mean": 23.11},
            "fedfomo": {"test_acc_mean": 64.06}},
           "Zhang et al. 2021, Fig. 5 table, CIFAR-10, n=5 downloads"),
    Preset("fedfomo-pathological",
           "FedFomo Table 1: 15 clients, 2 classes each (MNIST, as in the paper), FedFomo's training settings. "
           "FedFomo's extra update-only round is shown both ways.",
           ("local", "fedavg", "fedfomo"),
           {**MNIST, "partition": "pathological", "classes_per_client": 2, "clients": 15, "rounds": 20,
            "local_epochs": 5, "lr": 0.01, "batch_size": 50},
           {"fedfomo": {"M": 5}},
           {"local": {"test_acc_mean": 99.62}, "fedavg": {"test_acc_mean": 91.97},
            "fedfomo": {"test_acc_mean": 99.62}},
           "Zhang et al. 2021, Table 1, MNIST 15 clients, 5 downloads"),
    Preset("usercentric-rotation",
           "User-centric FL S2: rotation groups (0/90/180/270) with Dirichlet(0.4) label shift, k = 4 streams "
           "(EMNIST, 100 users in the paper; MNIST, 20 users here). The paper's headline is the worst user.",
           ("local", "fedavg", "usercentric"),
           {**MNIST, "partition": "rotation", "groups": 4, "label_shift": 0.4, "clients": 20, "rounds": 30,
            "lr": 0.1, "momentum": 0.9},
           {"usercentric": {"streams": 4}},
           {"local": {"test_acc_worst": 56.0}, "fedavg": {"test_acc_worst": 67.5},
            "usercentric": {"test_acc_worst": 76.4}},
           "Mestoukirdi et al., Table I, EMNIST covariate and label shift (worst user)"),
    Preset("usercentric-label-shift",
           "User-centric FL S1: Dirichlet(0.4) label shift, 20 users, k = m streams (full personalization) "
           "(EMNIST in the paper; MNIST here). The paper's headline is the worst user.",
           ("local", "fedavg", "usercentric"),
           {**MNIST, "partition": "dirichlet", "alpha": 0.4, "clients": 20, "rounds": 30, "lr": 0.1,
            "momentum": 0.9},
           {"usercentric": {"streams": 0}},
           {"local": {"test_acc_worst": 58.8}, "fedavg": {"test_acc_worst": 68.9},
            "usercentric": {"test_acc_worst": 73.2}},
           "Mestoukirdi et al., Table I, EMNIST label shift (worst user)"),
    Preset("usercentric-concept",
           "User-centric FL S3: concept shift, 4 groups of 5 users with their own label permutation, k = 4 "
           "streams (CIFAR-10 in the paper; MNIST here). The paper's headline is the worst user.",
           ("local", "fedavg", "usercentric"),
           {**MNIST, "partition": "permutation", "groups": 4, "clients": 20, "rounds": 30, "lr": 0.1,
            "momentum": 0.9},
           {"usercentric": {"streams": 4}},
           {"local": {"test_acc_worst": 35.7}, "fedavg": {"test_acc_worst": 19.6},
            "usercentric": {"test_acc_worst": 49.1}},
           "Mestoukirdi et al., Table I, CIFAR-10 concept shift (worst user)"),
    Preset("federico-label-groups",
           "FedeRiCo Table 1: disjoint label groups, clients assigned to groups at random, no validation split, "
           "Adam lr 0.01 for every method (CIFAR-10, 3 groups in the paper; MNIST here).",
           ("local", "fedavg", "federico"),
           {**MNIST, "partition": "label-groups", "groups": 3, "clients": 8, "rounds": 20, "optimizer": "adam",
            "lr": 0.01, "val_frac": 0.0},
           {},
           {"local": {"test_acc_mean": 55.27}, "fedavg": {"test_acc_mean": 11.73},
            "federico": {"test_acc_mean": 69.76}},
           "Bertrand et al., Table 1, CIFAR-10 with 2, 3 or 4 distributions (the column of --groups)",
           ("groups", ((2, {"local": {"test_acc_mean": 40.09}, "fedavg": {"test_acc_mean": 11.44},
                            "federico": {"test_acc_mean": 56.61}}),
                       (3, {"local": {"test_acc_mean": 55.27}, "fedavg": {"test_acc_mean": 11.73},
                            "federico": {"test_acc_mean": 69.76}}),
                       (4, {"local": {"test_acc_mean": 69.03}, "fedavg": {"test_acc_mean": 13.93},
                            "federico": {"test_acc_mean": 78.22}})))),
    Preset("federico-sine",
           "FedeRiCo Fig. 1: linear models on successive intervals of a noisy sine curve (qualitative in the "
           "paper: collaborator weights concentrate on neighbouring intervals). Lower loss is better.",
           ("local", "fedavg", "federico"),
           {"dataset": "sine", "partition": "latent", "groups": 8, "clients": 8, "rounds": 100,
            "optimizer": "adam", "lr": 0.01, "val_frac": 0.0},
           {}, {}, "Bertrand et al., Fig. 1 (no numbers)"),
    Preset("persfl-ds1",
           "PersFL DS-1: 10 users with 4 classes each, equal sizes (MNIST, 100 FedAvg rounds in the paper; "
           "20 here).",
           ("fedavg", "persfl"),
           {**MNIST, "partition": "pathological", "classes_per_client": 4, "clients": 10, "rounds": 20},
           {},
           {"fedavg": {"test_acc_mean": 92.0}, "persfl": {"test_acc_mean": 98.6}},
           "Divi et al., Table 3, MNIST DS-1 (average over users)"),
    Preset("fedmoe-majority",
           "FedMoE Table 1: two majority classes per client sharing p = 0.8, a balanced global test set, "
           "a quarter of the clients per round, Adam (FMNIST in the paper; MNIST here). FedMoE's row also "
           "holds its own FedAvg and fine-tuned columns.",
           ("local", "fedavg", "fedmoe"),
           {**MNIST, "partition": "majority", "majority": 0.8, "clients": 20, "participation": 0.25,
            "rounds": 30, "local_epochs": 3, "batch_size": 10, "optimizer": "adam", "lr": 0.001},
           {"fedmoe": {"specialist_epochs": 100, "gate_epochs": 100, "patience": 10}},
           {"local": {"test_acc_mean": 74.84, "global_acc_mean": 17.69},
            "fedavg": {"test_acc_mean": 66.45},
            "fedmoe": {"test_acc_mean": 76.70, "global_acc_mean": 61.53, "fedavg_test_acc_mean": 66.45,
                       "fedavg_global_acc_mean": 67.45, "finetuned_test_acc_mean": 76.02,
                       "finetuned_global_acc_mean": 58.66}},
           "Listo Zec et al., Table 1, Fashion-MNIST, p = 0.8"),
]}
