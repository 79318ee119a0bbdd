"""Whole datasets as normalized numpy arrays, loaded once on the driver and shared with the actors.

Train and test files are concatenated: the partitioning (partition.py) makes each client's own test split and
the global holdout, so the original split has no role (as in PersFL's pooled setup).

Besides the built-in datasets, a user's own: registered by name (:func:`register_dataset`: arrays from a
callable, a torch ``Dataset``, an ``ImageFolder`` directory or a ``.npz`` file), or named by path on the command
line (``folder:PATH``, ``npz:PATH``). Every source is checked before any actor starts (lengths, finite
features, integer labels, memory), and a per-sample ``client`` column, where a source has one, is kept for
the ``natural`` partition (LEAF's writers, a hospital's patients).
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfl.user_input import UserError


BUILTIN = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic", "sine")
DATASETS = BUILTIN  # the built-in names; dataset_names() adds the registered ones
PATH_KINDS = ("folder", "npz")  # `--dataset folder:PATH`, `--dataset npz:PATH`
MEMORY_SHARE = 0.5  # a dataset may take at most this share of the memory available when it is loaded
ABSURD_BYTES = 2**40  # a declared size beyond this is a corrupt header, whatever the machine
MAX_CLASSES = 100_000  # a model's outputs: one label of 10**9 would otherwise make a 10**9-wide last layer
# What reading an IDX file costs a value at its peak: the file's bytes as read (a .gz is read in chunks that are
# joined: 2), the pairs' bytes joined into one array (1), and its float32 copy, scaled in place (4); and, once,
# the standardization's chunk of CHUNK_ROWS samples in float64 with its square (16 bytes a value of the chunk).
IDX_BYTES_PER_VALUE = 7
CHUNK_ROWS = 8192


def idx_budget(dims: list[int]) -> int:
    """The bytes reading an IDX file of shape ``dims`` as images takes at its peak."""
    return math.prod(dims) * IDX_BYTES_PER_VALUE + min(dims[0], CHUNK_ROWS) * math.prod(dims[1:]) * 16


@dataclass
class Dataset:
    name: str
    x: np.ndarray  # float32, normalized; images (N, C, H, W), tabular (N, D)
    y: np.ndarray  # int64 class labels, or float32 targets (N, 1) for regression
    task: str  # "classification" | "regression"
    num_classes: int  # output size of the model (1 for regression)
    input_shape: tuple  # shape of one x
    client: np.ndarray | None = None  # per-sample owner id (the `natural` partition), where the source has one

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class DatasetSource:
    """A user's dataset, declared: what a plugin module exports as ``DATASET`` and what
    :func:`register_dataset` keeps. ``load`` is a callable returning ``(x, y)`` or a dict with ``x``, ``y`` and
    optionally ``client`` (or returning a torch ``Dataset``), a torch ``Dataset`` itself, or a path: an
    ``ImageFolder`` directory or a ``.npz`` file. ``num_classes`` defaults to the largest label + 1;
    ``standardize`` scales features to mean 0, variance 1 (per channel for images) as the built-ins are."""

    name: str
    load: Any
    task: str = "classification"
    num_classes: int | None = None
    standardize: bool = True


_REGISTRY: dict[str, DatasetSource] = {}


def register_dataset(dataset, source=None, *, task: str = "classification", num_classes: int | None = None,
                     standardize: bool = True) -> DatasetSource:
    """Make a dataset known by name to run, tune and compare (``dataset=NAME``).

    ``register_dataset(name, source, ...)``, or ``register_dataset(obj)`` with a :class:`DatasetSource` (or any
    object with ``name`` and ``load``), or a loaded :class:`Dataset`. The source is read when a run first
    needs it; registering a name again replaces it."""
    if source is None and not isinstance(dataset, str):
        obj = dataset
        if isinstance(obj, DatasetSource):
            spec = obj
        elif isinstance(obj, Dataset):
            arrays = {"x": obj.x, "y": obj.y, **({"client": obj.client} if obj.client is not None else {})}
            spec = DatasetSource(obj.name, lambda: arrays, obj.task,
                                 obj.num_classes if obj.task == "classification" else None, standardize=False)
        elif hasattr(obj, "name") and hasattr(obj, "load"):
            spec = DatasetSource(obj.name, obj.load, getattr(obj, "task", "classification"),
                                 getattr(obj, "num_classes", None), getattr(obj, "standardize", True))
        else:
            raise UserError(f"register_dataset({obj!r}): give a name and a source, or a DatasetSource")
    else:
        if source is None:
            raise UserError(f"register_dataset({dataset!r}): needs a source (a callable, a torch Dataset, an "
                            f"ImageFolder directory or a .npz file)")
        spec = DatasetSource(dataset, source, task, num_classes, standardize)
    _check_spec(spec)
    _REGISTRY[spec.name] = spec
    _LAST.clear()  # a name registered again must not be served from the last load
    return spec


def _check_spec(spec: DatasetSource) -> None:
    name = spec.name
    if not isinstance(name, str) or not name.strip() or ":" in name or "\0" in name or name == "auto":
        raise UserError(f"dataset name {name!r}: must be a non-empty name without ':'")
    if name in BUILTIN:
        raise UserError(f"dataset={name!r}: a built-in dataset; register yours under another name")
    if spec.task not in ("classification", "regression"):
        raise UserError(f"dataset={name!r}: task={spec.task!r}: unknown; allowed: classification, regression")
    if spec.num_classes is not None and (isinstance(spec.num_classes, bool) or not isinstance(spec.num_classes, int)
                                         or not 1 <= spec.num_classes <= MAX_CLASSES):
        raise UserError(f"dataset={name!r}: num_classes={spec.num_classes!r}: must be an integer in [1, "
                        f"{MAX_CLASSES:,}]")
    src = spec.load
    if isinstance(src, (str, os.PathLike)):
        _path_kind(name, os.fspath(src))
    elif not callable(src) and not _is_torch_dataset(src):
        raise UserError(f"dataset={name!r}: source {type(src).__name__}: give a callable returning (x, y), a torch "
                        f"Dataset, an ImageFolder directory or a .npz file")


def registered() -> dict[str, DatasetSource]:
    """The registered datasets (a copy): what a process that prepares runs needs to know of them."""
    return dict(_REGISTRY)


def restore(specs: dict | None) -> None:
    """Register in this process what :func:`registered` gave in another (a sweep trial's process)."""
    for spec in (specs or {}).values():
        _REGISTRY.setdefault(spec.name, spec)


def dataset_names() -> tuple[str, ...]:
    return BUILTIN + tuple(_REGISTRY)


def check_dataset_name(value: str) -> None:
    """A built-in or registered name, or ``folder:PATH`` / ``npz:PATH`` naming what exists: else one line."""
    kind, sep, path = str(value).partition(":")
    if sep and kind in PATH_KINDS:
        if not path:
            raise UserError(f"dataset={value!r}: {kind}: needs a path ({kind}:PATH)")
        got = _path_kind(f"dataset={value!r}", os.path.expanduser(path), quoted=False)
        if got != kind:
            what = "an ImageFolder directory" if kind == "folder" else "a .npz file"
            raise UserError(f"dataset={value!r}: {path} is not {what}")
        return
    if value not in BUILTIN and value not in _REGISTRY:
        raise UserError(f"dataset={value!r}: unknown; allowed: {', '.join(dataset_names())}, folder:PATH, npz:PATH "
                        f"or a name given to rayfl.register_dataset")


def _path_kind(name: str, path: str, quoted: bool = True) -> str:
    where = f"dataset={name!r}" if quoted else name
    if os.path.isdir(path):
        return "folder"
    if os.path.isfile(path):
        if not path.endswith(".npz"):
            raise UserError(f"{where}: {path} is a file but not a .npz file")
        return "npz"
    raise UserError(f"{where}: {path}: no such file or directory")


def _is_torch_dataset(obj) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, (str, bytes, dict, tuple,
                                                                                           list, np.ndarray))


