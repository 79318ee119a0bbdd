"""Each paper's headline setting, scaled to data we have, with the paper's numbers to print beside ours.

A preset fixes the federation and training (config keys, as ``rayfl run`` flags set them), the algorithms
compared, per-algorithm knobs and config, and the paper's reported values (percent, keyed by the table's
columns). Flags the user types override the preset. A row is the baseline as the table's authors ran it: the
settings the paper states, and where it names the code it ran a baseline with, that code's choices for what the
paper leaves open (each cited beside its value below); ``rayfl run --algo X`` keeps X's own paper's defaults.
Where the paper's data is MNIST (FedFomo's Table 1, PersFL's Table 3) the paper's numbers are a level to
reach; where MNIST's 10,000-image test set in ``--data-root`` stands in for CIFAR / EMNIST / FMNIST they are
there for the *direction* of the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    name: str
    what: str  # the paper's setting and how it is scaled here
    algos: tuple[str, ...]  # the table's rows: ALGO or ALGO:KEY=VALUE:... (rayfl.comparison.run.parse_row)
    config: dict
    params: dict = field(default_factory=dict)  # algo -> its knobs
    paper: dict = field(default_factory=dict)  # row -> {column: value in %}
    paper_source: str = ""
    # (config key, value) -> another ``paper`` dict, where the paper reports the setting at that value too
    # (FedeRiCo's Table 1 at 2, 3 and 4 groups); a value the paper has no column for shows no paper numbers
    paper_by: tuple = ()
    # algo -> config values for that algorithm's rows alone (a baseline run with the code its table's authors
    # ran, which fixes its own batch size or rounds); the user's flags override them as they do ``config``
    row_config: dict = field(default_factory=dict)

    def paper_for(self, config: dict) -> dict:
        """The paper's numbers for the setting actually run (the preset's config with the user's flags)."""
        if not self.paper_by:
            return self.paper
        key = self.paper_by[0]
        value = config.get(key, self.config.get(key))
        return dict(self.paper_by[1]).get(value, {})


MNIST = {"dataset": "mnist", "model": "mlp-784-100"}

# The rows of FedFomo's tables (Zhang et al. 2021, Tables 1, 2 and the Fig. 5 table), in the paper's order; its
# "5 / 10 clients downloaded" rows are M = 5 and M = 10 here (M counts the client's own model).
FEDFOMO_ROWS = ("local", "fedavg", "fedavg-data", "fedprox", "lg-fedavg", "mocha", "cfl", "perfedavg", "pfedme",
                "fedfomo", "fedfomo:M=10")
# Every method: SGD, lr 0.01 on MNIST, E = 5 local epochs, weight decay 1e-4 (Zhang et al. 2021, Sec. 4 "Federated
# Learning Baselines" and A.6); batch 50 (the authors' code, NVlabs/FedFomo federated/args.py, --bs_trn). Not
# here: A.6's 0.99 learning-rate decay per round (rayfl has no schedule; 0.99^20 = 0.82 by the last round).
FEDFOMO_TRAINING = {"local_epochs": 5, "lr": 0.01, "batch_size": 50, "weight_decay": 1e-4}
# The baselines the paper ran with other people's code (its footnote: Per-FedAvg and pFedMe with
# github.com/CharlieDinh/pFedMe, CFL with github.com/felisat/clustered-federated-learning). The paper's own words
# first: every learning rate a method has is the paper's 0.01 and its local work is E = 5 epochs (FedFomo's
# budget); the knobs the paper does not state come from the FedFomo authors' code (NVlabs/FedFomo
# federated/args.py), which carries these baselines' arguments and their defaults:
FEDFOMO_BASELINES = {
    # α = β = 0.01: both of Per-FedAvg's step sizes are learning rates (args.py's --beta default, 1.0, is
    # shared with pFedMe's averaging β and is not one)
    "perfedavg": {"inner_lr": 0.01, "outer_lr": 0.01},
    # η = the config's lr 0.01 and ν = 0.01 (the paper's lr); λ = 15, K = 5, β = 1: args.py's --lamda, --K,
    # --beta (its --personal_learning_rate default, 0.09, is the pFedMe paper's, not this paper's lr)
    "pfedme": {"lam": 15.0, "K": 5, "personal_lr": 0.01, "beta": 1.0},
    # ε1 = 0.42, ε2 = 1.6: args.py's --epsilon_1, --epsilon_2; no warm-up: args.py has none (the 20-round
    # warm-up, c_round > 20, is in the CFL authors' notebook loop, which a 20-round run never passes)
    "cfl": {"eps1": 0.42, "eps2": 1.6, "min_rounds": 0},
}
# The pFedMe code's optimizers take plain steps (optimizers/fedoptimizer.py: MySGD, pFedMeOptimizer: no weight
# decay); rayfl's Per-FedAvg and pFedMe refuse a weight decay they would not apply.
FEDFOMO_BASELINES_CONFIG = {"perfedavg": {"weight_decay": 0.0}, "pfedme": {"weight_decay": 0.0}}


