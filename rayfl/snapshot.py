"""Plain-data snapshots: nested state to bytes and back, with no pickle anywhere.

A checkpoint or a client's state is a tree of dicts, lists, tuples, strings, numbers, ``None``, numpy
arrays and scalars, torch tensors (model and optimizer state, Generator states) and small pandas tables.
It is stored as one JSON header (the tree, every array replaced by a reference) followed by the arrays'
raw bytes. Loading parses JSON and reads numbers into arrays of a checked plain dtype: nothing in a file
can name a class to build or a function to call, so a crafted file cannot run code.

    blob = dumps(state)          # bytes
    state = loads(blob)          # the same tree (arrays are fresh, writable copies)
    save(path, state); load(path)
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

MAGIC = b"RAYFLSNAP1\n"
_LEN = struct.Struct("<Q")
_SCALAR_KINDS = "biuf"  # numpy scalars kept inline in the JSON header (bool, int, unsigned, float)


class SnapshotError(ValueError):
    """The bytes are not a rayfl snapshot, or hold something a snapshot may not hold."""


# --------------------------------------------------------------------------------------------------
# tree <-> (JSON-able header, arrays)
# --------------------------------------------------------------------------------------------------
def _encode(obj: Any, arrays: list) -> Any:
    """JSON-able form of ``obj``; arrays are appended to ``arrays`` and referenced by index.
    Every JSON object in the result is a tagged node (``{"$": kind, ...}``), so nothing is ambiguous."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, np.generic):  # before int/float: np.float64 is a float subclass
        if obj.dtype.kind not in _SCALAR_KINDS:
            raise SnapshotError(f"cannot snapshot a numpy scalar of dtype {obj.dtype}")
        return {"$": "np", "t": obj.dtype.str, "v": obj.item()}
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, list):
        return [_encode(v, arrays) for v in obj]
    if isinstance(obj, tuple):
        return {"$": "tuple", "v": [_encode(v, arrays) for v in obj]}
    if isinstance(obj, dict):
        if all(type(k) is str for k in obj):
            return {"$": "dict", "v": {k: _encode(v, arrays) for k, v in obj.items()}}
        return {"$": "map", "k": [_encode(k, arrays) for k in obj], "v": [_encode(v, arrays) for v in obj.values()]}
    if isinstance(obj, (bytes, bytearray)):
        return {"$": "bytes", "a": _add(np.frombuffer(bytes(obj), dtype=np.uint8), arrays)}
    if isinstance(obj, np.ndarray):
        return {"$": "nd", "a": _add(obj, arrays)}
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu()
            name = str(t.dtype).removeprefix("torch.")
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            return {"$": "pt", "t": name, "a": _add(t.numpy(), arrays)}
    if mod == "pandas":
        import pandas as pd

        if isinstance(obj, pd.DataFrame):
            cols = [obj.iloc[:, i] for i in range(obj.shape[1])]
            data = [a if a.dtype.kind in "biuf" else c.tolist() for c, a in ((c, c.to_numpy()) for c in cols)]
            index = None if obj.index.equals(pd.RangeIndex(len(obj))) else obj.index.to_numpy()
            return {"$": "df", "cols": _encode(list(obj.columns), arrays), "data": _encode(data, arrays),
                    "index": _encode(index, arrays)}
    raise SnapshotError(f"cannot snapshot a {type(obj).__module__}.{type(obj).__qualname__}: "
                        "snapshots hold plain data and arrays only")


def _add(arr: np.ndarray, arrays: list) -> int:
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise SnapshotError(f"cannot snapshot an array of dtype {arr.dtype}: plain numbers only")
    arrays.append(arr if arr.flags.c_contiguous else arr.copy(order="C"))  # (ascontiguousarray makes 0-d 1-d)
    return len(arrays) - 1


