"""The hostile-input battery: directories handed over, hangs, memory, tracebacks, silent accepts, raw exceptions.

Each case is a command line (``rayfl ...``) or a Python API call, the inputs it needs built small in a
directory (``{t}`` in an argument or a file stands for it), and what must come of it: the exit status (2 for
a mistake, 1 for a failure), a fragment of the one line printed, and files that must not exist afterwards
(markers a plugin would write, a store a sync would create). Large inputs are stood for by small ones through
their headers (an IDX file that declares 640,000 images, a PNG that declares 60000x60000 pixels) and by
``available`` (the memory the budget sees, in bytes), so that a refusal before loading is what is asserted.

``tests/unit/test_hostile_inputs.py`` runs every case in its own process (no Ray starts; each is refused before).
Run as a script, this module is the generator of the next battery: it runs every case as a user would, in a
fresh ``rayfl`` process with a timeout and its memory watched, and prints how each ended (one line, a
traceback, a hang, a silent accept) next to what was expected::

    python tests/hostile_battery.py [CASE_ID_FRAGMENT ...]
"""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field


@dataclass
class Link:
    """A symbolic link to ``target`` (``{t}`` expanded), made where a file would be."""

    target: str


@dataclass
class Case:
    id: str
    category: str
    argv: list[str] | None = None  # a command line; or
    api: str | None = None  # Python source calling rayfl's API (``rayfl`` imported)
    code: int = 2
    fragment: str = ""
    env: dict = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)  # paths ({t}) that must not exist afterwards
    available: int | None = None  # the memory the budget sees (psutil's available), where a case needs it
    timeout: float = 60.0


TINY = ["--dataset", "synthetic", "--partition", "iid", "--clients", "2", "--rounds", "1",
        "--samples-per-client", "40"]
API_TINY = "dataset='synthetic', partition='iid', clients=2, rounds=1, samples_per_client=40, progress=False"
RUN_ID = "0123456789abcdef0123456789abcdef"


def run(*argv: str) -> list[str]:
    return ["run", *TINY, *argv]