def column(rows: tuple, values: tuple, metric: str = "test_acc_mean") -> dict:
    """One column of a paper's table, its values in ``rows`` order, as a preset's ``paper`` dict."""
    return {row: {metric: v} for row, v in zip(rows, values)}


# FedFomo's Table 2 (CIFAR-10, 15 clients, latent distributions): one column per number of distributions.
FEDFOMO_LATENT = {
    2: (60.03, 38.92, 53.43, 66.42, 70.87, 83.79, 72.58, 63.85, 49.87, 77.823, 79.59),
    3: (66.61, 21.56, 33.87, 31.38, 74.16, 73.68, 75.69, 69.70, 66.95, 82.38, 83.66),
    4: (69.12, 22.34, 65.73, 50.61, 67.25, 71.23, 78.31, 72.60, 69.00, 84.45, 84.35),
    5: (76.52, 32.13, 63.32, 48.20, 63.64, 69.02, 70.04, 76.61, 78.66, 85.050, 85.534),
    10: (92.64, 10.10, 41.61, 13.41, 94.42, 94.28, 85.22, 93.97, 94.57, 95.55, 95.55),
}

# FedeRiCo's Table 1 (Sui et al., 2022, CIFAR-10): its rows, FedFomo with 20% of each client's training data held
# out (16% of all its data, the test split being 20%) and FedAvg+ as one epoch of local tuning (fedavg-ft).
FEDERICO_ROWS = ("fedavg", "fedavg-ft", "local", "cfl", "fedem", "fedfomo:val_frac=0.16", "federico")
FEDERICO_TABLE = {2: (11.44, 12.45, 40.09, 11.50, 41.21, 42.24, 56.61),
                  3: (11.73, 29.86, 55.27, 15.24, 55.08, 59.45, 69.76),
                  4: (13.93, 45.65, 69.03, 16.43, 63.61, 71.05, 78.22)}

# FedeRiCo's CFL and FedEM rows ran on the FedEM authors' code (Sui et al. 2022, Sec. 5, footnote 3:
# omarfoq/FedEM). Its ClusteredAggregator (aggregator.py) has tol_1 = 0.4, tol_2 = 1.6 (ε1, ε2: rayfl's
# defaults), splits only clusters of more than 2 clients (min_split_size 3, the default), with no warm-up
# (min_rounds 0) and by complete linkage on the cosine distances (scikit-learn's AgglomerativeClustering);
# FedEM with the paper's 4 components.
FEDERICO_BASELINES = {"cfl": {"min_rounds": 0, "linkage": "complete"}, "fedem": {"M": 4}}

# User-centric FL (Mestoukirdi et al.), Table I (worst user) beside Fig. 2's rows: k = 1..4 streams.
USERCENTRIC_STREAMS = ("usercentric:streams=1", "usercentric:streams=2", "usercentric:streams=3")

