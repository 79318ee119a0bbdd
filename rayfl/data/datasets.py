"""Whole datasets as normalized numpy arrays, loaded once on the driver and shared with the actors.

Train and test files are concatenated: the partitioning (partition.py) makes each client's own test split and
the global holdout, so the original split has no role (as in PersFL's pooled setup).
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from dataclasses import dataclass

import numpy as np

from rayfl.config import Config, UserError

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic", "sine")


@dataclass
class Dataset:
    name: str
    x: np.ndarray  # float32, normalized; images (N, C, H, W), tabular (N, D)
    y: np.ndarray  # int64 class labels, or float32 targets (N, 1) for regression
    task: str  # "classification" | "regression"
    num_classes: int  # output size of the model (1 for regression)
    input_shape: tuple  # shape of one x

    def __len__(self) -> int:
        return len(self.x)


_LAST: dict = {}  # the last dataset this process loaded, by what it was loaded from


def load_dataset(cfg: Config) -> Dataset:
    """The dataset cfg.dataset names; synthetic ones are generated from cfg.seed. The last one loaded is kept
    (read-only), so a process that prepares run after run (sweep trials, ``compare --local``) loads it once."""
    key = (cfg.dataset, cfg.data_root, cfg.download, cfg.seed if cfg.dataset in ("synthetic", "sine") else None)
    if key not in _LAST:
        ds = _load(cfg)
        ds.x.flags.writeable = ds.y.flags.writeable = False
        _LAST.clear()
        _LAST[key] = ds
    return _LAST[key]


def _load(cfg: Config) -> Dataset:
    name = cfg.dataset
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
    raise UserError(f"dataset={name!r}: unknown; allowed: {', '.join(DATASETS)}")


def _standardize(x: np.ndarray) -> np.ndarray:
    """Per-channel (images) or per-feature (tabular) standardization over the whole pool, in place (the
    callers pass fresh float32 arrays; CIFAR is 0.7 GB, so no second copy)."""
    axes = (0, 2, 3) if x.ndim == 4 else (0,)
    n = x.size // int(np.prod([x.shape[a] for a in range(x.ndim) if a not in axes]))
    total = sq = 0.0
    for i in range(0, len(x), 8192):  # float64 sums in chunks: no full-size float64 temporary
        chunk = x[i:i + 8192].astype(np.float64)
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
    """FedeRiCo's Figure-1 toy (spec 002 §5.2): y = sin(x) + N(0, 0.1^2), x ~ U[0, 2π], 1000 points.
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
    a corrupt or truncated file is one line naming it, never a traceback."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(f"{path}: cannot be read as {'gzip' if path.endswith('.gz') else 'a file'} "
                        f"({type(e).__name__}: {str(e) or 'truncated'})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 8:
        raise UserError(f"{path}: not an IDX file of unsigned bytes")
    if data[3] != ndim:
        raise UserError(f"{path}: IDX file with {data[3]} dimensions; expected {ndim}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UserError(f"{path}: IDX header cut short ({len(data)} bytes, the header alone needs {header})")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(data) - header != math.prod(dims):
        raise UserError(f"{path}: truncated or padded IDX file ({len(data) - header} bytes of data, "
                        f"the header says {'x'.join(map(str, dims))})")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


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


def _mnist_like(name: str, cfg: Config) -> Dataset:
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
    else:
        import torchvision.datasets as tvd

        cls = tvd.MNIST if name == "mnist" else tvd.FashionMNIST
        parts = _torchvision(cls, name, cfg)
        x = np.concatenate([p.data.numpy() for p in parts])
        y = np.concatenate([p.targets.numpy() for p in parts])
    x = (x.astype(np.float32) / 255.0)[:, None, :, :]
    return _images(name, x, y, 10, f"{name} in {cfg.data_root}")


def _cifar(name: str, cfg: Config) -> Dataset:
    import torchvision.datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    parts = _torchvision(cls, name, cfg)
    x = np.concatenate([p.data for p in parts]).transpose(0, 3, 1, 2)
    y = np.concatenate([np.asarray(p.targets) for p in parts])
    x = x.astype(np.float32) / 255.0
    return _images(name, x, y, 10 if name == "cifar10" else 100, f"{name} in {cfg.data_root}")


def _torchvision(cls, name: str, cfg: Config) -> list:
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
