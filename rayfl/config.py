"""One experiment's configuration: defaults, YAML/flag merging, and the checks that run before any actor.

Every value here is logged as an MLflow param, and every name is one a Tune space may set. Algorithm
knobs live in ``params`` and are checked by the algorithm's own ``Params`` dataclass.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from rayfl.algorithms import DEFAULT_ALGORITHM
from rayfl.user_input import (KIND_TEXT, MAX_COUNT, MAX_EPOCHS, MAX_MESSAGE, UserError, check_count,  # noqa: F401
                              did_you_mean, to_kind)

MAX_TEXT = 4096  # characters of a string value (a path, a name, a URI: PATH_MAX on Linux is 4096 bytes)
MAX_DEPTH = 32  # nesting of a config value or a YAML file (a config is 2 levels deep, a space file 4)
MAX_VALUES = 10_000  # values in one config, space file or config value, aliases expanded
MAX_FILE_BYTES = 1 << 20  # a config or space file (the largest shipped is about 2 KB)
MAX_TORCH_THREADS = 256  # per client actor; a private local instance also caps them at this machine's CPUs


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as an error message quotes it: its repr, cut to about ``limit`` characters (a long string
    says how long it was; a deep or large container is elided by reprlib, which never expands shared
    references beyond its own bounds)."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value)} characters)"
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, limit, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 8
    try:
        text = r.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 2 * limit else text[:2 * limit] + "..."


SIZE_DISTRIBUTIONS = ("equal", "lognormal")
BUFFERS = ("global", "local")  # where a model's buffers live: in the averaged weight vector, or with each client
GROUP_ASSIGN = ("auto", "blocks", "random")
OPTIMIZERS = ("sgd", "adam")
MAX_SEED = 2**32 - 1  # numpy's legacy RandomState (Tune's grid/random search) takes seeds below 2**32


@dataclass
class Config:
    # what runs
    algo: str = DEFAULT_ALGORITHM
    params: dict = field(default_factory=dict)  # the algorithm's own knobs (ε, M, β, λ, T, ...)
    # data
    dataset: str = "digits"
    data_root: str | None = None
    download: bool = False
    partition: str = "pathological"
    classes_per_client: int = 2  # pathological
    alpha: float = 0.5  # dirichlet
    groups: int = 4  # latent / label-groups / rotation / permutation
    group_assign: str = "auto"  # clients to groups: blocks | random | auto (each paper's way, see partition.py)
    label_shift: float = 0.0  # rotation / permutation: Dirichlet(α) label shift on top (user-centric S2); 0: none
    majority: float = 0.8  # majority-class fraction p (FedMoE)
    sizes: str = "equal"  # client dataset sizes: equal | lognormal (PersFL DS-3)
    size_sigma: float = 2.0  # lognormal sigma for sizes
    samples_per_client: int = 0  # 0: the whole dataset is divided among the clients
    val_frac: float = 0.2  # fraction of each client's data held out for validation
    test_frac: float = 0.2  # fraction of each client's data held out for test
    ood: bool = False  # FedFomo's out-of-distribution setting: (val, test) pairs swapped among clients
    # federation
    clients: int = 10
    rounds: int = 20
    participation: float = 1.0  # fraction of clients sampled each round
    # local training
    model: str = "auto"
    local_epochs: int = 1
    lr: float = 0.05
    batch_size: int = 32
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    # differential privacy (rayfl.privacy); dp_noise 0: off
    dp_noise: float = 0.0  # σ of DP-SGD (sample level) or z of DP-FedAvg (user level)
    dp_clip: float = 1.0  # C: per-sample gradient norm bound (sample level) or S: per-user update norm (user level)
    dp_delta: float = 1e-5  # δ at which ε is reported
    dp_level: str = "sample"  # sample: DP-SGD in every client's training | user: DP-FedAvg's clipped, noised sum
    dp_accountant: str = "rdp"  # rdp (Mironov 2017) | prv (Gopi et al. 2021), Opacus's accountants
    # evaluation, logging, keeping
    eval_every: int = 1
    client_metrics: int = 0  # per-client values also as MLflow metrics up to this many clients (0: never;
    # MLflow 3 shows every prefixed section before the summary, so they are off by default)
    checkpoint_every: int = 0  # 0: no checkpoints
    snapshot_every: int = 1  # in-memory snapshot of every client every N rounds, to replay from after a fault
    max_restarts: int = 3  # client-actor and driver restarts survived per run before it fails
    capacity_wait: float = 600.0  # seconds to wait for room for client actors lost with a node (autoscaler)
    out_dir: str = "rayfl-runs"
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    tracking_wait: float = 300.0  # seconds a run's end waits for a tracking server that does not answer
    system_metrics_interval: float = 10.0  # seconds between samples of CPU, memory, GPU (MLflow's system metrics); 0: off
    experiment: str = "rayfl"
    run_name: str | None = None
    stage_cache: str = ""  # directory shared by runs to reuse stages (rayfl.stage_cache); "": off
    # resources
    clients_per_actor: int | str = "auto"  # auto: one actor per client while the cluster has a slot for each
    cpus_per_actor: float = 0.0  # 0: share the cluster's CPUs among the actors
    gpus_per_actor: float = -1.0  # -1: automatic (a fraction of the GPUs when the cluster has any)
    torch_threads: int = 1
    # buffers (BatchNorm's running statistics): global, in the weight vector and averaged like the weights;
    # local, each client's own, never averaged (FedBN, Li et al. 2021), where the algorithm declares local_buffers
    buffers: str = "global"

    def check(self) -> Any:
        """Raise UserError naming the first bad value and what is allowed; returns the algorithm's knobs, parsed
        and checked (its Params), which a run carries from here on."""
        from rayfl.algorithms import algorithm_names, get_algorithm
        from rayfl.data.datasets import check_dataset_name
        from rayfl.data.partition import PARTITIONS
        from rayfl.models import check_model_name

        for name in FIELDS:  # a Config built in code skips make_config: its values are checked here
            value = getattr(self, name)
            check_value(name, value)  # before anything walks or quotes it (asdict, repr)
            _convert(name, value)
        _one_of("algo", self.algo, algorithm_names())
        check_dataset_name(self.dataset)
        _one_of("partition", self.partition, PARTITIONS)
        _one_of("sizes", self.sizes, SIZE_DISTRIBUTIONS)
        _one_of("group_assign", self.group_assign, GROUP_ASSIGN)
        if not self.label_shift >= 0 or self.label_shift == float("inf"):
            raise UserError(f"label_shift={self.label_shift}: must be a finite number >= 0 (0: no label shift)")
        if self.label_shift > 0 and self.partition not in ("rotation", "permutation"):
            raise UserError(f"label_shift={self.label_shift}: applies to partition rotation or permutation, "
                            f"not {self.partition!r}")
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        check_model_name(self.model)
        _one_of("buffers", self.buffers, BUFFERS)
        if self.buffers == "local" and not get_algorithm(self.algo).capability("local_buffers"):
            raise UserError(f"buffers='local': algo={self.algo!r} does not declare that its clients keep their own "
                            f"buffers (ClientLogic.local_buffers); allowed: global")
        if self.clients_per_actor != "auto" and not (isinstance(self.clients_per_actor, int)
                                                     and self.clients_per_actor >= 1):
            raise UserError(f"clients_per_actor={self.clients_per_actor!r}: must be auto or an integer >= 1")
        for name in ("clients", "rounds", "local_epochs", "batch_size", "eval_every",
                     "torch_threads", "groups", "classes_per_client"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)}: must be an integer >= 1")
        for name in ("checkpoint_every", "samples_per_client", "client_metrics", "snapshot_every", "max_restarts"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)}: must be an integer >= 0")
        for name in COUNTS:
            try:
                check_count(getattr(self, name), name)
            except ValueError as e:
                raise UserError(f"{name}={getattr(self, name)}: {e}") from None
        if self.torch_threads > MAX_TORCH_THREADS:
            raise UserError(f"torch_threads={self.torch_threads}: must be at most {MAX_TORCH_THREADS} (threads of "
                            f"one client actor)")
        for name in ("participation", "majority"):
            _fraction(name, getattr(self, name), low_open=True)
        poisson = self.dp_noise > 0 and self.dp_level == "user"  # users sampled one by one: any rate is a rate
        if not poisson and self.participation * self.clients < 0.5:
            raise UserError(f"participation={self.participation:g}: samples {self.participation:g} x {self.clients} "
                            f"clients, none, a round; must be at least {0.5 / self.clients:g} (half a client)")
        _fraction("val_frac", self.val_frac, low_open=False, high_open=True)
        _fraction("test_frac", self.test_frac, low_open=True, high_open=True)  # every run reports test metrics
        if self.val_frac + self.test_frac >= 1:
            raise UserError(f"val_frac + test_frac = {self.val_frac + self.test_frac:g}: must be below 1")
        for name in ("lr", "alpha", "size_sigma"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name}={getattr(self, name)}: must be > 0")
        if not 0 <= self.capacity_wait < float("inf"):
            raise UserError(f"capacity_wait={self.capacity_wait}: must be a finite number of seconds >= 0")
        if not 0 <= self.tracking_wait < float("inf"):
            raise UserError(f"tracking_wait={self.tracking_wait}: must be a finite number of seconds >= 0")
        if not 0 <= self.system_metrics_interval < float("inf"):
            raise UserError(f"system_metrics_interval={self.system_metrics_interval}: must be a finite number of "
                            f"seconds >= 0 (0: no system metrics)")
        for name in ("momentum", "weight_decay", "cpus_per_actor"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name}={getattr(self, name)}: must be >= 0")
        if not self.momentum < 1:  # heavy-ball momentum beta: the step grows without bound at beta >= 1
            raise UserError(f"momentum={self.momentum}: must be in [0, 1)")
        check_model_fits(self.model, self.dataset)
        if self.gpus_per_actor < 0 and self.gpus_per_actor != -1:
            raise UserError(f"gpus_per_actor={self.gpus_per_actor}: must be >= 0, or -1 for automatic")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"seed={self.seed}: must be an integer in [0, {MAX_SEED}]")
        if self.stage_cache and os.path.exists(self.stage_cache) and not os.path.isdir(self.stage_cache):
            raise UserError(f"stage_cache={self.stage_cache!r}: exists and is not a directory")
        if self.data_root is not None and not os.path.isdir(os.path.expanduser(self.data_root)):
            raise UserError(f"data_root={self.data_root!r}: no such directory")
        if not self.experiment.strip() or not self.experiment.isprintable():
            raise UserError(f"experiment={shown(self.experiment)}: must be a non-empty name without control "
                            f"characters")
        if self.run_name is not None and (not self.run_name.strip() or "/" in self.run_name
                                          or self.run_name in (".", "..") or not self.run_name.isprintable()):
            raise UserError(f"run_name={shown(self.run_name)}: must be a non-empty name without '/' or control "
                            f"characters")
        if not self.out_dir.strip():
            raise UserError(f"out_dir={self.out_dir!r}: must be a directory path")
        if os.path.exists(os.path.expanduser(self.out_dir)) and not os.path.isdir(os.path.expanduser(self.out_dir)):
            raise UserError(f"out_dir={self.out_dir!r}: exists and is not a directory")
        if self.tracking_uri is not None:
            check_tracking_uri(self.tracking_uri)
        from rayfl.privacy import check_config as check_privacy

        try:
            check_privacy(self, get_algorithm(self.algo))
        except ValueError as e:
            raise UserError(str(e)) from None
        try:
            params = get_algorithm(self.algo).make_params(self.params)
            params.check(self.clients)
            if hasattr(params, "check_config"):  # checks that need the rest of the config
                params.check_config(self)
        except ValueError as e:
            raise UserError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a plugin's check may raise anything: one line naming it
            raise UserError(f"algo={self.algo!r}: its Params check raised {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
        return params

    def to_flat(self, params: Any = None) -> dict[str, Any]:
        """All resolved values as flat MLflow params (algorithm knobs as ``param.<name>``); ``params``: the
        algorithm's knobs as :meth:`check` parsed them, where the caller has them."""
        from rayfl.algorithms import get_algorithm

        flat = {k: v for k, v in dataclasses.asdict(self).items() if k != "params"}
        resolved = dataclasses.asdict(params if params is not None else get_algorithm(self.algo).make_params(self.params))
        flat.update({f"param.{k}": v for k, v in resolved.items()})
        return flat