# PersFL's Tables 3 and 6 (Divi et al., MNIST, average over users), per data split.
PERSFL_ROWS = ("fedavg", "fedper", "pfedme", "perfedavg", "persfl", "persfl:variant=gd")


def persfl_baselines(split: int) -> tuple[dict, dict]:
    """(knobs, config) of PersFL's pFedMe and Per-FedAvg rows on a data split, as the authors ran them: their
    scripts pFedMe/pFedMe_MNIST.sh and pFedMe/PerFed_MNIST.sh (siddharthdivi/Unifying-Distillation-with-
    Personalization-in-Federated-Learning), which run the pFedMe authors' code with --num_global_iters 800
    (Table 7's 800 rounds) and --local_epochs 20: 20 local rounds of one batch (pFedMe), 20 meta-steps of two
    (Per-FedAvg). Their FedAvg, FedPer and PersFL settings are in a code module that is not public: those rows
    keep rayfl's defaults, with Table 7's rounds. Evaluated every 20 rounds and at the last."""
    perfedavg = {1: (0.001, 0.001), 2: (0.01, 0.01), 3: (0.01, 0.01)}[split]  # --learning_rate, --beta
    pfedme = {1: (0.02, 0.0025, 1.0, 15.0, 128), 2: (0.01, 0.0075, 1.0, 15.0, 128),
              3: (0.01, 0.05, 2.0, 30.0, 20)}[split]  # --learning_rate, --personal_learning_rate, --beta, --lamda, bs
    long = {"rounds": 800, "eval_every": 20}
    knobs = {"perfedavg": {"inner_lr": perfedavg[0], "outer_lr": perfedavg[1], "tau": 20},
             "pfedme": {"personal_lr": pfedme[1], "beta": pfedme[2], "lam": pfedme[3], "K": 5, "R": 20}}
    config = {"perfedavg": {**long, "batch_size": 128},
              "pfedme": {**long, "lr": pfedme[0], "batch_size": pfedme[4]}}
    return knobs, config


# FedFomo's Tables 3 and 5 (CIFAR-10): FedAvg and FedFomo under DP-SGD at sigma = 0, 1, 2 (sigma = 0: no DP here;
# the paper ran Opacus with clipping and no noise), and Appendix A.4's model-average variant.
DP_ROWS = ("fedavg", "fedavg:dp_noise=1", "fedavg:dp_noise=2", "fedfomo", "fedfomo:dp_noise=1", "fedfomo:dp_noise=2")
MA_ROWS = ("fedfomo:baseline=average", "fedfomo:dp_noise=1:baseline=average", "fedfomo:dp_noise=2:baseline=average")
DP_CONFIG = {**MNIST, "partition": "latent", "groups": 5, "clients": 15, "rounds": 20, **FEDFOMO_TRAINING,
             "dp_delta": 1e-5, "dp_clip": 1.0}  # C = 1, as the authors' code
DP_PAPER = {"fedavg": {"test_acc_mean": 19.37},
            "fedavg:dp_noise=1": {"test_acc_mean": 17.60, "dp_epsilon_mean": 10.26},
            "fedavg:dp_noise=2": {"test_acc_mean": 16.19, "dp_epsilon_mean": 3.57},
            "fedfomo": {"test_acc_mean": 71.56},
            "fedfomo:dp_noise=1": {"test_acc_mean": 71.28, "dp_epsilon_mean": 6.89},
            "fedfomo:dp_noise=2": {"test_acc_mean": 65.97, "dp_epsilon_mean": 1.70}}
MA_PAPER = {"fedfomo:baseline=average": {"test_acc_mean": 47.90},
            "fedfomo:dp_noise=1:baseline=average": {"test_acc_mean": 46.33, "dp_epsilon_mean": 9.26},
            "fedfomo:dp_noise=2:baseline=average": {"test_acc_mean": 43.76, "dp_epsilon_mean": 3.20}}