_LAST: dict = {}  # the last dataset this process loaded, by what it was loaded from


def load_dataset(cfg) -> Dataset:
    """The dataset cfg.dataset names; synthetic ones are generated from cfg.seed. The last one loaded is kept
    (read-only), so a process that prepares run after run (sweep trials, ``compare --local``) loads it once."""
    spec = _REGISTRY.get(cfg.dataset)
    key = (cfg.dataset, cfg.data_root, cfg.download, cfg.seed if cfg.dataset in ("synthetic", "sine") else None,
           id(spec))
    if key not in _LAST:
        ds = _load(cfg)
        for a in (ds.x, ds.y, ds.client):
            if a is not None:
                a.flags.writeable = False
        _LAST.clear()
        _LAST[key] = ds
    return _LAST[key]


def _load(cfg) -> Dataset:
    name = cfg.dataset
    if name in _REGISTRY:
        return from_source(_REGISTRY[name])
    kind, sep, path = name.partition(":")
    if sep and kind in PATH_KINDS:
        check_dataset_name(name)
        return from_source(DatasetSource(name, os.path.expanduser(path)))
    if name == "digits":
        return _digits()
    if name == "synthetic":
        return _synthetic(cfg.seed)
    if name == "sine":
        return _sine(cfg.seed)
    if name in ("mnist", "fashion-mnist"):
        return _mnist_like(name, cfg)
    if name in ("cifar10", "cifar100"):
        return _cifar(name, cfg)
    check_dataset_name(name)
    raise UserError(f"dataset={name!r}: unknown")