# The integer settings bounded by MAX_COUNT (a count beyond it is a typo, e.g. 1e18, not a request).
COUNTS = ("clients", "rounds", "local_epochs", "batch_size", "eval_every", "groups", "classes_per_client",
          "checkpoint_every", "samples_per_client", "client_metrics", "snapshot_every", "max_restarts")

# What the built-in datasets are, for pairing them with the built-in models before any data is loaded.
IMAGE_DATASETS = frozenset({"digits", "mnist", "fashion-mnist", "cifar10", "cifar100"})  # (C, H, W) inputs
REGRESSION_DATASETS = frozenset({"sine"})  # one real-valued output; the others are classification
CONV_MODELS = frozenset({"mcmahan-cnn", "tf-cnn", "lenet5"})  # need (C, H, W) inputs
REGRESSION_MODELS = frozenset({"sine-mlp"})  # FedeRiCo's linear fit of the sine curve (Ma et al. 2022, 5.2)
CLASSIFICATION_MODELS = frozenset({"logreg"})  # a softmax classifier by name


def check_model_fits(model: str, dataset: str) -> None:
    """A built-in model meant for another kind of data than a built-in dataset (a CNN on vectors, the sine
    curve's linear fit on digits) is refused before any data is loaded. Models registered elsewhere, and the
    output width of every model, are checked when the model is built."""
    builtin = IMAGE_DATASETS | REGRESSION_DATASETS | {"synthetic"}
    if model == "auto" or dataset not in builtin:
        return
    task = "regression" if dataset in REGRESSION_DATASETS else "classification"
    if model in CONV_MODELS and dataset not in IMAGE_DATASETS:
        fits = sorted(IMAGE_DATASETS)
    elif model in REGRESSION_MODELS and task != "regression":
        fits = sorted(REGRESSION_DATASETS)
    elif model in CLASSIFICATION_MODELS and task != "classification":
        fits = sorted(builtin - REGRESSION_DATASETS)
    else:
        return
    raise UserError(f"model={model!r}: does not fit dataset {dataset!r}; it is meant for {', '.join(fits)} "
                    f"(model auto picks one that fits)")


