"""The front door, tried as a hostile but fair user would: every bad input below ends in exactly one line
``rayfl: error: ...`` on stderr naming the value, exit status 2, and no Ray process started.

Table-driven: each case is (id, argv, expected fragment of the message). Files the argv refers to (config
files, space files, tiny IDX data roots, run and sweep directories) are made in ``tmp_path``; ``{t}`` in an
argument stands for that directory. Most cases stop at the config check, so the whole battery needs no Ray.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import sys

import psutil
import pytest

from rayfl.cli import main

TINY = ["--dataset", "synthetic", "--partition", "iid", "--clients", "2", "--rounds", "1",
        "--samples-per-client", "40"]
SPACE = "{t}/space.yaml"  # a valid tiny space (grid over lr), written by the fixture


def run(*argv):
    return ["run", *TINY, *argv]


def from_file(name):
    """A config file with nothing on the command line that would override its keys."""
    return ["run", "--dataset", "synthetic", "--partition", "iid", "--samples-per-client", "40", "--config",
            "{t}/" + name]


def tune(*argv, space=SPACE):
    return ["tune", *TINY, "--space", space, *argv]


# --------------------------------------------------------------------------------------------------
# Files the cases refer to: name -> content (bytes are written as they are)
# --------------------------------------------------------------------------------------------------
def _idx(dims: list[int], data: bytes, dtype: int = 8) -> bytes:
    return bytes([0, 0, dtype, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + data


IMAGES = _idx([4, 28, 28], bytes(4 * 28 * 28))
LABELS = _idx([4], bytes([0, 1, 2, 3]))

DATA_ROOTS = {  # directory name -> {file name: bytes}; read as --dataset mnist --data-root {t}/<name>
    "gz_truncated": {"train-images-idx3-ubyte.gz": gzip.compress(IMAGES)[:40],
                     "train-labels-idx1-ubyte": LABELS},
    "gz_corrupt": {"train-images-idx3-ubyte.gz": b"\x1f\x8b\x08\x00" + os.urandom(64),
                   "train-labels-idx1-ubyte": LABELS},
    "gz_not_gzip": {"train-images-idx3-ubyte": IMAGES, "train-labels-idx1-ubyte.gz": b"plain text, not gzip"},
    "short_header": {"train-images-idx3-ubyte": IMAGES[:6], "train-labels-idx1-ubyte": LABELS},
    "short_dims": {"train-images-idx3-ubyte": IMAGES[:10], "train-labels-idx1-ubyte": LABELS},
    "labels_out_of_range": {"train-images-idx3-ubyte": IMAGES,
                            "train-labels-idx1-ubyte": _idx([4], bytes([0, 1, 12, 3]))},
    "labels_255": {"train-images-idx3-ubyte.gz": gzip.compress(IMAGES),
                   "train-labels-idx1-ubyte.gz": gzip.compress(_idx([4], bytes([255, 1, 2, 3])))},
    "length_mismatch": {"train-images-idx3-ubyte": IMAGES, "train-labels-idx1-ubyte": _idx([3], bytes([0, 1, 2]))},
    "wrong_dtype": {"train-images-idx3-ubyte": IMAGES, "train-labels-idx1-ubyte": _idx([4], bytes(16), dtype=0x0C)},
    "not_28x28": {"train-images-idx3-ubyte": _idx([4, 3, 5], bytes(60)), "train-labels-idx1-ubyte": LABELS},
    "labels_3d": {"train-images-idx3-ubyte": IMAGES, "train-labels-idx1-ubyte": _idx([4, 1, 1], bytes(4))},
    "truncated_data": {"train-images-idx3-ubyte": IMAGES[:-100], "train-labels-idx1-ubyte": LABELS},
    "padded_data": {"train-images-idx3-ubyte": IMAGES + b"\x00", "train-labels-idx1-ubyte": LABELS},
    "empty": {"train-images-idx3-ubyte": _idx([0, 28, 28], b""), "train-labels-idx1-ubyte": _idx([0], b"")},
    "t10k_bad": {"train-images-idx3-ubyte": IMAGES, "train-labels-idx1-ubyte": LABELS,
                 "t10k-images-idx3-ubyte": IMAGES, "t10k-labels-idx1-ubyte": _idx([4], bytes([9, 10, 0, 0]))},
}

def _laughs(levels: int = 9) -> str:
    """A few hundred bytes of nested aliases ("billion laughs"): each level 9 of the one before, 9**9 strings."""
    lines = ['params:', '  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


LAUGHS = _laughs()

FILES: dict[str, str | bytes] = {
    "space.yaml": "grid:\n  lr: [0.05, 0.1]\n",
    # config files
    "null_lr.yaml": "lr: null\n",
    "null_algo.yaml": "algo: null\n",
    "clients_true.yaml": "clients: true\n",
    "rounds_inf.yaml": "rounds: .inf\n",
    "lr_nan.yaml": "lr: .nan\n",
    "momentum_list.yaml": "momentum: [0.9]\n",
    "data_root_int.yaml": "data_root: 5\n",
    "data_root_list.yaml": "data_root: [a, b]\n",
    "tracking_int.yaml": "tracking_uri: 5\n",
    "download_maybe.yaml": "download: maybe\n",
    "seed_neg.yaml": "seed: -1\n",
    "latin1.yaml": b"run_name: caf\xe9\n",
    "bad_yaml.yaml": "lr: [1\n",
    "top_list.yaml": "- lr\n- 0.1\n",
    "top_scalar.yaml": "0.1\n",
    "unknown_key.yaml": "learning_rate: 0.1\n",
    "int_key.yaml": "1: 2\n",
    "params_list.yaml": "params: [1, 2]\n",
    "params_null.yaml": "params: null\n",
    "params_int_key.yaml": "params:\n  1: 2\n",
    "python_tag.yaml": "lr: !!python/object/apply:os.system ['touch {t}/pwned']\n",
    "knob_nan.yaml": "algo: fedfomo\nparams:\n  epsilon_decay: .nan\n",
    # space files
    "space_uniform_inf.yaml": "random:\n  lr: {uniform: [0.01, .inf]}\n",
    "space_loguniform_nan.yaml": "random:\n  lr: {loguniform: [0.001, .nan]}\n",
    "space_quniform_nan.yaml": "random:\n  lr: {quniform: [0.01, 0.1, .nan]}\n",
    "space_randint_inf.yaml": "random:\n  clients: {randint: [2, .inf]}\n",
    "space_grid_nan.yaml": "grid:\n  lr: [0.1, .nan]\n",
    "space_fixed_inf.yaml": "fixed:\n  lr: .inf\ngrid:\n  momentum: [0.0, 0.5]\n",
    "space_fixed_null.yaml": "fixed:\n  momentum: null\ngrid:\n  lr: [0.05, 0.1]\n",
    "space_grid_bool.yaml": "grid:\n  groups: [2, true]\n",
    "space_grid_M.yaml": "grid:\n  M: [2, 2.5]\n",
    "space_latin1.yaml": b"grid:\n  lr: [0.1]\n# caf\xe9\n",
    "space_choice_nan.yaml": "random:\n  momentum: {choice: [0.0, .nan]}\n",
    "dup_key.yaml": "lr: 0.1\nclients: 4\nlr: 0.2\n",
    "dup_knob.yaml": "algo: fedfomo\nparams:\n  M: 2\n  M: 3\n",
    "space_dup_key.yaml": "grid:\n  lr: [0.1]\n  lr: [0.2, 0.3]\n",
    # resume directories
    "run_no_ckpt/config.yaml": "dataset: synthetic\npartition: iid\nclients: 2\nrounds: 1\n",
    "run_bad_cfg/config.yaml": "lr: .nan\n",
    "sweep_bad_json/rayfl_sweep.json": "{not json",
    "sweep_no_keys/rayfl_sweep.json": json.dumps({"name": "x"}),
    "sweep_list/rayfl_sweep.json": "[1, 2]",
    "a_file": "just a file\n",
    # hostile files: nested past the recursion limit, aliases expanding to billions, NUL bytes
    "deep.yaml": "lr: " + "[" * 3000 + "]" * 3000 + "\n",
    "deep_block.yaml": "params:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "1\n",
    "laughs.yaml": LAUGHS,
    "self_alias.yaml": "params:\n  x: &a [1, *a]\n",
    "nul.yaml": 'experiment: "a\\0b"\n',
    "nul_knob.yaml": 'algo: fedfomo\nparams:\n  distance: "l2\\0"\n',
    "space_deep.yaml": "grid:\n  lr: " + "[" * 3000 + "]" * 3000 + "\n",
    "space_laughs.yaml": LAUGHS.replace("params:", "fixed:"),
}

# (id, argv, fragment): ``{t}`` is the tmp directory holding the files above.
CASES = [
    # --- non-finite and out-of-range numbers on the command line
    ("lr_inf", run("--lr", "inf"), "lr='inf': must be a finite number"),
    ("lr_nan", run("--lr", "nan"), "lr='nan': must be a finite number"),
    ("lr_minus_inf", run("--lr=-inf"), "lr='-inf': must be a finite number"),
    ("lr_zero", run("--lr", "0"), "lr=0.0: must be > 0"),
    ("lr_word", run("--lr", "fast"), "lr='fast': must be a finite number"),
    ("momentum_nan", run("--momentum", "nan"), "momentum='nan': must be a finite number"),
    # --- a DP knob for a run without DP is not silently ignored
    ("dp_clip_without_noise", run("--dp-clip", "0.5"),
     "dp_clip=0.5: differential privacy is off (dp_noise=0); give dp_noise > 0 (--dp-noise) to turn it on"),
    ("dp_accountant_without_noise", run("--dp-accountant", "prv"), "dp_accountant='prv': differential privacy is off"),
    ("momentum_negative", run("--momentum", "-0.5"), "momentum=-0.5: must be >= 0"),
    ("weight_decay_inf", run("--weight-decay", "inf"), "weight_decay='inf': must be a finite number"),
    ("weight_decay_negative", run("--weight-decay", "-1"), "weight_decay=-1.0: must be >= 0"),
    ("gpus_nan", run("--gpus-per-actor", "nan"), "gpus_per_actor='nan': must be a finite number"),
    ("gpus_negative", run("--gpus-per-actor", "-2"), "gpus_per_actor=-2.0: must be >= 0, or -1"),
    ("cpus_inf", run("--cpus-per-actor", "inf"), "cpus_per_actor='inf': must be a finite number"),
    ("cpus_negative", run("--cpus-per-actor", "-1"), "cpus_per_actor=-1.0: must be >= 0"),
    ("alpha_inf", run("--alpha", "inf"), "alpha='inf': must be a finite number"),
    ("size_sigma_inf", run("--size-sigma", "inf"), "size_sigma='inf': must be a finite number"),
    ("majority_nan", run("--majority", "nan"), "majority='nan': must be a finite number"),
    ("participation_inf", run("--participation", "inf"), "participation='inf': must be a finite number"),
    ("val_frac_nan", run("--val-frac", "nan"), "val_frac='nan': must be a finite number"),
    ("test_frac_big", run("--test-frac", "1.5"), "test_frac=1.5: must be in (0, 1)"),
    ("fracs_sum", run("--val-frac", "0.6", "--test-frac", "0.5"), "val_frac + test_frac = 1.1: must be below 1"),
    ("seed_negative", run("--seed", "-1"), "seed=-1: must be an integer in [0, 4294967295]"),
    ("seed_huge", run("--seed", "4294967296"), "seed=4294967296: must be an integer in [0, 4294967295]"),
    ("seed_fraction", run("--seed", "1.5"), "seed='1.5': must be an integer"),
    ("clients_fraction", run("--clients", "2.5"), "clients='2.5': must be an integer"),
    ("clients_zero", run("--clients", "0"), "clients=0: must be an integer >= 1"),
    ("rounds_negative", run("--rounds", "-3"), "rounds=-3: must be an integer >= 1"),
    ("rounds_inf", run("--rounds", "inf"), "rounds='inf': must be a finite number"),
    ("batch_size_zero", run("--batch-size", "0"), "batch_size=0: must be an integer >= 1"),
    ("local_epochs_zero", run("--local-epochs", "0"), "local_epochs=0: must be an integer >= 1"),
    ("eval_every_zero", run("--eval-every", "0"), "eval_every=0: must be an integer >= 1"),
    ("checkpoint_every_negative", run("--checkpoint-every", "-1"), "checkpoint_every=-1: must be an integer >= 0"),
    ("samples_negative", run("--samples-per-client", "-5"), "samples_per_client=-5: must be an integer >= 0"),
    ("torch_threads_zero", run("--torch-threads", "0"), "torch_threads=0: must be an integer >= 1"),
    ("groups_zero", run("--groups", "0"), "groups=0: must be an integer >= 1"),
    ("client_metrics_negative", run("--client-metrics", "-1"), "client_metrics=-1: must be an integer >= 0"),
    ("clients_per_actor_zero", run("--clients-per-actor", "0"), "clients_per_actor=0: must be auto or an integer"),
    ("clients_per_actor_fraction", run("--clients-per-actor", "2.5"),
     "clients_per_actor='2.5': must be auto or an integer"),
    ("optimizer_unknown", run("--optimizer", "rmsprop"), "optimizer='rmsprop': unknown; allowed: sgd, adam"),
    ("sizes_unknown", run("--sizes", "zipf"), "sizes='zipf': unknown; allowed: equal, lognormal"),
    ("algo_unknown", run("--algo", "nope"), "algo='nope': unknown"),
    # --- names, paths, stores, addresses
    ("tracking_scheme", run("--tracking-uri", "foo://bar"), "tracking_uri='foo://bar': unknown scheme"),
    ("tracking_store_unopenable", run("--tracking-uri", "sqlite:///{t}/a_file/m.db"),
     "tracking_uri='sqlite:///{t}/a_file/m.db': cannot open experiment 'rayfl' there (no directory {t}/a_file)"),
    ("tracking_sqlite_no_dir", run("--tracking-uri", "sqlite:///{t}/nowhere/m.db"),
     "tracking_uri='sqlite:///{t}/nowhere/m.db': cannot open experiment 'rayfl' there (no directory {t}/nowhere)"),
    ("tracking_sqlite_is_dir", run("--tracking-uri", "sqlite:///{t}", "--experiment", "e"),
     "tracking_uri='sqlite:///{t}': cannot open experiment 'e' there (it is a directory)"),
    ("tracking_server_silent", run("--tracking-uri", "http://127.0.0.1:1"),
     "tracking_uri='http://127.0.0.1:1': cannot open experiment 'rayfl' there (no server answers at 127.0.0.1:1: "
     "Connection refused)"),
    ("tracking_file_store", run("--tracking-uri", "{t}/mlruns_here"),
     ": a file store; MLflow 3 refuses its filesystem backend unless "
     "MLFLOW_ALLOW_FILE_STORE=true is set: use sqlite:///PATH"),
    ("tracking_file_scheme", run("--tracking-uri", "file:///{t}/mlruns"), "a file store; MLflow 3 refuses"),
    ("run_name_slash", run("--run-name", "a/b"), "run_name='a/b': must be a non-empty name without '/'"),
    ("run_name_empty", run("--run-name", ""), "run_name='': must be a non-empty name"),
    ("run_name_dotdot", run("--run-name", ".."), "run_name='..': must be a non-empty name"),
    ("experiment_empty", run("--experiment", " "), "experiment=' ': must be a non-empty name"),
    ("out_dir_unwritable", run("--out-dir", "{t}/a_file/runs", "--tracking-uri", "sqlite:///{t}/m.db"),
     "out_dir='{t}/a_file/runs': cannot write the run directory"),
    ("out_dir_is_file", run("--out-dir", "{t}/a_file"), "out_dir='{t}/a_file': exists and is not a directory"),
    ("data_root_missing", run("--data-root", "/no/such/dir"), "data_root='/no/such/dir': no such directory"),
    ("data_root_file", run("--data-root", "{t}/a_file"), "data_root='{t}/a_file': no such directory"),
    ("address_refused", run("--address", "127.0.0.1:1"), "address='127.0.0.1:1': no Ray cluster answers there"),
    ("address_no_port", run("--address", "foo"), "address='foo': expected HOST:PORT"),
    ("address_port_range", run("--address", "127.0.0.1:99999"), "address='127.0.0.1:99999': expected HOST:PORT"),
    ("address_url", run("--address", "http://127.0.0.1:8265"), "address='http://127.0.0.1:8265': expected HOST:PORT"),
    ("address_unknown_host", run("--address", "no-such-host.invalid:6379"),
     "address='no-such-host.invalid:6379': no Ray cluster answers there"),
    # --- flags argparse itself refuses: one line too
    ("flag_missing_value", ["run", "--rounds"], "--rounds: expected one argument"),
    ("flag_unknown", ["run", "--nope"], "unrecognized arguments: --nope"),
    ("command_unknown", ["fly"], "invalid choice: 'fly'"),
    ("param_no_equals", run("-p", "novalue"), "--param 'novalue': expected KEY=VALUE"),
    ("param_no_key", run("-p", "=3"), "--param '=3': expected KEY=VALUE"),
    ("param_unknown", run("-p", "nope=1"), "nope=1: unknown parameter for algorithm 'fedavg'; allowed: "),
    # --- algorithm knobs
    ("fedfomo_M_fraction", run("--algo", "fedfomo", "-p", "M=2.5"), "M=2.5 for algorithm 'fedfomo': must be an integer"),
    ("fedfomo_M_bool", run("--algo", "fedfomo", "-p", "M=true"), "M=True for algorithm 'fedfomo': must be an integer"),
    ("fedfomo_epsilon_decay_nan", run("--algo", "fedfomo", "-p", "epsilon_decay=nan"),
     "epsilon_decay='nan' for algorithm 'fedfomo': must be a finite number"),
    ("fedfomo_epsilon_inf", run("--algo", "fedfomo", "-p", "epsilon=.inf"),
     "epsilon=inf for algorithm 'fedfomo': must be a finite number"),
    ("fedfomo_lr_decay_inf", run("--algo", "fedfomo", "-p", "lr_decay=inf"),
     "lr_decay='inf' for algorithm 'fedfomo': must be a finite number"),
    ("fedfomo_distance_list", run("--algo", "fedfomo", "-p", "distance=[l2]"),
     "distance=['l2'] for algorithm 'fedfomo': must be a string"),
    ("persfl_T_inf", run("--algo", "persfl", "-p", "T=inf"), "T='inf' for algorithm 'persfl': must be a finite number"),
    ("persfl_lam_nan", run("--algo", "persfl", "-p", "lam=nan"), "lam='nan' for algorithm 'persfl': must be a finite"),
    ("persfl_lam_grid_nan", run("--algo", "persfl", "-p", "lam_grid=[0.1, .nan]"),
     "lam_grid=[0.1, nan] for algorithm 'persfl': must be a finite number"),
    ("persfl_T_grid_inf", run("--algo", "persfl", "-p", "T_grid=1,inf"),
     "T_grid='1,inf' for algorithm 'persfl': must be a finite number"),
    ("persfl_lam_grid_mapping", run("--algo", "persfl", "-p", "lam_grid={a: 1}"),
     "lam_grid={'a': 1} for algorithm 'persfl': must be a list"),
    ("fedmoe_ft_lr_inf", run("--algo", "fedmoe", "-p", "ft_lr=inf"), "ft_lr='inf' for algorithm 'fedmoe': must be a finite"),
    ("fedmoe_patience_fraction", run("--algo", "fedmoe", "-p", "patience=1.5"),
     "patience=1.5 for algorithm 'fedmoe': must be an integer"),
    ("federico_M_list", run("--algo", "federico", "-p", "M=[1, 2]"), "M=[1, 2] for algorithm 'federico': must be an integer"),
    ("federico_beta_null", run("--algo", "federico", "-p", "beta=null"),
     "beta=None for algorithm 'federico': must be a finite number"),
    ("usercentric_streams_negative", run("--algo", "usercentric", "-p", "streams=-1"), "streams=-1: must be in [0"),
    ("finetune_epochs_fraction", run("--algo", "fedavg-ft", "-p", "ft_epochs=0.5"),
     "ft_epochs=0.5 for algorithm 'fedavg-ft': must be an integer"),
    # --- config files
    ("yaml_null", from_file("null_lr.yaml"), "lr=null: must be a finite number"),
    ("yaml_null_string_field", from_file("null_algo.yaml"), "algo=null: must be a string"),
    ("yaml_clients_true", from_file("clients_true.yaml"), "clients=True: must be an integer, not a boolean"),
    ("yaml_rounds_inf", from_file("rounds_inf.yaml"), "rounds=inf: must be a finite number"),
    ("yaml_lr_nan", from_file("lr_nan.yaml"), "lr=nan: must be a finite number"),
    ("yaml_momentum_list", from_file("momentum_list.yaml"), "momentum=[0.9]: must be a finite number"),
    ("yaml_data_root_int", from_file("data_root_int.yaml"), "data_root=5: must be a string"),
    ("yaml_data_root_list", from_file("data_root_list.yaml"), "data_root=['a', 'b']: must be a string"),
    ("yaml_tracking_int", from_file("tracking_int.yaml"), "tracking_uri=5: must be a string"),
    ("yaml_download_maybe", from_file("download_maybe.yaml"), "download='maybe': must be true or false"),
    ("yaml_seed_negative", from_file("seed_neg.yaml"), "seed=-1: must be an integer in [0"),
    ("yaml_not_utf8", from_file("latin1.yaml"), "config file '{t}/latin1.yaml': not UTF-8 text"),
    ("yaml_invalid", from_file("bad_yaml.yaml"), "config file '{t}/bad_yaml.yaml': not valid YAML"),
    ("yaml_top_list", from_file("top_list.yaml"), "must hold a mapping of config keys, not a list"),
    ("yaml_top_scalar", from_file("top_scalar.yaml"), "must hold a mapping of config keys, not a float"),
    ("yaml_unknown_key", from_file("unknown_key.yaml"), "unknown config key 'learning_rate'"),
    ("yaml_int_key", from_file("int_key.yaml"), "unknown config key '1'"),
    ("yaml_params_list", from_file("params_list.yaml"), "params=[1, 2] in {t}/params_list.yaml: must be a mapping"),
    ("yaml_params_null", from_file("params_null.yaml"), "params=None in {t}/params_null.yaml: must be a mapping"),
    ("yaml_params_int_key", from_file("params_int_key.yaml"), "params={1: 2} in {t}/params_int_key.yaml"),
    ("yaml_python_tag", from_file("python_tag.yaml"), "not valid YAML at line 1 (could not determine a constructor"),
    ("yaml_knob_nan", from_file("knob_nan.yaml"), "epsilon_decay=nan for algorithm 'fedfomo': must be a finite"),
    ("config_is_directory", run("--config", "{t}"), "config file '{t}': no such file"),
    # --- data roots: IDX files checked on load
    ("gz_truncated", run("--dataset", "mnist", "--data-root", "{t}/gz_truncated"),
     "{t}/gz_truncated/train-images-idx3-ubyte.gz: cannot be read as gzip"),
    ("gz_corrupt", run("--dataset", "mnist", "--data-root", "{t}/gz_corrupt"),
     "{t}/gz_corrupt/train-images-idx3-ubyte.gz: cannot be read as gzip"),
    ("gz_not_gzip", run("--dataset", "mnist", "--data-root", "{t}/gz_not_gzip"),
     "{t}/gz_not_gzip/train-labels-idx1-ubyte.gz: cannot be read as gzip"),
    ("idx_6_byte_header", run("--dataset", "mnist", "--data-root", "{t}/short_header"),
     "{t}/short_header/train-images-idx3-ubyte: IDX header cut short (6 bytes"),
    ("idx_short_dims", run("--dataset", "mnist", "--data-root", "{t}/short_dims"),
     "{t}/short_dims/train-images-idx3-ubyte: IDX header cut short (10 bytes"),
    ("labels_out_of_range", run("--dataset", "mnist", "--data-root", "{t}/labels_out_of_range"),
     "{t}/labels_out_of_range/train-labels-idx1-ubyte: label 12 is outside the class range [0, 9]"),
    ("labels_255_gz", run("--dataset", "mnist", "--data-root", "{t}/labels_255"),
     "train-labels-idx1-ubyte.gz: label 255 is outside the class range [0, 9]"),
    ("labels_out_of_range_t10k", run("--dataset", "fashion-mnist", "--data-root", "{t}/t10k_bad"),
     "{t}/t10k_bad/t10k-labels-idx1-ubyte: label 10 is outside the class range [0, 9]"),
    ("idx_length_mismatch", run("--dataset", "mnist", "--data-root", "{t}/length_mismatch"), "4 images but 3 labels"),
    ("idx_wrong_dtype", run("--dataset", "mnist", "--data-root", "{t}/wrong_dtype"),
     "{t}/wrong_dtype/train-labels-idx1-ubyte: not an IDX file of unsigned bytes"),
    ("idx_not_28x28", run("--dataset", "mnist", "--data-root", "{t}/not_28x28"), "3x5 images; mnist images are 28x28"),
    ("idx_labels_3d", run("--dataset", "mnist", "--data-root", "{t}/labels_3d"),
     "{t}/labels_3d/train-labels-idx1-ubyte: IDX file with 3 dimensions; expected 1"),
    ("idx_truncated_data", run("--dataset", "mnist", "--data-root", "{t}/truncated_data"),
     "{t}/truncated_data/train-images-idx3-ubyte: truncated or padded IDX file"),
    ("idx_padded_data", run("--dataset", "mnist", "--data-root", "{t}/padded_data"),
     "{t}/padded_data/train-images-idx3-ubyte: truncated or padded IDX file"),
    ("idx_empty", run("--dataset", "mnist", "--data-root", "{t}/empty"), "train-labels-idx1-ubyte: holds no samples"),
    # --- resume directories (a crafted checkpoint is tests/integration/test_faults.py's)
    ("resume_no_checkpoint", ["run", "--resume", "{t}/run_no_ckpt"], "--resume '{t}/run_no_ckpt': no checkpoint there"),
    ("resume_no_config", ["run", "--resume", "{t}/gz_corrupt"], "--resume '{t}/gz_corrupt': no config.yaml there"),
    ("resume_missing_dir", ["run", "--resume", "{t}/nowhere"], "--resume '{t}/nowhere': no config.yaml there"),
    ("resume_bad_saved_config", ["run", "--resume", "{t}/run_bad_cfg"],
     "--resume '{t}/run_bad_cfg': its config.yaml: lr=nan: must be a finite number"),
    ("resume_with_flags", ["run", "--resume", "{t}/run_no_ckpt", "--batch-size", "8"],
     "--resume '{t}/run_no_ckpt' with --batch-size: a resumed run keeps its saved config"),
    ("resume_with_param", ["run", "--resume", "{t}/run_no_ckpt", "-p", "M=3"], "with --param: a resumed run keeps"),
    # --- tune: sweep flags
    ("tune_metric_unknown", tune("--metric", "val_accuracy"), "--metric val_accuracy: unknown for a classification task"),
    ("tune_metric_test", tune("--metric", "test_acc_mean"), "--metric test_acc_mean: hyperparameters are selected on "
                                                            "validation, never on test"),
    ("tune_metric_global", tune("--metric", "global_acc_mean"), "--metric global_acc_mean: hyperparameters are selected"),
    ("tune_metric_regression", ["tune", "--dataset", "sine", "--partition", "latent", "--clients", "2", "--rounds", "1",
                                "--groups", "2", "--model", "mlp-small", "--space", SPACE, "--metric", "val_acc_mean"],
     "--metric val_acc_mean: unknown for a regression task"),
    ("tune_metric_no_val_split", tune("--val-frac", "0"), "--metric val_acc_mean: needs a validation split (val_frac=0.0"),
    ("tune_num_samples_zero", tune("--num-samples", "0"), "--num-samples=0: must be an integer >= 1"),
    ("tune_num_samples_negative", tune("--num-samples", "-2"), "--num-samples=-2: must be an integer >= 1"),
    ("tune_num_samples_word", tune("--num-samples", "many"), "--num-samples: invalid int value: 'many'"),
    ("tune_max_concurrent_zero", tune("--max-concurrent", "0"), "--max-concurrent=0: must be an integer >= 1"),
    ("tune_grace_period_zero", tune("--grace-period", "0"), "--grace-period=0: must be an integer >= 1"),
    ("tune_search_unknown", tune("--search", "bayes"), "--search: invalid choice: 'bayes'"),
    ("tune_name_slash", tune("--name", "a/b"), "--name='a/b': must be a directory name (no '/')"),
    ("tune_storage_unwritable", tune("--storage-path", "{t}/a_file/tune"), "--storage-path='{t}/a_file/tune': cannot write"),
    ("tune_lr_inf", tune("--lr", "inf"), "lr='inf': must be a finite number"),
    ("tune_address_refused", tune("--address", "127.0.0.1:1"), "address='127.0.0.1:1': no Ray cluster answers there"),
    ("tune_resume_missing", ["tune", "--resume", "{t}/nowhere"], "--resume '{t}/nowhere': no such directory"),
    ("tune_resume_bad_json", ["tune", "--resume", "{t}/sweep_bad_json"], "{t}/sweep_bad_json/rayfl_sweep.json: cannot be read"),
    ("tune_resume_missing_keys", ["tune", "--resume", "{t}/sweep_no_keys"], "{t}/sweep_no_keys/rayfl_sweep.json: no key 'algo'"),
    ("tune_resume_not_mapping", ["tune", "--resume", "{t}/sweep_list"], "{t}/sweep_list/rayfl_sweep.json: must hold a mapping"),
    ("tune_resume_with_flags", ["tune", "--resume", "{t}/sweep_no_keys", "--num-samples", "3"],
     "with --num-samples: a resumed sweep keeps its saved settings"),
    # --- space files
    ("space_uniform_inf", tune(space="{t}/space_uniform_inf.yaml"), "random.lr: uniform bounds must be finite numbers"),
    ("space_loguniform_nan", tune(space="{t}/space_loguniform_nan.yaml"),
     "random.lr: loguniform bounds must be finite numbers"),
    ("space_quniform_nan", tune(space="{t}/space_quniform_nan.yaml"), "random.lr: quniform bounds must be finite"),
    ("space_randint_inf", tune(space="{t}/space_randint_inf.yaml"), "random.clients: randint bounds must be finite"),
    ("space_grid_nan", tune(space="{t}/space_grid_nan.yaml"), "grid.lr: lr=nan: must be a finite number"),
    ("space_fixed_inf", tune(space="{t}/space_fixed_inf.yaml"), "fixed.lr: lr=inf: must be a finite number"),
    ("space_fixed_null", tune(space="{t}/space_fixed_null.yaml"), "fixed.momentum: momentum=null: must be a finite"),
    ("space_grid_bool", tune(space="{t}/space_grid_bool.yaml"), "grid.groups: groups=True: must be an integer"),
    ("space_grid_M_fraction", tune("--algo", "fedfomo", space="{t}/space_grid_M.yaml"),
     "grid.M: M=2.5 for algorithm 'fedfomo': must be an integer"),
    ("space_choice_nan", tune(space="{t}/space_choice_nan.yaml"), "random.momentum: momentum=nan: must be a finite"),
    ("yaml_dup_key", from_file("dup_key.yaml"), "key 'lr' given twice (line 3)"),
    ("yaml_dup_knob", from_file("dup_knob.yaml"), "key 'M' given twice (line 4)"),
    ("space_dup_key", tune(space="{t}/space_dup_key.yaml"), "key 'lr' given twice (line 3)"),
    ("experiment_nul", run("--experiment", "a\0b"), "experiment='a\\x00b': must not contain a NUL byte"),
    ("run_name_nul", run("--run-name", "a\0b"), "run_name='a\\x00b': must not contain a NUL byte"),
    ("out_dir_nul", run("--out-dir", "a\0b"), "out_dir='a\\x00b': must not contain a NUL byte"),
    ("space_not_utf8", tune(space="{t}/space_latin1.yaml"), "space file '{t}/space_latin1.yaml': not UTF-8 text"),
    ("space_missing", tune(space="{t}/nope.yaml"), "space file '{t}/nope.yaml': no such file"),
    # --- hostile files: bounded before anything walks or quotes them
    ("yaml_deep", from_file("deep.yaml"), "config file '{t}/deep.yaml': nested more than 32 levels deep (line 1)"),
    ("yaml_deep_block", from_file("deep_block.yaml"), "config file '{t}/deep_block.yaml': nested more than 32 levels"),
    ("yaml_billion_laughs", from_file("laughs.yaml"),
     "config file '{t}/laughs.yaml': more than 10,000 values (anchors and aliases counted each time they are used)"),
    ("yaml_alias_in_itself", from_file("self_alias.yaml"), "an alias refers to a node that contains it (line 2)"),
    ("yaml_nul", from_file("nul.yaml"), "experiment='a\\x00b': must not contain a NUL byte"),
    ("yaml_knob_nul", from_file("nul_knob.yaml"), "params='l2\\x00': must not contain a NUL byte"),
    ("space_deep", tune(space="{t}/space_deep.yaml"), "space file '{t}/space_deep.yaml': nested more than 32 levels"),
    ("space_billion_laughs", tune(space="{t}/space_laughs.yaml"), "space file '{t}/space_laughs.yaml': more than "
                                                                   "10,000 values"),
    ("param_deep", run("-p", "x=" + "[" * 1000 + "]" * 1000),
     "x='" + "[" * 80 + "'... (2000 characters): nested more than 32 levels deep"),
    ("param_too_long", run("-p", "x=" + "[" * 3000 + "]" * 3000), "-p='x=" + "[" * 78 + "'... (6002 characters): at most 4096"),
    ("experiment_30mb", run("--experiment", "x" * 30_000_000),
     "experiment='" + "x" * 80 + "'... (30000000 characters): at most 4096 characters"),
    ("run_name_long", run("--run-name", "r" * 5000), "(5000 characters): at most 4096 characters"),
    # --- numbers accepted without a word before
    ("torch_threads_huge", run("--torch-threads", "10000"), "torch_threads=10000: must be at most 256"),
    ("torch_threads_above_cpus", run("--torch-threads", str((os.cpu_count() or 1) + 1)),
     f"torch_threads={(os.cpu_count() or 1) + 1}: must be at most this machine's {os.cpu_count() or 1} CPUs"),
    ("tune_torch_threads_above_cpus", tune("--torch-threads", str((os.cpu_count() or 1) + 1)),
     f"torch_threads={(os.cpu_count() or 1) + 1}: must be at most this machine's {os.cpu_count() or 1} CPUs"),
    ("compare_torch_threads_above_cpus", ["compare", "--algos", "fedavg", "--seeds", "0", *TINY, "--torch-threads",
                                          str((os.cpu_count() or 1) + 1)],
     f"torch_threads={(os.cpu_count() or 1) + 1}: must be at most this machine's {os.cpu_count() or 1} CPUs"),
    ("batch_size_1e18", run("--batch-size", "1e18"), "batch_size=1000000000000000000: must be at most 10,000,000"),
    ("samples_per_client_1e18", run("--samples-per-client", "1e18"),
     "samples_per_client=1000000000000000000: must be at most 10,000,000"),
    ("rounds_1e18", run("--rounds", "1e18"), "rounds=1000000000000000000: must be at most 10,000,000"),
    ("momentum_1e300", run("--momentum", "1e300"), "momentum='1e300': must be 0 or of magnitude in [1e-12, 1e+12]"),
    ("momentum_one", run("--momentum", "1"), "momentum=1.0: must be in [0, 1)"),
    ("model_sine_on_digits", ["run", "--model", "sine-mlp"], "model='sine-mlp': does not fit dataset 'digits'; it is "
                                                             "meant for sine"),
    ("model_sine_on_synthetic", run("--model", "sine-mlp"), "model='sine-mlp': does not fit dataset 'synthetic'"),
    ("model_cnn_on_vectors", run("--model", "lenet5"), "model='lenet5': does not fit dataset 'synthetic'; it is meant "
                                                       "for cifar10, cifar100, digits, fashion-mnist, mnist"),
    ("model_logreg_on_sine", ["run", "--dataset", "sine", "--partition", "iid", "--model", "logreg"],
     "model='logreg': does not fit dataset 'sine'"),
    # --- NUL bytes in every string key and flag
    ("stage_cache_nul", run("--stage-cache", "a\0b"), "stage_cache='a\\x00b': must not contain a NUL byte"),
    ("tracking_uri_nul", run("--tracking-uri", "sqlite:///a\0b.db"),
     "tracking_uri='sqlite:///a\\x00b.db': must not contain a NUL byte"),
    ("data_root_nul", run("--data-root", "a\0b"), "data_root='a\\x00b': must not contain a NUL byte"),
    ("experiment_nul_equals", run("--experiment=a\0b"), "experiment='a\\x00b': must not contain a NUL byte"),
    ("param_nul", run("-p", "distance=l2\0"), "-p='distance=l2\\x00': must not contain a NUL byte"),
    ("config_path_nul", run("--config", "{t}/a\0.yaml"), "config='{t}/a\\x00.yaml': must not contain a NUL byte"),
    ("resume_nul", ["run", "--resume", "{t}/run\0"], "resume='{t}/run\\x00': must not contain a NUL byte"),
    ("address_nul", run("--address", "127.0.0.1:1\0"), "address='127.0.0.1:1\\x00': must not contain a NUL byte"),
    ("tune_name_nul", tune("--name", "a\0b"), "name='a\\x00b': must not contain a NUL byte"),
    # --- compare: a config file's params must be a mapping
    ("compare_params_null", ["compare", "--local", "--algos", "fedavg", "--config", "{t}/params_null.yaml"],
     "params=None in {t}/params_null.yaml: must be a mapping of algorithm knobs"),
    ("compare_params_list", ["compare", "--local", "--algos", "fedavg", "--config", "{t}/params_list.yaml"],
     "params=[1, 2] in {t}/params_list.yaml: must be a mapping of algorithm knobs"),
]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """The files the cases refer to, in tmp_path, which is also the working directory (nothing is written
    elsewhere: the default MLflow store and out-dir would land here)."""
    for name, content in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.replace("{t}", str(tmp_path)))
    for root, members in DATA_ROOTS.items():
        (tmp_path / root).mkdir()
        for name, content in members.items():
            (tmp_path / root / name).write_bytes(content)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _ray_processes() -> set[int]:
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if any(n in p.name() for n in ("raylet", "gcs_server", "ray::")):
                pids.add(p.pid)
        except psutil.NoSuchProcess:  # exited between the listing and the read: not running
            pass
    return pids


def test_the_battery_is_large_and_distinct():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(CASES) >= 80
    assert len({tuple(c[1]) for c in CASES}) == len(CASES)  # no two cases are the same command


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, fragment, files, capsys):
    t = str(files)
    argv = [a.replace("{t}", t) for a in argv]
    before = _ray_processes()
    was_up = _ray_up()  # another test module's Ray session may be up already
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("rayfl: error: ") and err.count("\n") == 1, err  # exactly one line
    assert fragment.replace("{t}", t) in err, err
    assert "Traceback" not in err
    assert _ray_up() == was_up  # Ray was not started (nor stopped)
    assert _ray_processes() <= before  # no raylet, GCS or worker was started
    assert not (files / "pwned").exists()  # a YAML tag never runs code


def test_ray_env_is_untouched_by_refused_commands(files, capsys):
    """A refused command leaves no Ray settings behind in the process (tests and notebooks run many)."""
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_gcs_server_port_wait_time_s")
    before = {k: os.environ.get(k) for k in keys}
    assert main(run("--address", "127.0.0.1:1")) == 2
    assert main(run("--lr", "nan")) == 2
    assert {k: os.environ.get(k) for k in keys} == before


def test_ray_start_failure_is_one_line_exit_1(files, capsys, monkeypatch):
    """Not the user's mistake, still no traceback: Ray failing to start is one line and exit status 1, and
    the environment is as it was."""
    import ray

    from rayfl.tracking import ensure_experiment

    uri = f"sqlite:///{files}/m.db"
    ensure_experiment(uri, "rayfl")  # MLflow's first-use messages are not what this test reads
    capsys.readouterr()
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    before = {k: os.environ.get(k) for k in keys}
    seen = {}

    def failing_init(**kwargs):
        seen.update(kwargs, auth=os.environ.get("RAY_AUTH_MODE"), token=os.environ.get("RAY_AUTH_TOKEN"))
        raise RuntimeError("Failed to start GCS.\nLast 10 lines of error files: ...")

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process (other modules' Ray may be up)
    assert main(run("--tracking-uri", uri, "--out-dir", f"{files}/runs")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("rayfl: error: a local Ray instance did not start (RuntimeError: Failed to start GCS.)")
    # what the private instance was asked for: loopback only, no dashboard, a fresh token
    assert seen["address"] == "local" and seen["_node_ip_address"] == "127.0.0.1" and not seen["include_dashboard"]
    assert seen["auth"] == "token" and len(seen["token"]) == 64
    # an actor's partial sum of a 159k-parameter model (float64) travels inside the reply, not the object store
    assert seen["_system_config"]["max_direct_call_object_size"] >= 159_010 * 8
    assert {k: os.environ.get(k) for k in keys} == before


@pytest.mark.parametrize("uri", ["sqlite:///m.db", "sqlite:////abs/m.db", "sqlite+pysqlite:///m.db", "sqlite://",
                                 "postgresql://u@h/db", "postgresql+psycopg2://u@h/db", "mysql+pymysql://h/db",
                                 "mssql+pyodbc://h/db", "postgresql+a+b://h/db", "sqlitex:///m.db", "mysqlx://h",
                                 "http://127.0.0.1:5000", "https://h", "file:///tmp/mlruns", "/tmp/mlruns",
                                 "mlruns", "databricks", "databricks-uc", "uc", "databricks://profile", "foo://bar",
                                 "s3://bucket/x", "ftp://h", "HTTP://h"])
def test_tracking_schemes_are_mlflows_own(uri):
    """The scheme check runs without importing MLflow (1.3 s of start-up); it must accept and refuse what
    MLflow's own store registry does."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    from rayfl.config import tracking_scheme

    try:
        _tracking_store_registry.get_store_builder(uri)
        mlflow_has_store = True
    except Exception:  # noqa: BLE001 - MLflow's "unsupported URI" errors vary
        mlflow_has_store = False
    assert (tracking_scheme(uri) is not None) == mlflow_has_store