def _standardize(x: np.ndarray) -> np.ndarray:
    """Per-channel (images) or per-feature (tabular) standardization over the whole pool, in place (the
    callers pass fresh float32 arrays; CIFAR is 0.7 GB, so no second copy)."""
    axes = (0, 2, 3) if x.ndim == 4 else (0,)
    n = x.size // int(np.prod([x.shape[a] for a in range(x.ndim) if a not in axes]))
    total = sq = 0.0
    for i in range(0, len(x), CHUNK_ROWS):  # float64 sums in chunks: no full-size float64 temporary
        chunk = x[i:i + CHUNK_ROWS].astype(np.float64)
        total = total + chunk.sum(axis=axes, keepdims=True)
        sq = sq + np.square(chunk).sum(axis=axes, keepdims=True)
    mean = total / n
    std = np.sqrt(np.maximum(sq / n - mean ** 2, 0.0))
    x -= mean.astype(np.float32)
    x /= np.maximum(std, 1e-6).astype(np.float32)
    return x


def _images(name: str, x: np.ndarray, y: np.ndarray, num_classes: int, source: str = "") -> Dataset:
    check_labels(y, num_classes, source or name)
    x = _standardize(x)
    return Dataset(name, x, y.astype(np.int64), "classification", num_classes, tuple(x.shape[1:]))


def check_labels(y: np.ndarray, num_classes: int, source: str) -> None:
    """Class labels must be integers in [0, num_classes): a label outside would be dropped by some
    partitions and crash a client's loss under others."""
    if len(y) == 0:
        raise UserError(f"{source}: holds no samples")
    lo, hi = int(np.min(y)), int(np.max(y))
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise UserError(f"{source}: label {bad} is outside the class range [0, {num_classes - 1}]")