def check_value(name: str, value: Any) -> None:
    """A config value (or a whole config, a space) small enough to walk and quote: at most MAX_DEPTH levels
    and MAX_VALUES values (a shared or aliased part counted each time it appears), strings of at most
    MAX_TEXT characters without NUL bytes (no path, name or URI holds one). Walked without recursion, so a
    value nested past Python's recursion limit, or one that contains itself, is refused, not crashed on."""
    stack = [(value, 0)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{name}: more than {MAX_VALUES:,} values (anchors and aliases counted each time "
                            f"they are used)")
        if depth > MAX_DEPTH:
            raise UserError(f"{name}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, str):
            if len(item) > MAX_TEXT:
                raise UserError(f"{name}={shown(item)}: at most {MAX_TEXT} characters")
            if "\0" in item:
                raise UserError(f"{name}={shown(item)}: must not contain a NUL byte")
        elif isinstance(item, dict):
            stack.extend((x, depth + 1) for pair in item.items() for x in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((x, depth + 1) for x in item)


def _one_of(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise UserError(f"{name}={shown(value)}: unknown; allowed: {', '.join(map(str, allowed))}")


def _fraction(name: str, value: float, low_open: bool, high_open: bool = False) -> None:
    low_ok = value > 0 if low_open else value >= 0
    high_ok = value < 1 if high_open else value <= 1
    if not (low_ok and high_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise UserError(f"{name}={value}: must be in {interval}")


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Config fields that do not change what a run computes (where it runs, how it is kept and tracked; the data's
# location, where the data itself is compared by content): a checkpoint resumes, and a stored stage is shared,
# across other values of these.
NOT_RESULTS = frozenset({"out_dir", "tracking_uri", "experiment", "run_name", "client_metrics", "checkpoint_every",
                         "snapshot_every", "max_restarts", "capacity_wait", "tracking_wait", "system_metrics_interval",
                         "stage_cache", "clients_per_actor", "cpus_per_actor",
                         "gpus_per_actor", "torch_threads", "data_root", "download"})


def check_keys(values: Mapping[str, Any], where: str = "") -> None:
    """Every key a config key: a mistyped one is refused, with the nearest key named (``where``: " in FILE")."""
    unknown = sorted(str(k) for k in set(values) - set(FIELDS))
    if unknown:
        raise UserError(f"unknown config key {shown(unknown[0])}{did_you_mean(unknown[0], FIELDS)}{where}; allowed: "
                        f"{', '.join(FIELDS)}")


def make_config(file: str | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Defaults, then a YAML file, then explicit overrides (flags); unknown keys are user errors."""
    values: dict[str, Any] = {}
    where = f" in {file}" if file else ""
    if file is not None:
        values.update(read_yaml(file))
    for k, v in [*values.items(), *(overrides or {}).items()]:  # bounded before anything walks or quotes them
        check_value(str(k) if isinstance(k, str) and len(k) <= 80 else f"config key {shown(k)}", k)
        check_value(str(k)[:80], v)
    if values.get("params", {}) is not None and not _is_params(values.get("params", {})):
        raise UserError(f"params={shown(values['params'])}{where}: must be a mapping of algorithm knobs (name: value)")
    for k, v in (overrides or {}).items():
        if k == "params":
            if not _is_params(v):
                raise UserError(f"params={shown(v)}: must be a mapping of algorithm knobs (name: value)")
            values["params"] = {**(values.get("params") or {}), **v}
        else:
            values[k] = v
    check_keys(values, where)
    if values.get("params", {}) is None:
        raise UserError(f"params=None{where}: must be a mapping of algorithm knobs (name: value)")
    cfg = Config(**{k: _convert(k, v) for k, v in values.items()})
    return cfg


def _is_params(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def read_yaml(path: str) -> dict:
    """A config file: a YAML mapping of config keys (an empty file is no keys)."""
    data = load_yaml(path, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path!r}: must hold a mapping of config keys, not a {type(data).__name__}")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class _TooLarge(Exception):
    def __init__(self, problem: str, line: int):
        super().__init__(problem)
        self.problem, self.line = problem, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives a key twice (PyYAML keeps the last one silently), a
    document nested more than MAX_DEPTH levels deep (PyYAML composes it recursively: a RecursionError), and
    one whose anchors and aliases expand to more than MAX_VALUES values (a few hundred bytes of nested aliases,
    "billion laughs", would otherwise be quoted as gigabytes in an error line)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _TooLarge(f"nested more than {MAX_DEPTH} levels deep", mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def size(n) -> int:  # values the node stands for, each alias counted as what it expands to
            if id(n) in sizes:
                if sizes[id(n)] < 0:
                    raise _TooLarge("an alias refers to a node that contains it", n.start_mark.line + 1)
                return sizes[id(n)]
            sizes[id(n)] = -1
            children = ([x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode)
                        else n.value if isinstance(n, yaml.SequenceNode) else [])
            total = 1
            for child in children:
                total += size(child)
                if total > MAX_VALUES:
                    raise _TooLarge(f"more than {MAX_VALUES:,} values (anchors and aliases counted each time "
                                    f"they are used)", child.start_mark.line + 1)
            sizes[id(n)] = total
            return total

        if node is not None:
            size(node)
        return node

    def construct_yaml_int(self, node):
        text = str(node.value).replace("_", "").lstrip("+-")
        if ":" in text or (len(text) > 1 and text.startswith("0") and text.isdigit()):
            kind = "sexagesimal (base 60)" if ":" in text else "octal"
            raise _TooLarge(f"{node.value!r} is a YAML 1.1 {kind} number ({super().construct_yaml_int(node)}); "
                            f"write the number you mean, or quote it as text", node.start_mark.line + 1)
        if len(text) > MAX_DIGITS:
            raise _TooLarge(f"an integer of {len(text):,} digits; at most {MAX_DIGITS}", node.start_mark.line + 1)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        if ":" in str(node.value):
            raise _TooLarge(f"{node.value!r} is a YAML 1.1 sexagesimal (base 60) number; write the number you "
                            f"mean, or quote it as text", node.start_mark.line + 1)
        return super().construct_yaml_float(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)):
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)
MAX_DIGITS = 30  # of an integer in a YAML file or value (a seed has 10; Python refuses to read past 4,300)


def load_yaml(path: str, what: str) -> Any:
    """A YAML file's content, or one line naming the file (``what``: "config file", "space file"). The safe
    loader builds no objects from tags, so loading a file never runs code."""
    if not str(path).strip():
        raise UserError(f"{what} {path!r}: empty path; give a file, or leave the flag out")
    if not os.path.isfile(path):
        raise UserError(f"{what} {path!r}: no such file")
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise UserError(f"{what} {path!r}: {os.path.getsize(path):,} bytes; at most {MAX_FILE_BYTES:,}")
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader: it builds no objects from tags
    except _DuplicateKey as e:
        raise UserError(f"{what} {path!r}: key {shown(e.key)} given twice (line {e.line}); give each key once") from None
    except _TooLarge as e:
        raise UserError(f"{what} {path!r}: {e.problem} (line {e.line})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise UserError(f"{what} {path!r}: not valid YAML{at} ({problem})") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path!r}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{what} {path!r}: cannot be read ({e.strerror or e})") from None


# The schemes MLflow has a tracking store for (its registry in mlflow.tracking._tracking_service.utils), known
# here without importing MLflow (1.3 s of start-up); a test checks them against MLflow's own registry.
TRACKING_SCHEMES = frozenset({"", "file", "http", "https", "databricks", "databricks-uc", "uc"})
DATABASE_SCHEMES = frozenset({"sqlite", "postgresql", "mysql", "mssql"})  # each also as "<db>+<driver>"


def tracking_scheme(uri: str) -> str | None:
    """The store kind MLflow picks for ``uri`` (as its registry reads a URI); None where it has none."""
    import urllib.parse

    if uri in ("databricks", "databricks-uc", "uc"):
        return uri
    scheme = urllib.parse.urlparse(uri).scheme
    if any(scheme.lower().startswith(db) for db in DATABASE_SCHEMES):
        db, _, driver = scheme.partition("+")
        return db if db in DATABASE_SCHEMES and "+" not in driver else None
    if scheme in TRACKING_SCHEMES:
        return scheme
    from importlib.metadata import entry_points  # a plugin's store

    return scheme if scheme in {e.name for e in entry_points(group="mlflow.tracking_store")} else None


def check_tracking_uri(uri: str) -> None:
    """An MLflow tracking URI whose scheme MLflow has a store for (a path, file:, sqlite:, http(s):, ...); an
    empty one is refused (it would silently mean $MLFLOW_TRACKING_URI), as is a server URI without a host."""
    if not uri.strip():
        raise UserError(f"tracking_uri={shown(uri)}: empty; give a URI, or leave it out for $MLFLOW_TRACKING_URI, "
                        "else sqlite:///mlflow.db")
    if uri.lower().startswith(("http://", "https://")):
        import urllib.parse

        url = urllib.parse.urlparse(uri)
        try:
            url.port
        except ValueError:
            raise UserError(f"tracking_uri={shown(uri)}: the port must be a number in 0-65535") from None
        if not url.hostname:
            raise UserError(f"tracking_uri={shown(uri)}: no host; expected {url.scheme}://HOST[:PORT]")
    scheme = tracking_scheme(uri)
    if scheme in ("", "file") and uri not in ("databricks", "databricks-uc", "uc") and not file_store_allowed():
        raise UserError(f"tracking_uri={shown(uri)}: a file store; MLflow 3 refuses its filesystem backend unless "
                        f"MLFLOW_ALLOW_FILE_STORE=true is set: use sqlite:///PATH (a file) instead")
    if scheme is None:
        schemes = ", ".join(sorted(s or "a path" for s in TRACKING_SCHEMES | DATABASE_SCHEMES))
        raise UserError(f"tracking_uri={shown(uri)}: unknown scheme; allowed: {schemes}")


def file_store_allowed() -> bool:
    """Whether MLflow 3 opens a file store (a path, ``file:``): only with ``MLFLOW_ALLOW_FILE_STORE`` true."""
    return os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("1", "true", "yes", "on")


def _convert(name: str, value: Any) -> Any:
    """Give a YAML/flag value the type of the field's default (ints stay ints, '0.1' becomes 0.1)."""
    default = Config.__dataclass_fields__[name].default
    if name == "clients_per_actor":
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if isinstance(value, bool) or not text.isdigit():
            raise UserError(f"clients_per_actor={shown(value)}: must be auto or an integer >= 1")
        return int(text)
    if name == "params":
        return value
    if default is None:  # optional paths and names: a string, or not given
        if value is None or isinstance(value, str):
            return value
        raise UserError(f"{name}={shown(value)}: must be a string")
    if value is None:
        raise UserError(f"{name}=null: must be {KIND_TEXT[type(default)]} (leave the key out for the default)")
    try:
        return to_kind(value, type(default))
    except ValueError as e:
        raise UserError(f"{name}={shown(value)}: {e}") from None


def yaml_value(text: str, name: str) -> Any:
    """A value typed as text (``-p KEY=VALUE``) read as YAML (0.3 a float, [1, 2] a list), with the file
    loader's bounds; text that is not YAML stays text."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader: it builds no objects from tags
    except _TooLarge as e:
        raise UserError(f"{name}={shown(text)}: {e.problem}") from None
    except (yaml.YAMLError, _DuplicateKey):
        return text