def _decode(node: Any, arrays: list, device: str) -> Any:
    if isinstance(node, list):
        return [_decode(v, arrays, device) for v in node]
    if not isinstance(node, dict):
        return node  # None, bool, str, int, float
    kind = node.get("$")
    if kind == "np":
        dtype = _plain_dtype(node["t"])
        if dtype.kind not in _SCALAR_KINDS:
            raise SnapshotError(f"numpy scalar of dtype {dtype}: not allowed")
        return dtype.type(node["v"])
    if kind == "tuple":
        return tuple(_decode(v, arrays, device) for v in node["v"])
    if kind == "dict":
        return {k: _decode(v, arrays, device) for k, v in node["v"].items()}
    if kind == "map":
        return dict(zip((_decode(k, arrays, device) for k in node["k"]), (_decode(v, arrays, device) for v in node["v"])))
    if kind == "bytes":
        return _array(node, arrays).tobytes()
    if kind == "nd":
        return _array(node, arrays)
    if kind == "pt":
        import torch

        dtype = getattr(torch, str(node["t"]), None)
        if not isinstance(dtype, torch.dtype):
            raise SnapshotError(f"unknown torch dtype {node['t']!r}")
        t = torch.from_numpy(_array(node, arrays))
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        if t.dtype != dtype:
            raise SnapshotError(f"tensor stored as {t.dtype} but labelled {dtype}")
        return t.to(device)
    if kind == "df":
        import pandas as pd

        names = _decode(node["cols"], arrays, device)
        data = _decode(node["data"], arrays, device)
        index = _decode(node["index"], arrays, device)
        df = pd.DataFrame({i: col for i, col in enumerate(data)}, index=index)
        df.columns = names
        return df
    raise SnapshotError(f"unknown node kind {kind!r}")


def _array(node: dict, arrays: list) -> np.ndarray:
    i = node["a"]
    if type(i) is not int or not 0 <= i < len(arrays):
        raise SnapshotError(f"array reference {i!r} out of range")
    return arrays[i]


def _plain_dtype(text: Any) -> np.dtype:
    try:
        dtype = np.dtype(str(text))
    except TypeError:
        raise SnapshotError(f"dtype {text!r}: not a numpy dtype") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufcmM":
        raise SnapshotError(f"dtype {text!r}: plain numbers only")
    return dtype


# --------------------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------------------
def dumps(obj: Any) -> bytes:
    """MAGIC, the header's length, the JSON header, then every array's bytes in order."""
    arrays: list[np.ndarray] = []
    tree = _encode(obj, arrays)
    meta = [{"t": a.dtype.str, "s": list(a.shape)} for a in arrays]
    header = json.dumps({"tree": tree, "arrays": meta}, separators=(",", ":")).encode()
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *(a.reshape(-1).view(np.uint8) for a in arrays)])


def loads(data: bytes | bytearray | memoryview, device: str = "cpu") -> Any:
    """The tree ``dumps`` wrote; torch tensors go to ``device``. Refuses anything but plain data."""
    data = memoryview(data).cast("B")
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise SnapshotError("not a rayfl snapshot (wrong magic bytes)")
    pos = len(MAGIC) + _LEN.size
    if len(data) < pos:
        raise SnapshotError("truncated snapshot")
    (n,) = _LEN.unpack(data[len(MAGIC):pos])
    if pos + n > len(data):
        raise SnapshotError("truncated snapshot header")
    try:
        head = json.loads(bytes(data[pos:pos + n]))
        tree, meta = head["tree"], head["arrays"]
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"unreadable snapshot header: {e}") from None
    pos += n
    arrays = []
    for m in meta:
        dtype = _plain_dtype(m["t"])
        shape = tuple(int(s) for s in m["s"])
        if any(s < 0 for s in shape):
            raise SnapshotError(f"negative array shape {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if pos + nbytes > len(data):
            raise SnapshotError("truncated snapshot data")
        arrays.append(np.frombuffer(data[pos:pos + nbytes], dtype=dtype).reshape(shape).copy())
        pos += nbytes
    if pos != len(data):
        raise SnapshotError("trailing bytes after the snapshot data")
    try:
        return _decode(tree, arrays, device)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"malformed snapshot: {type(e).__name__}: {e}") from None


def save(path: str, obj: Any) -> None:
    """Write atomically: a crash never leaves a half-written file under ``path``."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(dumps(obj))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str, device: str = "cpu") -> Any:
    with open(path, "rb") as f:
        return loads(f.read(), device)