def _digits() -> Dataset:
    """scikit-learn's 8x8 digits (1797 images): the dataset that needs no files and no network. Read from
    the file scikit-learn ships, as its ``load_digits`` does, without importing scikit-learn (2 s of start-up)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec else ""
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    except (OSError, ValueError):
        table = None
    if table is None or table.shape != (1797, 65):  # another layout: let scikit-learn read it
        from sklearn.datasets import load_digits

        d = load_digits()
        table = np.hstack([d.data, d.target[:, None]]).astype(np.float32)
    x = (table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    return _images("digits", x, table[:, 64].astype(np.int64), 10)


def _synthetic(seed: int) -> Dataset:
    """A 10-class Gaussian mixture in 32 dimensions, 200 samples per class, class means far apart: a small
    MLP is well above chance after a few local steps, which is what tests on tiny federations need."""
    rng = np.random.default_rng([seed, 0x5EED])
    classes, per_class, dim = 10, 200, 32
    means = rng.normal(0.0, 1.0, size=(classes, dim))
    y = np.repeat(np.arange(classes), per_class)
    x = means[y] + rng.normal(0.0, 1.0, size=(len(y), dim))
    order = rng.permutation(len(y))
    x = _standardize(x[order].astype(np.float32))
    return Dataset("synthetic", x, y[order].astype(np.int64), "classification", 10, (dim,))


def _sine(seed: int) -> Dataset:
    """FedeRiCo's Figure-1 toy (Sui et al., 2022, §1, Fig. 1: noisy points along a sine curve; the paper gives
    no numbers, these are ours): y = sin(x) + N(0, 0.1^2), x ~ U[0, 2π], 1000 points.
    x is left unscaled so client intervals read as intervals of the curve; the `latent` partition cuts it into
    contiguous intervals (one per group)."""
    rng = np.random.default_rng([seed, 0x51E])
    x = rng.uniform(0.0, 2 * np.pi, size=(1000, 1))
    y = np.sin(x) + rng.normal(0.0, 0.1, size=x.shape)
    return Dataset("sine", x.astype(np.float32), y.astype(np.float32), "regression", 1, (1,))


# ---------------------------------------------------------------- MNIST family (raw IDX files or torchvision)

_IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_TV_DIR = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def _read_idx(path: str, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes with ``ndim`` dimensions (plain or .gz), checked before it is used:
    a corrupt or truncated file is one line naming it, never a traceback. The header is read first: a
    declared shape that would not fit in memory (a 2.4 MB .gz of zeros can declare 3.2 million images) is
    refused before anything is allocated."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] != 8:
                raise UserError(f"{path}: not an IDX file of unsigned bytes")
            if head[3] != ndim:
                raise UserError(f"{path}: IDX file with {head[3]} dimensions; expected {ndim}")
            header = 4 + 4 * ndim
            rest = f.read(4 * ndim)
            if len(rest) < 4 * ndim:
                raise UserError(f"{path}: IDX header cut short ({4 + len(rest)} bytes, the header alone needs "
                                f"{header})")
            dims = [int.from_bytes(rest[4 * i: 4 + 4 * i], "big") for i in range(ndim)]
            need = math.prod(dims)
            shape = "x".join(map(str, dims))
            check_memory(path, idx_budget(dims), f"its declared {shape} bytes (as float32 too)")
            data = f.read(need + 1)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(f"{path}: cannot be read as {'gzip' if path.endswith('.gz') else 'a file'} "
                        f"({type(e).__name__}: {str(e) or 'truncated'})") from None
    if len(data) != need:
        raise UserError(f"{path}: truncated or padded IDX file ({len(data)}{'+' if len(data) > need else ''} bytes "
                        f"of data, the header says {shape})")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def _find(directory: str, stem: str) -> str | None:
    for candidate in (stem, stem + ".gz"):
        p = os.path.join(directory, candidate)
        if os.path.isfile(p):
            return p
    return None


def _idx_pairs(root: str, name: str) -> list[tuple[str, str]]:
    """(images, labels) file pairs found in root itself or in torchvision's root/<MNIST|FashionMNIST>/raw."""
    for directory in (root, os.path.join(root, _TV_DIR[name], "raw")):
        pairs = []
        for img_stem, lbl_stem in _IDX.values():
            img, lbl = _find(directory, img_stem), _find(directory, lbl_stem)
            if img and lbl:
                pairs.append((img, lbl))
        if pairs:
            return pairs
    return []


def _mnist_like(name: str, cfg) -> Dataset:
    """Raw IDX files in the data root are read directly (whatever of train/t10k is there); otherwise torchvision."""
    root = os.path.expanduser(cfg.data_root) if cfg.data_root else None
    pairs = _idx_pairs(root, name) if root and os.path.isdir(root) else []
    if pairs:
        xs, ys = [], []
        for img, lbl in pairs:
            x, y = _read_idx(img, 3), _read_idx(lbl, 1)
            if x.shape[1:] != (28, 28):
                raise UserError(f"{img}: {x.shape[1]}x{x.shape[2]} images; {name} images are 28x28")
            if len(x) != len(y):
                raise UserError(f"{img} and {lbl}: {len(x)} images but {len(y)} labels")
            check_labels(y, 10, lbl)
            xs.append(x)
            ys.append(y)
        x, y = np.concatenate(xs), np.concatenate(ys)
        del xs
    else:
        import torchvision.datasets as tvd

        cls = tvd.MNIST if name == "mnist" else tvd.FashionMNIST
        parts = _torchvision(cls, name, cfg)
        x = np.concatenate([p.data.numpy() for p in parts])
        y = np.concatenate([p.targets.numpy() for p in parts])
    x = x.astype(np.float32)[:, None, :, :]
    x /= 255.0  # in place: no second float32 copy
    return _images(name, x, y, 10, f"{name} in {cfg.data_root}")


