"""rayfl.snapshot: every kind of state rayfl keeps survives bytes and back, and loading never runs code."""

from __future__ import annotations

import io
import json
import pickle
import struct

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import Payload, same
from rayfl import snapshot
from rayfl.snapshot import MAGIC, SnapshotError


def test_everything_rayfl_keeps_round_trips_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(7)
    rng = np.random.default_rng([3, 4])
    rng.random(3)
    state = {
        "plain": [None, True, False, 0, -5, 2**100, 1.5, float("inf"), float("-inf"), float("nan"), "text", ""],
        "tuple": (1, (2, "x")), 7: "int key", (1, "a"): "tuple key", np.int64(3): "numpy key",
        "numpy scalars": [np.float32(0.1), np.float64(0.2), np.int64(-3), np.uint8(250), np.bool_(True)],
        "arrays": [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(12).reshape(3, 4).T, np.array(2.5),
                   np.zeros((0, 3)), np.array([True, False]), np.array([1.0, np.nan], dtype=np.float16)],
        "model": dict(model.state_dict()), "optimizer": opt.state_dict(), "gen": gen.get_state(),
        "rng": rng.bit_generator.state, "bf16": torch.ones(3, dtype=torch.bfloat16) / 3,
        "table": pd.DataFrame({"client": [0, 1], "lam": [0.1, 0.5], "group": [None, 2]}),
        "indexed": pd.DataFrame({"x": [1.0, 2.0]}, index=[5, 9]),
        "bytes": b"\x00\xffabc", "empty": {}, "empty list": [],
    }
    back = snapshot.loads(snapshot.dumps(state))
    assert same(back, state)
    # the restored states drive the same random streams and optimizer steps
    g2 = torch.Generator()
    g2.set_state(back["gen"])
    assert torch.equal(torch.rand(4, generator=g2), torch.rand(4, generator=gen))
    r2 = np.random.default_rng()
    r2.bit_generator.state = back["rng"]
    assert np.array_equal(r2.random(4), rng.random(4))
    opt2 = torch.optim.Adam(model.parameters())
    opt2.load_state_dict(back["optimizer"])
    assert same(opt2.state_dict()["state"], opt.state_dict()["state"])


def test_loaded_arrays_are_writable_copies():
    blob = snapshot.dumps({"a": np.ones(3)})
    a = snapshot.loads(blob)["a"]
    a[0] = 5  # servers update their arrays in place after a restore
    assert snapshot.loads(blob)["a"][0] == 1


@pytest.mark.parametrize("bad", [object(), {1, 2}, np.array([object()]), np.complex128(1j), lambda: 0,
                                 np.zeros(2, dtype=[("a", "f4")])])
def test_what_is_not_plain_data_is_refused_on_save(bad):
    with pytest.raises(SnapshotError):
        snapshot.dumps({"x": bad})


def craft(tree, arrays=(), metas=None) -> bytes:
    """A snapshot file written by hand, as an attacker would."""
    metas = metas if metas is not None else [{"t": a.dtype.str, "s": list(a.shape)} for a in arrays]
    head = json.dumps({"tree": tree, "arrays": metas}).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + b"".join(a.tobytes() for a in arrays)


def test_pickles_and_crafted_headers_are_refused_without_running_anything(tmp_path):
    marker = tmp_path / "pwned"
    evil_pickle = pickle.dumps({"model": Payload(marker)})
    buf = io.BytesIO()
    torch.save({"model": Payload(marker)}, buf)
    np_buf = io.BytesIO()
    np.save(np_buf, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    cases = {
        "pickle": evil_pickle,
        "torch.save": buf.getvalue(),
        "np.save of objects": np_buf.getvalue(),
        "object dtype in header": craft({"$": "nd", "a": 0}, metas=[{"t": "|O", "s": [1]}]) + evil_pickle,
        "structured dtype": craft({"$": "nd", "a": 0}, metas=[{"t": [["a", "|O"]], "s": [1]}]),
        "unknown node": craft({"$": "pickle", "v": evil_pickle.hex()}),
        "unknown torch dtype": craft({"$": "pt", "t": "Tensor", "a": 0}, [np.zeros(1)]),
        "array index out of range": craft({"$": "nd", "a": 3}, [np.zeros(1)]),
        "truncated data": craft({"$": "nd", "a": 0}, [np.zeros(4)])[:-8],
        "trailing data": craft(None) + evil_pickle,
        "header length beyond the end": MAGIC + struct.pack("<Q", 10**9) + b"{}",
        "header not JSON": MAGIC + struct.pack("<Q", 5) + b"\x80\x04K\x01.",
    }
    for name, blob in cases.items():
        with pytest.raises(SnapshotError):
            snapshot.loads(blob)
        assert not marker.exists(), name
    assert pickle.loads(evil_pickle) and marker.exists()  # the payload is live: it did run when unpickled


def test_save_is_atomic_and_load_reads_it(tmp_path):
    path = str(tmp_path / "s.rayfl")
    snapshot.save(path, {"a": np.arange(3)})
    assert np.array_equal(snapshot.load(path)["a"], np.arange(3))
    assert not (tmp_path / "s.rayfl.tmp").exists()
