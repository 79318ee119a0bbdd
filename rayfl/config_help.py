"""Every config key's help text, in the groups that ``rayfl run --help`` shows and ``help(rayfl.run)`` lists."""

from rayfl.config import FIELDS

# Flag help, grouped as the help screen shows them. Every Config field is a flag (dashes for underscores).
GROUPS = {
    "what runs": {
        "algo": "algorithm (see `rayfl algos`)",
        "dataset": "digits (offline default) | mnist | fashion-mnist | cifar10 | cifar100 | synthetic | sine | "
                   "folder:PATH (ImageFolder) | npz:PATH (arrays x, y, optional client) | a registered name",
        "data_root": "directory holding the dataset's files (MNIST IDX files work directly)",
        "download": "allow torchvision to download the dataset (needs network)",
        "model": "network; auto picks one for the dataset (see `rayfl algos`), torchvision:NAME (untrained, e.g. "
                 "torchvision:resnet18) or a registered name",
        "buffers": "BatchNorm statistics: global (averaged with the weights) | local (each client's own: FedBN)",
    },
    "how the data is split": {
        "partition": "iid | pathological | dirichlet | latent | majority | label-groups | rotation | permutation | "
                     "natural (the dataset's own client column)",
        "classes_per_client": "classes per client (pathological)",
        "alpha": "Dirichlet concentration (dirichlet)",
        "groups": "number of latent / label / rotation / permutation groups",
        "group_assign": "clients to groups: blocks | random | auto (label-groups random, others blocks)",
        "label_shift": "Dirichlet alpha of a label shift on top of rotation / permutation groups (0: none)",
        "majority": "majority-class fraction p (majority)",
        "sizes": "client dataset sizes: equal | lognormal",
        "size_sigma": "sigma of the log-normal sizes",
        "samples_per_client": "cap on each client's samples (0: divide the whole dataset)",
        "val_frac": "validation fraction of each client's data",
        "test_frac": "test fraction of each client's data",
        "ood": "swap (validation, test) pairs among clients (FedFomo's out-of-distribution setting)",
    },
    "federation and local training": {
        "clients": "number of clients",
        "rounds": "communication rounds (stages such as fine-tuning add their own)",
        "participation": "fraction of clients sampled each round, in (0, 1]",
        "local_epochs": "local epochs per round",
        "lr": "learning rate",
        "batch_size": "minibatch size",
        "optimizer": "sgd | adam",
        "momentum": "SGD momentum",
        "weight_decay": "weight decay",
        "seed": "seed of the partition, initialisation, sampling and training",
    },
    "differential privacy": {
        "dp_noise": "noise multiplier: sigma of DP-SGD (sample level) or z of DP-FedAvg (user level); 0: off",
        "dp_clip": "norm bound: C of each sample's gradient (sample level) or S of each user's update (user level)",
        "dp_delta": "delta at which epsilon is reported, in (0, 1)",
        "dp_level": "sample: DP-SGD in every client's training | user: each round's clipped updates summed, "
                    "noised once (averaging algorithms)",
        "dp_accountant": "rdp | prv (Opacus's accountants; one per client over all its private steps)",
    },
    "evaluation, tracking, keeping": {
        "eval_every": "evaluate every client every N rounds (the last round always)",
        "client_metrics": "per-client values also as MLflow metrics (client/<id>/...) for federations of up to N "
                          "clients; always in a table per round (default 0: the run page opens on the summary)",
        "checkpoint_every": "checkpoint every N rounds (0: never); resume with --resume DIR",
        "snapshot_every": "in-memory snapshot of every client every N rounds, replayed from when an actor dies "
                          "(0: only at the start)",
        "max_restarts": "dead client actors / driver restarts survived before the run fails",
        "capacity_wait": "seconds to wait for room for client actors lost with a node (the autoscaler's new "
                         "node); then the run ends, leaving a checkpoint that --resume continues",
        "out_dir": "where run directories (config, checkpoints) go",
        "tracking_uri": "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
        "tracking_wait": "seconds the run's end waits for a tracking server that does not answer; then what was "
                         "not sent stays in the run directory, for `rayfl sync RUN_DIR`",
        "system_metrics_interval": "seconds between samples of CPU, memory, disk, network and GPU use (MLflow's "
                                   "system metrics; GPUs need `pip install nvidia-ml-py`) for a run and a sweep's or "
                                   "comparison's parent run (0: off)",
        "experiment": "MLflow experiment name",
        "run_name": "MLflow run name",
        "stage_cache": "directory where runs share stages whose inputs agree, e.g. PersFL's FedAvg stage "
                       "across (lam, T) (empty: off; `rayfl tune` uses <sweep>/stages)",
    },
    "resources": {
        "clients_per_actor": "clients hosted by one client actor (auto: one actor per client while the "
                             "cluster has a CPU share or GPU slice for each, else clients spread evenly)",
        "cpus_per_actor": "CPUs reserved per client actor (0: an even share of the cluster)",
        "gpus_per_actor": "GPUs per client actor, fractional allowed (-1: automatic share)",
        "torch_threads": "torch threads per client actor",
    },
}
assert {k for g in GROUPS.values() for k in g} == set(FIELDS) - {"params"}, "every Config field needs help"