def _cifar(name: str, cfg) -> Dataset:
    import torchvision.datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    parts = _torchvision(cls, name, cfg)
    x = np.concatenate([p.data for p in parts]).transpose(0, 3, 1, 2)
    y = np.concatenate([np.asarray(p.targets) for p in parts])
    x = x.astype(np.float32) / 255.0
    return _images(name, x, y, 10 if name == "cifar10" else 100, f"{name} in {cfg.data_root}")


def _torchvision(cls, name: str, cfg) -> list:
    missing = (f"dataset {name!r} needs its files: pass --data-root DIR holding them, or --download "
               f"(needs network)")
    if cfg.data_root is None and not cfg.download:
        raise UserError(missing)
    root = os.path.expanduser(cfg.data_root or os.path.join("~", ".cache", "rayfl", "data"))
    try:
        return [cls(root, train=train, download=cfg.download) for train in (True, False)]
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
        if cfg.download:
            raise UserError(f"dataset {name!r}: download into {root} failed ({e})") from None
        raise UserError(missing) from None
    except OSError as e:  # urllib errors when offline
        raise UserError(f"dataset {name!r}: download into {root} failed ({e}); pass --data-root DIR "
                        f"holding its files") from None


# ---------------------------------------------------------------- a user's own data: arrays, folders, .npz

def check_memory(what: str, nbytes: int, detail: str) -> None:
    """Refuse, before anything is allocated, data that would need more than MEMORY_SHARE of the memory
    available now, or an absurd declared size (a corrupt header) whatever the machine. ``detail`` names what
    needs the memory ("x of shape (N, 784)")."""
    if nbytes > ABSURD_BYTES:
        raise UserError(f"{what}: {detail} would need {_size(nbytes)} of memory, beyond any dataset rayfl loads "
                        f"(at most {_size(ABSURD_BYTES)}): a corrupt header?")
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > MEMORY_SHARE * available:
        raise UserError(f"{what}: {detail} needs {_size(nbytes)} of memory to load; {_size(available)} is "
                        f"available and a dataset may take at most {MEMORY_SHARE:.0%} of it")


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""  # unreachable


