"""A user's own data: registered sources (callables, torch Datasets, ImageFolder directories, .npz files),
the ``natural`` partition by a client column, and what is refused before any actor starts."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

import rayfl
from rayfl.config import UserError
from rayfl.data import datasets as D
from rayfl.experiment import prepare

from conftest import tiny


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    for name in [n for n in D._REGISTRY if n.startswith("t-")]:
        del D._REGISTRY[name]
    D._LAST.clear()


def blobs(n=240, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.integers(0, 3, n)
    return x, y


def test_natural_partition_clients_are_the_id_column_groups():
    x, y = blobs()
    owners = np.random.default_rng(1).choice(np.array(["ward-b", "ward-a", "clinic", "home"]), size=len(x))
    rayfl.register_dataset("t-hospital", lambda: {"x": x, "y": y, "client": owners})
    p = prepare(tiny(dataset="t-hospital", partition="natural", clients=4, samples_per_client=0))
    assert len(p.federation.holdout) == 0
    for i, name in enumerate(sorted(set(owners))):  # client i: the i-th id in sorted order, sample for sample
        held = np.sort(np.concatenate([p.federation.clients[i].train, p.federation.clients[i].val,
                                       p.federation.clients[i].test]))
        np.testing.assert_array_equal(held, np.flatnonzero(owners == name))
    assert p.info.n_train == [len(c.train) for c in p.federation.clients]


def test_natural_partition_needs_a_column_and_the_right_count():
    x, y = blobs()
    rayfl.register_dataset("t-nocol", lambda: (x, y))
    with pytest.raises(UserError, match=r"^partition='natural': needs a dataset with a client column"):
        prepare(tiny(dataset="t-nocol", partition="natural"))
    rayfl.register_dataset("t-col", lambda: (x, y, np.arange(len(x)) % 5))
    with pytest.raises(UserError, match=r"^clients=3: partition='natural' takes the 5 clients .*; set clients=5$"):
        prepare(tiny(dataset="t-col", partition="natural", clients=3))


def test_a_registered_source_is_the_data_it_gives():
    x, y = blobs()
    rayfl.register_dataset("t-raw", lambda: (x, y), standardize=False)
    ds = D.load_dataset(tiny(dataset="t-raw"))
    np.testing.assert_array_equal(ds.x, x)
    np.testing.assert_array_equal(ds.y, y)
    assert (ds.num_classes, ds.input_shape, ds.task) == (3, (6,), "classification")
    rayfl.register_dataset("t-std", lambda: (x, y))
    std = D.load_dataset(tiny(dataset="t-std")).x
    np.testing.assert_allclose(std, (x - x.mean(0)) / x.std(0), atol=1e-5)


def test_a_torch_dataset_is_materialized_once():
    import torch
    from torch.utils.data import TensorDataset

    x, y = blobs(50)
    rayfl.register_dataset("t-torch", TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), standardize=False)
    ds = D.load_dataset(tiny(dataset="t-torch"))
    np.testing.assert_array_equal(ds.x, x)
    np.testing.assert_array_equal(ds.y, y)


def test_a_declared_source_and_a_loaded_dataset_register_as_objects():
    x, y = blobs(40)
    D.register_dataset(D.DatasetSource("t-decl", lambda: (x, y), standardize=False))
    np.testing.assert_array_equal(D.load_dataset(tiny(dataset="t-decl")).x, x)
    D.register_dataset(D.Dataset("t-loaded", x, y, "classification", 3, (6,)))
    assert D.load_dataset(tiny(dataset="t-loaded")).num_classes == 3


BAD = {
    "lengths": (lambda: (np.zeros((5, 2)), np.zeros(4, int)), r"x has 5 samples but y has 4"),
    "nan": (lambda: (np.array([[0.0, np.nan]] * 4), np.zeros(4, int)), r"x has NaN or infinite values"),
    "inf": (lambda: (np.array([[0.0, 1.0]] * 3 + [[np.inf, 0.0]]), np.zeros(4, int)), r"NaN or infinite .*sample 3"),
    "float labels": (lambda: (np.zeros((4, 2)), np.array([0.0, 1.0, 0.5, 1.0])), r"labels must be integers >= 0"),
    "negative": (lambda: (np.zeros((4, 2)), np.array([0, 1, -1, 1])), r"label -1: labels must be integers >= 0"),
    "empty": (lambda: (np.zeros((0, 2)), np.zeros(0, int)), r"holds no samples"),
    "ragged": (lambda: ([[1.0], [1.0, 2.0]], [0, 1]), r"not an array|Python objects"),
    "raises": (lambda: 1 / 0, r"its loader raised ZeroDivisionError"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_source_is_one_line(case):
    load, message = BAD[case]
    rayfl.register_dataset("t-bad", load)
    with pytest.raises(UserError, match=r"^dataset='t-bad': .*" + message) as err:
        prepare(tiny(dataset="t-bad"))
    assert "\n" not in str(err.value)


def test_cli_refuses_bad_data_before_ray(tmp_path, monkeypatch, capsys):
    import rayfl.api
    from rayfl.cli import main

    monkeypatch.setattr(rayfl.session, "start_ray", lambda *a: pytest.fail("Ray started"))
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("no image")
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 2)), y=np.array([0.5, 1, 0, 1]))
    cases = [(f"folder:{tmp_path / 'imgs'}", "holds no images"),
             (f"npz:{tmp_path / 'bad.npz'}", "labels must be integers >= 0"),
             (f"npz:{tmp_path / 'missing.npz'}", "no such file or directory"),
             (f"folder:{tmp_path / 'bad.npz'}", "is not an ImageFolder directory"),
             ("t-unregistered", "unknown")]
    for spelling, fragment in cases:
        assert main(["run", "--dataset", spelling, "--clients", "2", "--rounds", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rayfl: error: dataset=") and fragment in err and err.count("\n") == 1, err


def test_image_folder_reads_classes_in_sorted_order(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = {}
    for cls in ("dog", "cat"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            a = rng.integers(0, 256, size=(5, 4), dtype=np.uint8)
            Image.fromarray(a, mode="L").save(tmp_path / cls / f"{i}.png")
            pixels[(cls, i)] = a
    ds = D.from_source(D.DatasetSource("t-folder", str(tmp_path), standardize=False))
    assert ds.x.shape == (6, 1, 5, 4) and ds.num_classes == 2
    expected = np.stack([pixels[(c, i)] for c in ("cat", "dog") for i in range(3)])[:, None] / 255.0
    np.testing.assert_allclose(ds.x, expected, atol=1e-7)
    np.testing.assert_array_equal(ds.y, [0, 0, 0, 1, 1, 1])
    Image.fromarray(np.zeros((6, 4), np.uint8), mode="L").save(tmp_path / "cat" / "big.png")
    with pytest.raises(UserError, match=r"big.png is 4x6, others 4x5; all images must have one size"):
        D.from_source(D.DatasetSource("t-folder", str(tmp_path)))


def test_npz_with_a_client_column_and_no_pickles(tmp_path):
    x, y = blobs(30)
    np.savez(tmp_path / "d.npz", x=x, y=y, client=np.arange(30) % 3)
    ds = D.load_dataset(tiny(dataset=f"npz:{tmp_path / 'd.npz'}"))
    np.testing.assert_array_equal(ds.client, np.arange(30) % 3)
    np.savez(tmp_path / "o.npz", x=np.array([object(), 1], dtype=object), y=np.zeros(2, int))
    with pytest.raises(UserError, match=r"array x holds Python objects"):
        D.load_dataset(tiny(dataset=f"npz:{tmp_path / 'o.npz'}"))
    np.savez(tmp_path / "k.npz", X=x, y=y)
    with pytest.raises(UserError, match=r"holds arrays \['X', 'y'\]; expected x, y and optionally client"):
        D.load_dataset(tiny(dataset=f"npz:{tmp_path / 'k.npz'}"))


class _Memory:
    def __init__(self, available):
        self.available = available


def _idx_header(path, dims, data=b""):
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 8, len(dims)]) + b"".join(int(d).to_bytes(4, "big") for d in dims) + data)


def test_idx_declaring_more_than_memory_is_refused_before_reading(tmp_path, monkeypatch):
    import psutil

    path = str(tmp_path / "train-images-idx3-ubyte.gz")
    _idx_header(path, (3_200_000, 28, 28), bytes(1000))  # the data cut short: the size is refused first
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(8 * 10**9))
    with pytest.raises(UserError) as err:
        D._read_idx(path, 3)
    # 3.2e6 * 784 values at 7 bytes (read, joined, float32), and a standardization chunk of 8192 x 784 x 16 bytes
    assert 3_200_000 * 784 * 7 + 8192 * 784 * 16 == 17_664_360_448
    assert str(err.value) == (f"{path}: its declared 3200000x28x28 bytes (as float32 too) needs 17.7 GB of memory "
                              f"to load; 8.0 GB is available and a dataset may take at most 50% of it")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(10**12))
    with pytest.raises(UserError, match=r"truncated or padded IDX file \(1000 bytes of data"):
        D._read_idx(path, 3)  # with the memory there, the same file is read and found short


def test_idx_with_an_absurd_shape_is_refused_whatever_the_memory(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: pytest.fail("asked for memory"))
    path = str(tmp_path / "x.gz")
    _idx_header(path, (2**31, 2**10, 2**10))
    with pytest.raises(UserError, match=r"beyond any dataset rayfl loads .*corrupt header"):
        D._read_idx(path, 3)


def test_npz_sizes_are_checked_from_the_headers(tmp_path, monkeypatch):
    import psutil

    x, y = blobs(1000)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(20_000))
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(UserError, match=r"its arrays needs 56.0 KB of memory"):  # x twice (24 KB) + y (8 KB)
        D.from_source(D.DatasetSource("t-npz", str(tmp_path / "d.npz")))


def test_a_registered_dataset_and_model_run_on_ray(ray_session, mlflow_uri, tmp_path):
    from torch import nn

    x, y = blobs(300)
    rayfl.register_dataset("t-ray", lambda: {"x": x, "y": y, "client": np.arange(300) % 3})

    def bn_mlp(shape, k):  # a local function: pickled by value to the actors
        return nn.Sequential(nn.Linear(shape[0], 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, k))

    rayfl.register_model("t-bn-mlp", bn_mlp)
    try:
        result = rayfl.run(dataset="t-ray", model="t-bn-mlp", partition="natural", clients=3, rounds=2,
                           buffers="local", batch_size=32, tracking_uri=mlflow_uri, out_dir=str(tmp_path / "runs"),
                           progress=False)
    finally:
        from rayfl import models

        models.MODELS.pop("t-bn-mlp", None)
    assert len(result.clients) == 3 and len(result.history) == 2
    assert 0.0 <= result.final["test_acc_mean"] <= 1.0