def _idx(dims: list[int], data: bytes, dtype: int = 8) -> bytes:
    return bytes([0, 0, dtype, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + data


def _gz_idx_declaring(n: int, sent: int) -> bytes:
    """A .gz IDX file whose header declares ``n`` 28x28 images but holds only ``sent`` of them."""
    return gzip.compress(_idx([n, 28, 28], bytes(sent * 784)))


def _npz(**arrays) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height 1-bit grayscale pixels (no image data: the header is what a
    loader reads first)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IEND", b""))


def _run_json(uri: str | None, **extra) -> str:
    return json.dumps({"run_id": RUN_ID, "tracking_uri": uri, "experiment_id": "1", "status": "FINISHED",
                       "end_time": 1, **extra})


def _outbox(name: str, uri: str = "sqlite:///{t}/store_{name}.db", **files) -> dict:
    """A run directory ``name`` whose outbox records ``uri`` (``{name}`` expanded) and holds ``files``."""
    out = {f"{name}/mlflow_outbox/run.json": _run_json(uri.replace("{name}", name))}
    out.update({f"{name}/mlflow_outbox/{k}": v for k, v in files.items()})
    return out


MARKER = "open(os.path.join({t!r}, 'MARKER'), 'w').close()"
EVIL = "import os\nopen(os.path.join(os.path.dirname(__file__), 'MARKER'), 'w').close()\n"
GOOD_ALGORITHM = ("from rayfl.algorithms import get_algorithm\nfrom rayfl.algorithms.base import Algorithm\n"
                  "f = get_algorithm('fedavg')\n"
                  "ALGORITHM = Algorithm('evil', f.Params, f.Server, f.ClientLogic, 'FedAvg under another name')\n")
PLUGIN_RECORD = "plugins:\n- source: {source}\n  algorithms: [evil]\n"
RUN_CONFIG = "algo: evil\ndataset: synthetic\npartition: iid\nclients: 2\nrounds: 1\n"
META = {"name": "s", "algo": "fedavg", "base": {}, "space": {"grid": {"lr": [0.1]}}, "space_path": "x",
        "swept": ["lr"], "metric": "val_acc_mean", "mode": "max", "search": "random", "scheduler": "fifo",
        "num_samples": 10**9}

FILES: dict[str, str | bytes | Link] = {
    "space.yaml": "grid:\n  lr: [0.05, 0.1]\n",
    "secret.txt": "the outbox must never send this\n",
    # --- directories handed over: a run directory's plugin record names code that must not run
    "evil.py": EVIL,
    "good.py": GOOD_ALGORITHM,
    "run_abs/config.yaml": RUN_CONFIG,
    "run_abs/plugins.yaml": PLUGIN_RECORD.format(source="{t}/evil.py"),
    "run_rel/config.yaml": RUN_CONFIG,
    "run_rel/plugins.yaml": PLUGIN_RECORD.format(source="evil.py"),
    "run_module/config.yaml": RUN_CONFIG,
    "run_module/plugins.yaml": PLUGIN_RECORD.format(source="json.tool"),
    "run_record_link/config.yaml": RUN_CONFIG,
    "run_record_link/plugins.yaml": Link("{t}/run_abs/plugins.yaml"),
    # --- outboxes: links out of them, stores they would create, files that are not what a run writes
    **_outbox("ob_link_file", **{"files/000001/secret.txt": Link("{t}/secret.txt")}),
    **_outbox("ob_link_dir", **{"files/000001/up": Link("{t}")}),
    **_outbox("ob_link_tree", **{"files/000002": Link("{t}/ob_link_dir/mlflow_outbox/files/000001")}),
    **_outbox("ob_link_metrics", **{"metrics.jsonl": Link("{t}/secret.txt")}),
    "ob_link_run/mlflow_outbox/run.json": Link("{t}/ob_link_file/mlflow_outbox/run.json"),
    **_outbox("ob_link_files", **{"files": Link("{t}/ob_link_dir/mlflow_outbox/files")}),
    "ob_link_box/mlflow_outbox": Link("{t}/ob_link_file/mlflow_outbox"),
    **_outbox("ob_new_store"),
    **_outbox("ob_http_empty", uri="http://"),
    **_outbox("ob_proc", uri="/proc/self/mlruns"),
    **_outbox("ob_relative", uri="sqlite:///store.db"),
    **_outbox("ob_postgres", uri="postgresql://alice:s3cret@db.example/mlflow"),
    "ob_garbage_run/mlflow_outbox/run.json": "{garbage",
    "ob_list_run/mlflow_outbox/run.json": "[1, 2]",
    **_outbox("ob_metric_no_key", **{"metrics.jsonl": '{"value": 1, "timestamp": 1, "step": 0}\n'}),
    **_outbox("ob_metric_text", **{"metrics.jsonl": '{"key": "a", "value": "high", "timestamp": 1, "step": 0}\n'}),
    **_outbox("ob_metric_inf_step", **{"metrics.jsonl": '{"key": "a", "value": 1, "timestamp": 1, "step": 1e999}\n'}),
    **_outbox("ob_metric_list", **{"metrics.jsonl": '[1, 2]\n'}),
    **_outbox("ob_param_dict", **{"params.jsonl": '{"key": "a", "value": {"b": 1}}\n'}),
    **_outbox("ob_delivered_garbage", **{"delivered.jsonl": "garbage\n{\"status\": \"FINISHED\"}\n"}),
    # --- memory: headers that declare what a small file does not hold
    "idx640k/train-images-idx3-ubyte.gz": _gz_idx_declaring(640_000, 90),
    "idx640k/train-labels-idx1-ubyte": _idx([640_000], bytes(640_000)),
    "label1e9.npz": b"",  # written by build() (numpy), as are the others below
    "label2e62.npz": b"",
    "nofeatures.npz": b"",
    "owners1e6.npz": b"",
    "bomb/a/big.png": _png_header(60000, 60000),
    "bomb/b/big.png": _png_header(60000, 60000),
    "sweep_1e9/rayfl_sweep.json": json.dumps(META),
    "sweep_grid_1e9/rayfl_sweep.json": json.dumps({**META, "search": "grid", "num_samples": 1,
                                                   "n_trials": 10**9}),
    "grid_1e9.yaml": "grid:\n" + "".join(f"  {k}: [{', '.join(str(0.001 * (i + 1)) for i in range(1000))}]\n"
                                          for k in ("lr", "momentum", "weight_decay")),
    # --- numbers YAML 1.1 reads otherwise than they look, and ones Python will not read
    "octal.yaml": "dataset: synthetic\npartition: iid\nsamples_per_client: 40\nclients: 010\n",
    "sexagesimal.yaml": "dataset: synthetic\npartition: iid\nsamples_per_client: 40\nrounds: 1:0\n",
    "digits_5000.yaml": "seed: " + "1" * 5000 + "\n",
    "space_empty.yaml": "fixed:\n  lr: 0.1\n",
    "space_one_and_one.yaml": "grid:\n  clients: [2, 2.0]\n",
    # --- an ImageFolder whose class folder links back to its root
    "loop/a/x.png": b"",  # written by build() (PIL)
    "loop/b/x.png": b"",
    "loop/a/up": Link("{t}/loop"),
    # --- plugins that end the program, interrupt it, or raise what is not an Exception
    "exit3.py": "import sys\nsys.exit(3)\n",
    "exit0.py": "import sys\nsys.exit(0)\n",
    "os_exit0.py": "import os\nos._exit(0)\n",
    "interrupt.py": "raise KeyboardInterrupt\n",
    "base_exception.py": "class Odd(BaseException):\n    pass\nraise Odd('not an Exception')\n",
    "getattr_raises.py": "def __getattr__(name):\n    raise RuntimeError('no attributes here')\n",
    "check_raises.py": GOOD_ALGORITHM.replace("'evil'", "'checky'").replace(
        "ALGORITHM =", "import dataclasses\n@dataclasses.dataclass\nclass P:\n    def check(self, n):\n"
                      "        raise RuntimeError('check blew up')\nALGORITHM =").replace("f.Params", "P"),
    "loader_exits.py": "import sys\nfrom rayfl.data.datasets import DatasetSource\n"
                       "DATASET = DatasetSource('exiter', lambda: sys.exit(7))\n",
    "loader_interrupts.py": "from rayfl.data.datasets import DatasetSource\n"
                            "def load():\n    raise KeyboardInterrupt\n"
                            "DATASET = DatasetSource('interrupter', load)\n",
}


def build(t: str) -> None:
    """Every file of :data:`FILES` under directory ``t`` (``{t}`` in text and link targets expanded)."""
    import numpy as np

    for name, content in FILES.items():
        path = os.path.join(t, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, Link):
            os.symlink(content.target.replace("{t}", t), path)
        elif isinstance(content, bytes):
            with open(path, "wb") as f:
                f.write(content)
        else:
            with open(path, "w") as f:
                f.write(content.replace("{t}", t))
    x = np.zeros((40, 3), np.float32)
    arrays = {"label1e9.npz": {"x": x, "y": np.r_[np.zeros(39, np.int64), 10**9]},
              "label2e62.npz": {"x": x, "y": np.r_[np.zeros(39, np.int64), 2**62]},
              "nofeatures.npz": {"x": np.zeros((40, 0), np.float32), "y": np.zeros(40, np.int64)},
              "owners1e6.npz": {"x": np.zeros((10**6, 1), np.float32), "y": np.zeros(10**6, np.int64),
                                "client": np.arange(10**6)}}
    for name, a in arrays.items():
        with open(os.path.join(t, name), "wb") as f:
            f.write(_npz(**a))
    from PIL import Image

    for cls in ("a", "b"):
        Image.new("L", (4, 4)).save(os.path.join(t, "loop", cls, "x.png"))


# (id, category, argv | api, code, fragment, ...): ``{t}`` is the directory build() filled
CASES: list[Case] = [
    # ---------------------------------------------------------------- directories handed over
    Case("resume_plugin_absolute", "directories", ["run", "--resume", "{t}/run_abs"],
         fragment="the run used plugin '{t}/evil.py' (algorithm evil), which is not loaded; a run directory's "
                  "plugins are never imported from it", absent=["{t}/MARKER"]),
    Case("resume_plugin_relative", "directories", ["run", "--resume", "{t}/run_rel"],
         fragment="the run used plugin 'evil.py' (algorithm evil), which is not loaded", absent=["{t}/MARKER"]),
    Case("resume_plugin_module", "directories", ["run", "--resume", "{t}/run_module"],
         fragment="the run used plugin 'json.tool' (algorithm evil), which is not loaded"),
    Case("resume_plugin_record_link", "directories", ["run", "--resume", "{t}/run_record_link"],
         fragment="plugins.yaml there is not a regular file", absent=["{t}/MARKER"]),
    Case("resume_plugin_given_again", "directories", ["run", "--resume", "{t}/run_abs", "--plugin", "{t}/good.py"],
         fragment="no checkpoint there to go on from", absent=["{t}/MARKER"]),
    Case("resume_plugin_given_in_env", "directories", ["run", "--resume", "{t}/run_abs"],
         env={"RAYFL_PLUGINS": "{t}/good.py"}, fragment="no checkpoint there to go on from", absent=["{t}/MARKER"]),
    Case("sync_link_to_outside_file", "directories", ["sync", "{t}/ob_link_file"],
         fragment="{t}/ob_link_file/mlflow_outbox/files/000001/secret.txt: a link or a special file",
         absent=["{t}/store_ob_link_file.db"]),
    Case("sync_link_to_outside_dir", "directories", ["sync", "{t}/ob_link_dir"],
         fragment="files/000001/up: a link or a special file", absent=["{t}/store_ob_link_dir.db"]),
    Case("sync_linked_tree", "directories", ["sync", "{t}/ob_link_tree"],
         fragment="files/000002: a link or a file, not a directory of artifact files"),
    Case("sync_linked_metrics", "directories", ["sync", "{t}/ob_link_metrics"],
         fragment="mlflow_outbox/metrics.jsonl: a link or a special file"),
    Case("sync_linked_run_json", "directories", ["sync", "{t}/ob_link_run"],
         fragment="mlflow_outbox/run.json: a link or a special file"),
    Case("sync_linked_files_folder", "directories", ["sync", "{t}/ob_link_files"],
         fragment="mlflow_outbox/files: a link, not the run's own directory"),
    Case("sync_linked_outbox", "directories", ["sync", "{t}/ob_link_box"],
         fragment="no mlflow_outbox/run.json there or below"),
    Case("sync_store_it_would_create", "directories", ["sync", "{t}/ob_new_store"],
         fragment="no such store there; a sync sends to the store the run logged to and makes none",
         absent=["{t}/store_ob_new_store.db"]),
    Case("sync_store_given_would_create", "directories",
         ["sync", "{t}/ob_new_store", "--tracking-uri", "sqlite:///{t}/elsewhere.db"],
         fragment="tracking_uri='sqlite:///{t}/elsewhere.db': no such store there", absent=["{t}/elsewhere.db"]),
    Case("sync_recorded_http_no_host", "directories", ["sync", "{t}/ob_http_empty"],
         fragment="tracking_uri='http://': no host"),
    Case("sync_recorded_proc_path", "directories", ["sync", "{t}/ob_proc"],
         fragment="tracking_uri='/proc/self/mlruns': a file store"),
    Case("sync_recorded_relative_store", "directories", ["sync", "{t}/ob_relative"],
         fragment="not an absolute path", absent=["{t}/store.db"]),
    Case("sync_recorded_database_server", "directories", ["sync", "{t}/ob_postgres"],
         fragment="a sync sends to a recorded store only where it is a server, a SQLite file or a store directory"),
    # ---------------------------------------------------------------- tracebacks: malformed outbox files
    Case("sync_run_json_garbage", "tracebacks", ["sync", "{t}/ob_garbage_run"], fragment="run.json: not JSON"),
    Case("sync_run_json_list", "tracebacks", ["sync", "{t}/ob_list_run"], fragment="run.json: not a run record"),
    Case("sync_metric_without_key", "tracebacks", ["sync", "{t}/ob_metric_no_key"],
         fragment="metrics.jsonl:1: not a record"),
    Case("sync_metric_text_value", "tracebacks", ["sync", "{t}/ob_metric_text"],
         fragment="metrics.jsonl:1: not a record"),
    Case("sync_metric_infinite_step", "tracebacks", ["sync", "{t}/ob_metric_inf_step"],
         fragment="metrics.jsonl:1: not a record"),
    Case("sync_metric_list_line", "tracebacks", ["sync", "{t}/ob_metric_list"],
         fragment="metrics.jsonl:1: not a record"),
    Case("sync_param_dict_value", "tracebacks", ["sync", "{t}/ob_param_dict"],
         fragment="params.jsonl:1: not a record"),
    Case("sync_delivered_garbage", "tracebacks", ["sync", "{t}/ob_delivered_garbage"],
         fragment="delivered.jsonl:1: not a line of JSON"),
    Case("api_sync_none", "tracebacks", api="rayfl.sync(None)", fragment="run_dir=None: must be a run directory"),
    Case("api_sync_int", "tracebacks", api="rayfl.sync(123)", fragment="run_dir=123: must be a run directory"),
    # ---------------------------------------------------------------- hangs
    Case("env_tracking_uri_no_host", "hangs", run(), env={"MLFLOW_TRACKING_URI": "http://"},
         fragment="$MLFLOW_TRACKING_URI: tracking_uri='http://': no host"),
    Case("ft_epochs_1e7", "hangs", run("--algo", "fedavg-ft", "-p", "ft_epochs=10000000"),
         fragment="ft_epochs=10000000 for algorithm 'fedavg-ft': must be at most 10,000"),
    Case("grid_1e9_points", "hangs", ["tune", *TINY, "--space", "{t}/grid_1e9.yaml"],
         fragment="grid: 1,000,000,000 points; a sweep runs at most 10,000 trials"),
    Case("num_samples_1e9", "hangs", ["tune", *TINY, "--space", "{t}/space.yaml", "--search", "random",
                                      "--num-samples", "1000000000"],
         fragment="--num-samples=1000000000: a sweep runs at most 10,000 trials"),
    # ---------------------------------------------------------------- memory
    Case("idx_declaring_640k_images", "memory", ["run", "--dataset", "mnist", "--data-root", "{t}/idx640k",
                                                 "--clients", "2", "--samples-per-client", "45"],
         available=4 * 10**9, fragment="needs 3.6 GB of memory to load"),
    Case("npz_label_1e9", "memory", run("--dataset", "npz:{t}/label1e9.npz"),
         fragment="label 1000000000: labels must be below 100,000"),
    Case("npz_1e6_owners", "memory", ["run", "--dataset", "npz:{t}/owners1e6.npz", "--partition", "natural",
                                      "--clients", "1000000", "--rounds", "1"],
         available=4 * 10**9, fragment="clients=1000000: 1,000,000 clients' records in this process"),
    Case("fedem_M_1e5", "memory", run("--algo", "fedem", "-p", "M=100000"), available=10**8,
         fragment="M=100000: 100,000 components of"),
    Case("sweep_resume_1e9_samples", "memory", ["tune", "--resume", "{t}/sweep_1e9"],
         fragment="num_samples=1000000000: must be an integer in [1, 10,000]"),
    Case("sweep_resume_1e9_trials", "memory", ["tune", "--resume", "{t}/sweep_grid_1e9"],
         fragment="n_trials=1000000000: must be an integer in [1, 10,000]"),
    Case("knob_K_1e18", "memory", run("--algo", "pfedme", "-p", "K=1000000000000000000"),
         fragment="K=1000000000000000000 for algorithm 'pfedme': must be at most 10,000,000"),
    Case("knob_tau_1e18", "memory", run("--algo", "perfedavg", "-p", "tau=1e18"),
         fragment="must be at most 10,000,000"),
    Case("knob_local_steps_1e18", "memory", run("--algo", "federico", "-p", "local_steps=1e18"),
         fragment="must be at most 10,000,000"),
    Case("knob_specialist_epochs_1e18", "memory", run("--algo", "fedmoe", "-p", "specialist_epochs=1e18"),
         fragment="must be at most 10,000 (passes over a client's data)"),
    Case("knob_warmup_epochs_1e18", "memory", run("--algo", "fedavg-data", "-p", "warmup_epochs=1e18"),
         fragment="must be at most 10,000"),
    Case("knob_distill_epochs_1e18", "memory", run("--algo", "persfl", "-p", "distill_epochs=1e18"),
         fragment="must be at most 10,000"),
    Case("local_epochs_1e6", "memory", run("--local-epochs", "1000000"),
         fragment="local_epochs=1000000: must be at most 10,000"),
    # ---------------------------------------------------------------- tracebacks
    Case("yaml_int_5000_digits_run", "tracebacks", ["run", "--config", "{t}/digits_5000.yaml"],
         fragment="an integer of 5,000 digits; at most 30"),
    Case("yaml_int_5000_digits_tune", "tracebacks", ["tune", "--config", "{t}/digits_5000.yaml", "--space",
                                                     "{t}/space.yaml"], fragment="an integer of 5,000 digits"),
    Case("yaml_int_5000_digits_compare", "tracebacks", ["compare", "--local", "--algos", "fedavg", "--config",
                                                        "{t}/digits_5000.yaml"], fragment="an integer of 5,000 digits"),
    Case("param_int_5000_digits", "tracebacks", run("-p", "M=" + "9" * 4000), fragment="an integer of 4,000 digits"),
    Case("compare_file_store", "tracebacks", ["compare", "--local", "--algos", "fedavg", *TINY[:-2],
                                              "--tracking-uri", "mlruns_here"],
         fragment="tracking_uri='mlruns_here': a file store; MLflow 3 refuses its filesystem backend"),
    Case("compare_row_file_store", "tracebacks", ["compare", "--local", "--algos", "fedavg:tracking_uri=http",
                                                  *TINY], fragment="tracking_uri='http': a file store"),
    Case("api_run_params_int", "tracebacks", api="rayfl.run(config={'params': 5}, progress=False)",
         fragment="config['params']=5: must be a dict of algorithm knobs"),
    Case("api_tune_space_list", "tracebacks", api="rayfl.tune(space=['a'], progress=False)",
         fragment="space=['a']: expected a space file path or a dict"),
    Case("api_tune_space_object", "tracebacks",
         api=f"rayfl.tune(space={{'grid': {{'lr': [object()]}}}}, {API_TINY})",
         fragment="space: holds <object object at"),
    Case("api_tune_config_int", "tracebacks", api="rayfl.tune(config=123, progress=False)",
         fragment="config=123: expected a YAML file path, a dict or a rayfl Config"),
    Case("api_compare_seeds_int", "tracebacks", api="rayfl.compare(['fedavg'], seeds=5, runtime='local')",
         fragment="seeds=5: give one or more distinct integer seeds"),
    Case("api_compare_seeds_none", "tracebacks", api="rayfl.compare(['fedavg'], seeds=None, runtime='local')",
         fragment="seeds=None: give one or more distinct integer seeds"),
    Case("api_compare_params_list", "tracebacks", api="rayfl.compare(['fedavg'], params=[1], runtime='local')",
         fragment="params=[1]: must be a dict of algorithm knobs"),
    Case("api_compare_algos_int", "tracebacks", api="rayfl.compare([5], runtime='local')",
         fragment="algos=[5]: must be a list of row names"),
    Case("plugin_base_exception", "tracebacks", ["algos", "--plugin", "{t}/base_exception.py"],
         fragment="base_exception.py': importing it failed: Odd: not an Exception"),
    Case("plugin_getattr_raises", "tracebacks", ["algos", "--plugin", "{t}/getattr_raises.py"],
         fragment="raised RuntimeError: no attributes here"),
    # ---------------------------------------------------------------- raw exceptions
    Case("dp_noise_1e300", "raw exceptions", run("--dp-noise", "1e300"),
         fragment="dp_noise='1e300': must be 0 or of magnitude in [1e-12, 1e+12]"),
    Case("dp_noise_1e-300", "raw exceptions", run("--dp-noise", "1e-300"),
         fragment="dp_noise='1e-300': must be 0 or of magnitude in [1e-12, 1e+12]"),
    Case("fedprox_mu_1e300", "raw exceptions", run("--algo", "fedprox", "-p", "mu=1e300"),
         fragment="mu='1e300' for algorithm 'fedprox': must be 0 or of magnitude"),
    Case("pfedme_lam_1e300", "raw exceptions", run("--algo", "pfedme", "-p", "lam=1e300"),
         fragment="lam='1e300' for algorithm 'pfedme': must be 0 or of magnitude"),
    Case("perfedavg_inner_lr_1e300", "raw exceptions", run("--algo", "perfedavg", "-p", "inner_lr=1e300"),
         fragment="inner_lr='1e300' for algorithm 'perfedavg': must be 0 or of magnitude"),
    Case("no_test_split", "raw exceptions", run("--val-frac", "0", "--test-frac", "0"),
         fragment="test_frac=0.0: must be in (0, 1)"),
    Case("stage_cache_under_proc", "raw exceptions", run("--stage-cache", "/proc/rayfl-cache"),
         fragment="stage_cache='/proc/rayfl-cache': cannot write there"),
    Case("npz_no_features", "raw exceptions", run("--dataset", "npz:{t}/nofeatures.npz"),
         fragment="x has shape (40, 0): a sample holds no features"),
    Case("npz_label_2e62", "raw exceptions", run("--dataset", "npz:{t}/label2e62.npz"),
         fragment="label 4611686018427387904: labels must be below 100,000"),
    Case("png_60000x60000", "raw exceptions", run("--dataset", "folder:{t}/bomb"),
         fragment="big.png: not a readable image"),
    Case("plugin_check_raises", "raw exceptions", run("--plugin", "{t}/check_raises.py", "--algo", "checky"),
         fragment="algo='checky': its Params check raised RuntimeError: check blew up"),
    Case("plugin_exit_3", "raw exceptions", ["algos", "--plugin", "{t}/exit3.py"],
         fragment="exit3.py': importing it called sys.exit(3)"),
    Case("plugin_keyboard_interrupt", "raw exceptions", ["algos", "--plugin", "{t}/interrupt.py"],
         fragment="interrupt.py': importing it failed: KeyboardInterrupt"),
    Case("loader_exit_7", "raw exceptions", run("--plugin", "{t}/loader_exits.py", "--dataset", "exiter"),
         fragment="dataset='exiter': its loader raised SystemExit: 7"),
    Case("loader_interrupt", "raw exceptions", run("--plugin", "{t}/loader_interrupts.py", "--dataset",
                                                   "interrupter"),
         fragment="dataset='interrupter': its loader raised KeyboardInterrupt"),
    # ---------------------------------------------------------------- silent accepts
    Case("config_empty_path", "silent accepts", ["run", "--config", ""],
         fragment="config file '': empty path"),
    Case("resume_empty_path", "silent accepts", ["run", "--resume", ""], fragment="--resume '': empty path"),
    Case("yaml_octal_clients", "silent accepts", ["run", "--config", "{t}/octal.yaml"],
         fragment="'010' is a YAML 1.1 octal number (8); write the number you mean"),
    Case("yaml_sexagesimal_rounds", "silent accepts", ["run", "--config", "{t}/sexagesimal.yaml"],
         fragment="'1:0' is a YAML 1.1 sexagesimal (base 60) number (60)"),
    Case("param_octal", "silent accepts", run("--algo", "fedfomo", "-p", "M=010"),
         fragment="'010' is a YAML 1.1 octal number"),
    Case("run_name_escape_codes", "silent accepts", run("--run-name", "a\x1b[2Jb\r\nc"),
         fragment="must be a non-empty name without '/' or control characters"),
    Case("experiment_escape_codes", "silent accepts", run("--experiment", "e\x1b[31m"),
         fragment="must be a non-empty name without control characters"),
    Case("imagefolder_link_loop", "silent accepts", run("--dataset", "folder:{t}/loop"),
         fragment="is a link to a folder read already, or to the dataset's folder or above it"),
    Case("tune_empty_space", "silent accepts", ["tune", *TINY, "--space", "{t}/space_empty.yaml"],
         fragment="space_empty.yaml: sweeps nothing"),
    Case("tune_empty_name", "silent accepts", ["tune", *TINY, "--space", "{t}/space.yaml", "--name", ""],
         fragment="--name='': must be a directory name"),
    Case("tune_grid_1_and_1.0", "silent accepts", ["tune", *TINY, "--space", "{t}/space_one_and_one.yaml"],
         fragment="grid.clients: repeated values in [2, 2.0] (1 and 1.0 are one value)"),
    Case("compare_local_with_address", "silent accepts", ["compare", "--local", "--address", "127.0.0.1:1",
                                                          "--algos", "fedavg", *TINY],
         fragment="address='127.0.0.1:1': a local comparison (--local) runs in this process"),
    Case("compare_rows_same_run", "silent accepts", ["compare", "--local", "--algos", "fedfomo:M=2,fedfomo:M=2.0",
                                                     *TINY], fragment="are the same run; give each once"),
    Case("compare_row_key_twice", "silent accepts", ["compare", "--local", "--algos", "fedfomo:M=2:M=3", *TINY],
         fragment="M is given twice in one row"),
    Case("param_given_twice", "silent accepts", run("--algo", "fedfomo", "-p", "M=2", "-p", "M=3"),
         fragment="M is given twice; give each knob once"),
    Case("fedfomo_one_client", "silent accepts", ["run", "--algo", "fedfomo", *TINY[:4], "--clients", "1"],
         fragment="clients=1: FedFomo weighs other clients' models; it needs at least 2"),
    Case("plugin_exit_0", "silent accepts", ["algos", "--plugin", "{t}/exit0.py"],
         fragment="exit0.py': importing it called sys.exit(0)"),
    Case("plugin_os_exit_0", "silent accepts", ["algos", "--plugin", "{t}/os_exit0.py"],
         fragment="os_exit0.py': importing it called os._exit(0)"),
    Case("persfl_T_1e300", "silent accepts", run("--algo", "persfl", "-p", "T=1e300"),
         fragment="T='1e300' for algorithm 'persfl': must be 0 or of magnitude"),
    Case("participation_1e-300", "silent accepts", run("--participation", "1e-300"),
         fragment="participation='1e-300': must be 0 or of magnitude"),
    Case("participation_no_client", "silent accepts", run("--participation", "0.1"),
         fragment="participation=0.1: samples 0.1 x 2 clients, none, a round"),
    # ---------------------------------------------------------------- credentials
    Case("credentials_masked", "credentials", run("--tracking-uri", "http://alice:s3cret@127.0.0.1:1"),
         fragment="tracking_uri='http://alice:***@127.0.0.1:1'"),
    Case("credentials_masked_env", "credentials", run(), env={"MLFLOW_TRACKING_URI": "foo://alice:s3cret@h"},
         fragment="'foo://alice:***@h': unknown scheme"),
]


def expand(value, t: str):
    return value.replace("{t}", t) if isinstance(value, str) else [v.replace("{t}", t) for v in value]


# --------------------------------------------------------------------------------------------------
# The generator: every case in a fresh process, as a user runs it
# --------------------------------------------------------------------------------------------------
def _child(case: Case, t: str) -> list[str]:
    """The command that runs ``case`` in a fresh process (the memory budget's view set where it has one)."""
    setup = f"import os, sys\nos.chdir({t!r})\n"
    if case.available is not None:
        setup += ("import psutil\n_vm = psutil.virtual_memory\n"
                  f"psutil.virtual_memory = lambda: _vm()._replace(available={case.available})\n")
    if case.api is not None:
        body = (f"import rayfl\ntry:\n    {case.api}\nexcept rayfl.UserError as e:\n"
                f"    print(f'rayfl: error: {{e}}', file=sys.stderr)\n    sys.exit(2)\n")
    else:
        body = f"from rayfl.cli import main\nsys.exit(main({expand(case.argv, t)!r}))\n"
    return [sys.executable, "-c", setup + body]


def run_case(case: Case, t: str) -> dict:
    """Run one case in a fresh process; how it ended: exit status, stderr, seconds, peak memory (MB)."""
    import subprocess
    import time

    import psutil

    env = {**os.environ, **{k: expand(v, t) for k, v in case.env.items()}, "RAY_ADDRESS": ""}
    t0 = time.monotonic()
    proc = subprocess.Popen(_child(case, t), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=t)
    peak, timed_out = 0, False
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if time.monotonic() - t0 > case.timeout:
            proc.kill()
            timed_out = True
            break
        time.sleep(0.05)
    out, err = proc.communicate()
    return {"code": None if timed_out else proc.returncode, "err": err.decode(errors="replace"),
            "out": out.decode(errors="replace"), "seconds": time.monotonic() - t0, "peak_mb": peak / 1e6}


def verdict(case: Case, t: str, got: dict) -> str:
    """How a case ended: ok, or what went wrong (a hang, a traceback, another code, a silent accept, ...)."""
    err = got["err"]
    if got["code"] is None:
        return "HANG"
    if "Traceback" in err:
        return "TRACEBACK"
    if got["code"] == 0:
        return "SILENT ACCEPT"
    lines = [line for line in err.splitlines() if line.startswith("rayfl: error: ") or line.startswith("rayfl: ")]
    if got["code"] != case.code or not lines:
        return f"EXIT {got['code']}"
    if expand(case.fragment, t) not in err:
        return "OTHER MESSAGE"
    if any(os.path.exists(expand(p, t)) for p in case.absent):
        return "LEFT A FILE"
    return "ok"


def main(selected: list[str]) -> int:
    import tempfile

    bad = 0
    with tempfile.TemporaryDirectory(prefix="rayfl-battery-") as t:
        build(t)  # once: no case writes where another reads (each is refused before it writes anything)
        for case in CASES:
            if selected and not any(s in case.id for s in selected):
                continue
            got = run_case(case, t)
            v = verdict(case, t, got)
            bad += v != "ok"
            last = (got["err"].strip().splitlines() or [""])[-1][:160]
            print(f"{v:14s} {case.category:15s} {case.id:34s} exit {got['code']} {got['seconds']:5.1f} s "
                  f"{got['peak_mb']:6.0f} MB  {last}", flush=True)
    print(f"{bad} case(s) not as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