def from_source(spec: DatasetSource) -> Dataset:
    """Read a declared dataset and check it (lengths, finite features, labels, shapes) into a :class:`Dataset`."""
    name, src = spec.name, spec.load
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        arrays = _read_folder(name, path) if _path_kind(name, path) == "folder" else _read_npz(name, path)
    else:
        arrays = src
        if callable(src) and not _is_torch_dataset(src):
            try:
                arrays = src()
            except UserError:
                raise
            except (Exception, SystemExit, KeyboardInterrupt) as e:  # the user's code: its failure (an exit too)
                raise UserError(f"dataset={name!r}: its loader raised {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if _is_torch_dataset(arrays):
            arrays = _from_torch(name, arrays)
    x, y, client = _unpack(name, arrays)
    return _make(spec, x, y, client)


def _unpack(name: str, arrays) -> tuple:
    if isinstance(arrays, dict):
        unknown = sorted(set(arrays) - {"x", "y", "client"})
        if unknown or "x" not in arrays or "y" not in arrays:
            raise UserError(f"dataset={name!r}: gives keys {sorted(arrays)}; expected x, y and optionally client")
        return arrays["x"], arrays["y"], arrays.get("client")
    if isinstance(arrays, (tuple, list)) and len(arrays) in (2, 3):
        return arrays[0], arrays[1], arrays[2] if len(arrays) == 3 else None
    raise UserError(f"dataset={name!r}: its loader gave a {type(arrays).__name__}; expected (x, y), (x, y, client) "
                    f"or a dict with x, y and optionally client")


def _as_array(name: str, what: str, value) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise UserError(f"dataset={name!r}: {what} is not an array ({e})") from None
    if a.dtype == object:
        raise UserError(f"dataset={name!r}: {what} holds Python objects (ragged rows or mixed types); give a "
                        f"numeric array")
    return a


def _make(spec: DatasetSource, x, y, client) -> Dataset:
    name = spec.name
    x, y = _as_array(name, "x", x), _as_array(name, "y", y)
    if x.ndim == 0 or len(x) == 0:
        raise UserError(f"dataset={name!r}: holds no samples")
    if y.ndim == 0 or len(x) != len(y):
        raise UserError(f"dataset={name!r}: x has {len(x)} samples but y has {1 if y.ndim == 0 else len(y)}; "
                        f"give one label per sample")
    if x.ndim not in (2, 4):
        hint = "; images are (N, C, H, W): add a channel axis (x[:, None])" if x.ndim == 3 else ""
        raise UserError(f"dataset={name!r}: x has shape {x.shape}: expected (N, features) or (N, C, H, W){hint}")
    if x.dtype.kind not in "biuf":
        raise UserError(f"dataset={name!r}: x has dtype {x.dtype}; give numbers")
    if 0 in x.shape[1:]:
        raise UserError(f"dataset={name!r}: x has shape {x.shape}: a sample holds no features")
    if x.dtype.kind == "f":
        for i in range(0, len(x), 8192):  # in chunks: no full-size boolean temporary
            bad = ~np.isfinite(x[i:i + 8192])
            if bad.any():
                row = i + int(np.argwhere(bad)[0][0])
                raise UserError(f"dataset={name!r}: x has NaN or infinite values ({int(bad.sum())}+, the first "
                                f"in sample {row}); clean or impute them first")
    check_memory(f"dataset={name!r}", x.size * 4 + x.nbytes, f"x of shape {x.shape} ({x.dtype})")
    if spec.task == "classification":
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise UserError(f"dataset={name!r}: labels must be integers >= 0, one per sample; y has dtype {y.dtype}"
                            f" and shape {y.shape}")
        lo, hi = int(y.min()), int(y.max())
        if lo < 0:
            raise UserError(f"dataset={name!r}: label {lo}: labels must be integers >= 0")
        if hi >= MAX_CLASSES:
            raise UserError(f"dataset={name!r}: label {hi}: labels must be below {MAX_CLASSES:,} (a class each; the "
                            f"model has an output per class)")
        num_classes = spec.num_classes or int(y.max()) + 1
        check_labels(y, num_classes, f"dataset={name!r}")
        y = y.astype(np.int64)
    else:
        if y.dtype.kind not in "iuf" or y.ndim > 2:
            raise UserError(f"dataset={name!r}: regression targets must be numbers, (N,) or (N, k); y has dtype "
                            f"{y.dtype} and shape {y.shape}")
        y = y.astype(np.float32).reshape(len(y), -1)
        if not np.isfinite(y).all():
            raise UserError(f"dataset={name!r}: y has NaN or infinite values")
        num_classes = y.shape[1]
    if client is not None:
        client = _as_array(name, "client", client)
        if client.ndim != 1 or len(client) != len(x):
            raise UserError(f"dataset={name!r}: client has shape {client.shape}; give one client id per sample "
                            f"({len(x)})")
        if client.dtype.kind not in "iuUS":
            raise UserError(f"dataset={name!r}: client ids must be integers or strings; they have dtype "
                            f"{client.dtype}")
        client = client.copy()
    x = np.array(x, dtype=np.float32)  # a fresh copy: the caller's arrays stay theirs
    if spec.standardize:
        x = _standardize(x)
    return Dataset(name, x, y, spec.task, int(num_classes), tuple(x.shape[1:]), client)


def _from_torch(name: str, data) -> tuple:
    """A torch ``Dataset`` of (x, y) items, stacked once into arrays."""
    n = len(data)
    if n == 0:
        raise UserError(f"dataset={name!r}: holds no samples")
    xs, ys = [], []
    for i in range(n):
        item = data[i]
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise UserError(f"dataset={name!r}: item {i} is a {type(item).__name__}; a torch Dataset must give "
                            f"(x, y) items")
        x = _as_array(name, f"x of item {i}", item[0])
        if i == 0:
            check_memory(f"dataset={name!r}", n * x.size * 8, f"{n} samples of shape {x.shape}")
        elif x.shape != xs[0].shape:
            raise UserError(f"dataset={name!r}: item {i} has x of shape {x.shape}, item 0 {xs[0].shape}; all "
                            f"samples must have one shape")
        xs.append(x)
        ys.append(_as_array(name, f"y of item {i}", item[1]))
    return np.stack(xs), np.stack(ys)


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's


def _read_folder(name: str, root: str) -> tuple:
    """An ``ImageFolder`` layout (torchvision's: one subdirectory per class, sorted names are classes 0, 1,
    ...): decoded with PIL, all images of one size; grayscale stays one channel unless some image has colour."""
    from PIL import Image

    classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
    files, labels = [], []
    top, seen = os.path.realpath(root), set()
    for c, cls in enumerate(classes):
        for folder, dirs, names in os.walk(os.path.join(root, cls), followlinks=True):
            real = os.path.realpath(folder)  # a linked folder is read once, and never the dataset's own root
            if real in seen or real == top or top.startswith(real + os.sep):
                raise UserError(f"dataset={name!r}: {folder} is a link to a folder read already, or to the "
                                f"dataset's folder or above it (a loop); give each class folder once")
            seen.add(real)
            dirs.sort()
            for f in sorted(names):
                if f.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(os.path.join(folder, f))
                    labels.append(c)
    if not files:
        raise UserError(f"dataset={name!r}: {root} holds no images ({', '.join(IMAGE_EXTENSIONS)}) in class "
                        f"subdirectories (root/CLASS/IMAGE, as torchvision's ImageFolder)")
    sizes, gray = set(), True
    for f in files:  # headers only: sizes and modes before anything is decoded
        try:
            with Image.open(f) as im:
                sizes.add(im.size)
                gray = gray and im.mode in ("1", "L", "I", "I;16", "F")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise UserError(f"dataset={name!r}: {f}: not a readable image ({str(e).splitlines()[0][:200]})") from None
        if len(sizes) > 1:
            raise UserError(f"dataset={name!r}: {f} is {im.size[0]}x{im.size[1]}, others "
                            f"{'x'.join(map(str, next(iter(sizes - {im.size}))))}; all images must have one size")
    (w, h), c = sizes.pop(), 1 if gray else 3
    check_memory(f"dataset={name!r}", len(files) * c * h * w * 8, f"{len(files)} images of {c}x{h}x{w}")
    x = np.empty((len(files), c, h, w), dtype=np.float32)
    for i, f in enumerate(files):
        with Image.open(f) as im:
            a = np.asarray(im.convert("L" if gray else "RGB"), dtype=np.float32)
        x[i] = a[None] if gray else a.transpose(2, 0, 1)
    return x / 255.0, np.asarray(labels, dtype=np.int64)


def _read_npz(name: str, path: str) -> dict:
    """A ``.npz`` of arrays x, y and optionally client; the declared sizes (the .npy headers) are checked before
    any array is read, and no pickled object is ever loaded."""
    import zipfile

    where = f"dataset={name!r}: {path}"
    try:
        with zipfile.ZipFile(path) as z:
            members = {m.filename[:-4]: m for m in z.infolist() if m.filename.endswith(".npy")}
            unknown = sorted(set(members) - {"x", "y", "client"})
            if unknown or "x" not in members or "y" not in members:
                raise UserError(f"{where}: holds arrays {sorted(members)}; expected x, y and optionally client")
            total = 0
            for key, m in members.items():
                with z.open(m) as f:
                    version = np.lib.format.read_magic(f)
                    shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                       else np.lib.format.read_array_header_2_0(f))
                if dtype.hasobject:
                    raise UserError(f"{where}: array {key} holds Python objects (pickled); give numeric arrays")
                total += math.prod(shape) * dtype.itemsize * (2 if key == "x" else 1)  # x: a float32 copy too
            check_memory(where, total, "its arrays")
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise UserError(f"{where}: not a readable .npz file ({type(e).__name__}: {e})") from None
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in members}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{where}: not a readable .npz file ({type(e).__name__}: {e})") from None