PRESETS = {p.name: p for p in [
    Preset("fedfomo-ood",
           "FedFomo Fig. 5 table: 15 clients, 5 latent distributions, (val, test) targets shuffled among clients "
           "(CIFAR-10 in the paper; MNIST here). FedFomo's extra update-only round is shown both ways.",
           FEDFOMO_ROWS,
           {**MNIST, "partition": "latent", "groups": 5, "clients": 15, "ood": True, "rounds": 20,
            **FEDFOMO_TRAINING},
           {"fedfomo": {"M": 5}, **FEDFOMO_BASELINES},
           column(FEDFOMO_ROWS, (20.39, 23.11, 42.15, 39.79, 38.95, 30.80, 29.73, 39.8, 43.7, 64.06, 63.98)),
           "Zhang et al. 2021, Fig. 5 table, CIFAR-10", row_config=FEDFOMO_BASELINES_CONFIG),
    Preset("fedfomo-pathological",
           "FedFomo Table 1: 15 clients, 2 classes each (MNIST, as in the paper), FedFomo's training settings. "
           "FedFomo's extra update-only round is shown both ways.",
           FEDFOMO_ROWS,
           {**MNIST, "partition": "pathological", "classes_per_client": 2, "clients": 15, "rounds": 20,
            **FEDFOMO_TRAINING},
           {"fedfomo": {"M": 5}, **FEDFOMO_BASELINES},
           column(FEDFOMO_ROWS, (99.62, 91.97, 91.99, 90.94, 99.79, 94.74, 95.00, 92.39, 97.70, 99.62, 99.63)),
           "Zhang et al. 2021, Table 1, MNIST 15 clients", row_config=FEDFOMO_BASELINES_CONFIG),
    Preset("fedfomo-pathological-100",
           "FedFomo Table 1, 100-client column: 100 clients with 2 classes each, 10% of them each round, 100 "
           "rounds (MNIST, as in the paper: 60,000 images there, MNIST's 10,000-image test set here). Evaluated "
           "every 10 rounds and at the last.",
           FEDFOMO_ROWS,
           {**MNIST, "partition": "pathological", "classes_per_client": 2, "clients": 100, "participation": 0.1,
            "rounds": 100, "eval_every": 10, **FEDFOMO_TRAINING},
           {"fedfomo": {"M": 5}, **FEDFOMO_BASELINES},
           column(FEDFOMO_ROWS, (94.25, 78.83, 78.85, 79.06, 84.17, 84.58, 92.26, 85.32, 88.40, 98.81, 98.71)),
           "Zhang et al. 2021, Table 1, MNIST 100 clients", row_config=FEDFOMO_BASELINES_CONFIG),
    Preset("fedfomo-latent",
           "FedFomo Table 2: 15 clients, latent distributions (PCA + k-means), every client every round "
           "(CIFAR-10 in the paper; MNIST here). --groups picks the paper's column (2, 3, 4, 5 or 10).",
           FEDFOMO_ROWS,
           {**MNIST, "partition": "latent", "groups": 5, "clients": 15, "rounds": 20, **FEDFOMO_TRAINING},
           {"fedfomo": {"M": 5}, **FEDFOMO_BASELINES},
           column(FEDFOMO_ROWS, FEDFOMO_LATENT[5]),
           "Zhang et al. 2021, Table 2, CIFAR-10 with 2, 3, 4, 5 or 10 latent distributions (the column of --groups)",
           ("groups", tuple((g, column(FEDFOMO_ROWS, v)) for g, v in FEDFOMO_LATENT.items())),
           row_config=FEDFOMO_BASELINES_CONFIG),
    Preset("fedfomo-dp",
           "FedFomo Table 3: FedAvg and FedFomo with DP-SGD at sigma = 0, 1, 2, delta = 1e-5, C = 1, 15 clients, 5 "
           "latent distributions, every client every round (CIFAR-10 in the paper; MNIST here). sigma = 0 rows train "
           "without DP; the epsilon columns are the mean and largest over clients.",
           DP_ROWS, DP_CONFIG, {"fedfomo": {"M": 5}}, DP_PAPER, "Zhang et al. 2021, Table 3, CIFAR-10"),
    Preset("fedfomo-dp-ma",
           "FedFomo Table 5: Table 3's rows and the model-average variant (Appendix A.4: each downloaded model weighed "
           "by the average of the uploads with and without it) at the same sigmas.",
           DP_ROWS + MA_ROWS, DP_CONFIG, {"fedfomo": {"M": 5}}, {**DP_PAPER, **MA_PAPER},
           "Zhang et al. 2021, Table 5, CIFAR-10"),
    Preset("usercentric-rotation",
           "User-centric FL S2: rotation groups (0/90/180/270) with Dirichlet(0.4) label shift, k = 4 streams "
           "(EMNIST, 100 users in the paper; MNIST, 20 users here). The paper's headline is the worst user; "
           "k = 1..3 are Fig. 2's curves.",
           ("local", "fedavg", "oracle", "cfl", "fedfomo", *USERCENTRIC_STREAMS, "usercentric"),
           {**MNIST, "partition": "rotation", "groups": 4, "label_shift": 0.4, "clients": 20, "rounds": 30,
            "lr": 0.1, "momentum": 0.9},
           {"usercentric": {"streams": 4}},
           {"local": {"test_acc_worst": 56.0}, "fedavg": {"test_acc_worst": 67.5},
            "oracle": {"test_acc_worst": 77.4}, "cfl": {"test_acc_worst": 76.1},
            "fedfomo": {"test_acc_worst": 73.6}, "usercentric": {"test_acc_worst": 76.4}},
           "Mestoukirdi et al., Table I, EMNIST covariate and label shift (worst user)"),
    Preset("usercentric-label-shift",
           "User-centric FL S1: Dirichlet(0.4) label shift, 20 users, k = m streams (full personalization) "
           "(EMNIST in the paper; MNIST here). The paper's headline is the worst user; k = 1..4 are Fig. 2's "
           "curves. No oracle: the users have no groups.",
           ("local", "fedavg", "cfl", "fedfomo", *USERCENTRIC_STREAMS, "usercentric:streams=4", "usercentric"),
           {**MNIST, "partition": "dirichlet", "alpha": 0.4, "clients": 20, "rounds": 30, "lr": 0.1,
            "momentum": 0.9},
           {"usercentric": {"streams": 0}},
           {"local": {"test_acc_worst": 58.8}, "fedavg": {"test_acc_worst": 68.9},
            "cfl": {"test_acc_worst": 70.3}, "fedfomo": {"test_acc_worst": 70.0},
            "usercentric": {"test_acc_worst": 73.2}},
           "Mestoukirdi et al., Table I, EMNIST label shift (worst user)"),
    Preset("usercentric-concept",
           "User-centric FL S3: concept shift, 4 groups of 5 users with their own label permutation, k = 4 "
           "streams (CIFAR-10 in the paper; MNIST here). The paper's headline is the worst user; k = 1..3 are "
           "Fig. 2's curves.",
           ("local", "fedavg", "oracle", "cfl", "fedfomo", *USERCENTRIC_STREAMS, "usercentric"),
           {**MNIST, "partition": "permutation", "groups": 4, "clients": 20, "rounds": 30, "lr": 0.1,
            "momentum": 0.9},
           {"usercentric": {"streams": 4}},
           {"local": {"test_acc_worst": 35.7}, "fedavg": {"test_acc_worst": 19.6},
            "oracle": {"test_acc_worst": 49.1}, "cfl": {"test_acc_worst": 48.6},
            "fedfomo": {"test_acc_worst": 45.5}, "usercentric": {"test_acc_worst": 49.1}},
           "Mestoukirdi et al., Table I, CIFAR-10 concept shift (worst user)"),
    Preset("federico-label-groups",
           "FedeRiCo Table 1: disjoint label groups, clients assigned to groups at random, no validation split "
           "(FedFomo holds out 20% of its training data), Adam lr 0.01 for every method (CIFAR-10, 3 groups in "
           "the paper; MNIST here). --groups picks the paper's column (2, 3 or 4).",
           FEDERICO_ROWS,
           {**MNIST, "partition": "label-groups", "groups": 3, "clients": 8, "rounds": 20, "optimizer": "adam",
            "lr": 0.01, "val_frac": 0.0},
           FEDERICO_BASELINES,
           column(FEDERICO_ROWS, FEDERICO_TABLE[3]),
           "Sui et al., 2022, Table 1, CIFAR-10 with 2, 3 or 4 distributions (the column of --groups)",
           ("groups", tuple((g, column(FEDERICO_ROWS, values)) for g, values in FEDERICO_TABLE.items()))),
    Preset("federico-sine",
           "FedeRiCo Fig. 1: linear models on successive intervals of a noisy sine curve (qualitative in the "
           "paper: collaborator weights concentrate on neighbouring intervals). Lower loss is better.",
           ("local", "fedavg", "federico"),
           {"dataset": "sine", "partition": "latent", "groups": 8, "clients": 8, "rounds": 100,
            "optimizer": "adam", "lr": 0.01, "val_frac": 0.0},
           {}, {}, "Sui et al., 2022, Fig. 1 (no numbers)"),
    Preset("persfl-ds1",
           "PersFL DS-1: 10 users with 4 classes each, equal sizes, 60/20/20 splits (MNIST, as in the paper), "
           "Table 7's rounds: 100 (FedAvg, FedPer, PersFL), 800 (pFedMe, Per-FedAvg, as the authors' scripts).",
           PERSFL_ROWS,
           {**MNIST, "partition": "pathological", "classes_per_client": 4, "clients": 10, "rounds": 100},
           persfl_baselines(1)[0],
           column(PERSFL_ROWS, (92.0, 98.3, 94.8, 98.9, 98.6, 98.7)),
           "Divi et al., Tables 3, 6 and 7, MNIST DS-1 (average over users)", row_config=persfl_baselines(1)[1]),
    Preset("persfl-ds2",
           "PersFL DS-2: 10 users, every class split among the users in Dirichlet(0.9) proportions (MNIST, as in "
           "the paper), Table 7's rounds: 50 (FedAvg, FedPer), 25 (PersFL's FedAvg stage), 800 (pFedMe, "
           "Per-FedAvg, as the authors' scripts).",
           PERSFL_ROWS,
           {**MNIST, "partition": "dirichlet", "alpha": 0.9, "clients": 10, "rounds": 50},
           persfl_baselines(2)[0],
           column(PERSFL_ROWS, (85.5, 85.5, 87.1, 87.6, 88.0, 87.3)),
           "Divi et al., Tables 3, 6 and 7, MNIST DS-2 (average over users)",
           row_config={**persfl_baselines(2)[1], "persfl": {"rounds": 25}}),
    Preset("persfl-ds3",
           "PersFL DS-3: 10 users with 2 classes each and log-normal(0, 2) sizes (MNIST, as in the paper), "
           "Table 7's rounds: 100 (FedAvg, FedPer, PersFL), 800 (pFedMe, Per-FedAvg, as the authors' scripts).",
           PERSFL_ROWS,
           {**MNIST, "partition": "pathological", "classes_per_client": 2, "sizes": "lognormal", "size_sigma": 2.0,
            "clients": 10, "rounds": 100},
           persfl_baselines(3)[0],
           column(PERSFL_ROWS, (96.4, 99.4, 98.2, 97.3, 99.4, 99.5)),
           "Divi et al., Tables 3, 6 and 7, MNIST DS-3 (average over users)", row_config=persfl_baselines(3)[1]),
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
