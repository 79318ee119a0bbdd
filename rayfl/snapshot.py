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
import math
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
        if not isinstance(meta, list):
            raise TypeError("'arrays' is not a list")
    except RecursionError:
        raise SnapshotError("unreadable snapshot header: nested past Python's recursion limit") from None
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"unreadable snapshot header: {type(e).__name__}: {str(e)[:200]}") from None
    pos += n
    arrays = []
    for i, m in enumerate(meta):
        dtype, shape = _array_meta(i, m)
        nbytes = math.prod(shape) * dtype.itemsize  # Python integers: a declared terabyte does not wrap around
        if pos + nbytes > len(data):
            raise SnapshotError(f"truncated snapshot data: array {i} declares shape {shape} of {dtype} "
                                f"({nbytes:,} bytes), {len(data) - pos:,} bytes are left")
        arrays.append(np.frombuffer(data[pos:pos + nbytes], dtype=dtype).reshape(shape).copy())
        pos += nbytes
    if pos != len(data):
        raise SnapshotError("trailing bytes after the snapshot data")
    try:
        return _decode(tree, arrays, device)
    except RecursionError:
        raise SnapshotError("malformed snapshot: nested past Python's recursion limit") from None
    except (SnapshotError, KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        try:
            where = _failing_node(tree, arrays, device, "")
        except RecursionError:
            where = ""
        problem = str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {str(e)[:200]}"
        raise SnapshotError(f"malformed snapshot{' at ' + where if where else ''}: {problem}") from None


_DECODE_ERRORS = (SnapshotError, KeyError, TypeError, ValueError, AttributeError, RuntimeError)


def _failing_node(node: Any, arrays: list, device: str, path: str) -> str:
    """Where in the tree decoding fails (``.server.P``, ``[2]``): the deepest node whose children all decode.
    Walked only after a failure, so that loading stays one pass."""
    if isinstance(node, list):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(node)]
    elif isinstance(node, dict) and node.get("$") in ("dict", "tuple", "map") and isinstance(node.get("v"), (dict, list)):
        v = node["v"]
        children = [(f"{path}.{k}", c) for k, c in v.items()] if isinstance(v, dict) else \
            [(f"{path}[{i}]", c) for i, c in enumerate(v)]
    else:
        children = []
    for child_path, child in children:
        try:
            _decode(child, arrays, device)
        except _DECODE_ERRORS:
            return _failing_node(child, arrays, device, child_path)
    return path


def _array_meta(i: int, m: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """An array's declared dtype and shape: a plain dtype and a list of integers >= 0."""
    if not isinstance(m, dict) or "t" not in m or not isinstance(m.get("s"), list):
        raise SnapshotError(f"array {i}: its entry in the header is not {{\"t\": dtype, \"s\": shape}}")
    shape = m["s"]
    if len(shape) > 32 or not all(type(s) is int and s >= 0 for s in shape):
        raise SnapshotError(f"array {i}: shape {str(shape)[:100]} is not a list of at most 32 integers >= 0")
    return _plain_dtype(m["t"]), tuple(shape)


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


# --------------------------------------------------------------------------------------------------
# validation against a template (a fresh state of the same kind)
# --------------------------------------------------------------------------------------------------
def check_like(value: Any, template: Any, where: str) -> None:
    """Refuse ``value`` (loaded from a file) where it cannot stand in for ``template`` (the same state, made
    fresh): SnapshotError naming the field (``where`` and the path below it).

    Generic, so that no algorithm is named: every array or tensor of the template must be one of the same
    kind, shape and dtype (an empty one only of as many dimensions: it is filled in later), and finite where
    the template's is (all of it); every key of a string-keyed mapping must be
    there (keys added later in a run are let through); sequences of the template's length are checked item
    by item (a list that grows in a run is not); a number must stay a number. ``None`` in the template,
    something set later, takes anything."""
    stack = [(value, template, where)]
    while stack:
        v, t, path = stack.pop()
        if t is None:
            continue
        if _is_array(t):
            _check_array(v, t, path)
        elif isinstance(t, dict):
            if not isinstance(v, dict):
                raise SnapshotError(f"{path}: a {_kind(v)}, expected a mapping")
            for k in t:
                if k not in v:
                    raise SnapshotError(f"{path}: no {k!r}")
                stack.append((v[k], t[k], f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]"))
        elif isinstance(t, (list, tuple)):
            if not isinstance(v, (list, tuple)):
                raise SnapshotError(f"{path}: a {_kind(v)}, expected a sequence")
            if len(v) == len(t):
                stack.extend((a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(v, t)))
        elif isinstance(t, (bool, np.bool_)):
            if not isinstance(v, (bool, np.bool_)):
                raise SnapshotError(f"{path}: a {_kind(v)}, expected true or false")
        elif isinstance(t, (int, float, np.number)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
                raise SnapshotError(f"{path}: a {_kind(v)}, expected a number")
        elif isinstance(t, str) and not isinstance(v, str):
            raise SnapshotError(f"{path}: a {_kind(v)}, expected a string")


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] == "torch" and hasattr(x, "shape")


def _kind(x: Any) -> str:
    return "tensor" if _is_array(x) and not isinstance(x, np.ndarray) else type(x).__name__


def _check_array(v: Any, t: Any, path: str) -> None:
    if not _is_array(v) or isinstance(v, np.ndarray) != isinstance(t, np.ndarray):
        raise SnapshotError(f"{path}: a {_kind(v)}, expected a {_kind(t)}")
    placeholder = math.prod(t.shape) == 0  # an empty array filled in later (clusters found, rounds seen)
    if (v.ndim != t.ndim if placeholder else tuple(v.shape) != tuple(t.shape)) or v.dtype != t.dtype:
        expected = f"{t.ndim} dimensions" if placeholder else f"{tuple(t.shape)}"
        raise SnapshotError(f"{path}: shape {tuple(v.shape)} of {v.dtype}, expected {expected} of {t.dtype}")
    if placeholder:  # nothing to say which values it may hold
        return
    if isinstance(v, np.ndarray):
        bad = v.dtype.kind in "fc" and np.isfinite(t).all() and not np.isfinite(v).all()
    else:
        import torch

        bad = ((v.is_floating_point() or v.is_complex()) and bool(torch.isfinite(t).all())
               and not bool(torch.isfinite(v).all()))
    if bad:
        raise SnapshotError(f"{path}: holds NaN or infinite values")
