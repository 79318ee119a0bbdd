"""Datasets, partitions, splits, OOD swap, transforms and the user errors (small, no Ray)."""

import os

import numpy as np
import pytest
import torch

from rayfl.config import Config, UserError
from rayfl.data import (DATASETS, ClientData, Dataset, Federation, build_federation, load_dataset,
                        materialize)

MNIST_T10K = "/work/shared/datasets/mnist-t10k"
PARTITIONS = ("iid", "pathological", "dirichlet", "latent", "majority", "label-groups", "rotation", "permutation")


@pytest.fixture(scope="module")
def digits():
    return load_dataset(Config(dataset="digits"))


def fed(ds, **kw):
    return build_federation(Config(**kw), ds)


def held(c: ClientData) -> np.ndarray:
    return np.concatenate([c.train, c.val, c.test])


def label_counts(ds, c, classes=10):
    return np.bincount(ds.y[held(c)], minlength=classes)


# ------------------------------------------------------------------------------------------------ datasets

def test_names():
    assert set(DATASETS) == {"digits", "mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic", "sine"}


def test_digits(digits):
    assert digits.x.shape == (1797, 1, 8, 8) and digits.x.dtype == np.float32
    assert digits.y.dtype == np.int64 and digits.num_classes == 10 and digits.input_shape == (1, 8, 8)
    assert digits.task == "classification"
    assert abs(float(digits.x.mean())) < 1e-4 and abs(float(digits.x.std()) - 1) < 1e-3


def test_synthetic_seeded_and_learnable():
    a, b = load_dataset(Config(dataset="synthetic")), load_dataset(Config(dataset="synthetic"))
    c = load_dataset(Config(dataset="synthetic", seed=1))
    assert a.x.shape == (2000, 32) and a.input_shape == (32,) and np.bincount(a.y).tolist() == [200] * 10
    assert np.array_equal(a.x, b.x) and not np.array_equal(a.x, c.x)
    from rayfl.models import build_model

    torch.manual_seed(0)
    x, y = torch.from_numpy(a.x), torch.from_numpy(a.y)
    model = build_model("mlp-small", a.input_shape, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # two epochs
        for i in range(0, 1500, 32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            opt.step()
    acc = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
    assert acc > 0.5  # chance is 0.1


def test_sine():
    ds = load_dataset(Config(dataset="sine"))
    assert ds.task == "regression" and ds.num_classes == 1 and ds.input_shape == (1,)
    assert ds.y.shape == (len(ds.x), 1) and ds.y.dtype == np.float32
    assert 0 <= ds.x.min() and ds.x.max() <= 2 * np.pi
    assert np.abs(ds.y - np.sin(ds.x)).std() < 0.2


@pytest.mark.skipif(not os.path.isdir(MNIST_T10K), reason="no local MNIST t10k files")
def test_mnist_from_raw_idx_offline():
    ds = load_dataset(Config(dataset="mnist", data_root=MNIST_T10K))
    assert ds.x.shape == (10000, 1, 28, 28) and ds.x.dtype == np.float32 and ds.num_classes == 10
    assert set(np.unique(ds.y)) == set(range(10))


def test_missing_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="cifar10.*--data-root.*--download"):
        load_dataset(Config(dataset="cifar10"))
    with pytest.raises(UserError, match="'mnist' needs its files"):
        load_dataset(Config(dataset="mnist", data_root=str(tmp_path)))


# ------------------------------------------------------------------------------------------------ partitions

@pytest.mark.parametrize("partition", PARTITIONS)
def test_disjoint_and_covering(digits, partition):
    f = fed(digits, partition=partition)
    assert isinstance(f, Federation) and len(f.clients) == 10
    parts = [held(c) for c in f.clients] + [f.holdout]
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything))  # no sample twice
    assert all(len(c.train) > 0 and len(c.test) > 0 for c in f.clients)
    if partition != "majority":  # majority may leave samples over to keep its fractions
        assert len(everything) == len(digits.y)
    grouped = partition in ("latent", "label-groups", "rotation", "permutation")
    assert all((c.group is not None) == grouped for c in f.clients)


def test_pathological_classes(digits):
    for k in (1, 2, 3):
        f = fed(digits, partition="pathological", classes_per_client=k)
        assert [int((label_counts(digits, c) > 0).sum()) for c in f.clients] == [k] * 10


def test_sizes_equal_and_lognormal(digits):
    equal = [c.num_samples for c in fed(digits, partition="iid").clients]
    assert max(equal) - min(equal) <= 1
    logn = [c.num_samples for c in fed(digits, partition="iid", sizes="lognormal").clients]
    assert max(logn) > 3 * min(logn) and min(logn) >= 10
    assert sum(logn) == sum(equal)


def test_samples_per_client_cap(digits):
    f = fed(digits, partition="pathological", samples_per_client=50)
    assert all(c.num_samples == 50 for c in f.clients)
    assert all((label_counts(digits, c) > 0).sum() == 2 for c in f.clients)


def test_dirichlet_determinism_and_alpha(digits):
    a, b = fed(digits, partition="dirichlet", alpha=0.1), fed(digits, partition="dirichlet", alpha=0.1)
    assert all(np.array_equal(x.train, y.train) for x, y in zip(a.clients, b.clients))

    def skew(f):  # mean largest-class share
        return np.mean([label_counts(digits, c).max() / c.num_samples for c in f.clients])

    assert skew(a) > skew(fed(digits, partition="dirichlet", alpha=100.0)) + 0.3
    assert min(c.num_samples for c in a.clients) >= 10


def test_latent_groups_differ(digits):
    f = fed(digits, partition="latent", groups=3, clients=6)
    assert [c.group for c in f.clients] == [0, 0, 1, 1, 2, 2]
    means = [np.mean([digits.x[held(c)].mean(0) for c in f.clients if c.group == g], 0) for g in range(3)]
    dists = [np.abs(means[i] - means[j]).mean() for i in range(3) for j in range(i + 1, 3)]
    within = np.abs(digits.x[held(f.clients[0])].mean(0) - digits.x[held(f.clients[1])].mean(0)).mean()
    assert min(dists) > 2 * within


def test_majority_fraction(digits):
    for p in (0.5, 0.8):
        for sizes in ("equal", "lognormal"):
            f = fed(digits, partition="majority", majority=p, sizes=sizes)
            for c in f.clients:
                counts = label_counts(digits, c)
                top2 = np.sort(counts)[-2:]  # two majority classes share p (Listo Zec et al., 2020, §4)
                assert abs(top2.sum() / counts.sum() - p) < 0.05
                assert abs(top2[0] - top2[1]) <= 1 + 0.02 * counts.sum()
                if sizes == "equal":
                    assert (counts > 0).all()


def test_label_groups_disjoint(digits):
    f = fed(digits, partition="label-groups", groups=3, clients=7)
    labels = {g: set() for g in range(3)}
    for c in f.clients:
        labels[c.group] |= set(np.unique(digits.y[held(c)]).tolist())
    assert not (labels[0] & labels[1] or labels[0] & labels[2] or labels[1] & labels[2])
    assert set().union(*labels.values()) == set(range(10))


def test_label_groups_assigned_at_random_or_in_blocks(digits):
    """FedeRiCo's paper assigns clients to groups at random (a group may hold one client); blocks stay an option."""
    sizes = set()
    for seed in range(8):
        f = fed(digits, partition="label-groups", groups=3, clients=9, seed=seed)
        g = [c.group for c in f.clients]
        assert set(g) == {0, 1, 2}  # never an empty group
        sizes.add(tuple(sorted(np.bincount(g))))
    assert len(sizes) > 1 and sizes != {(3, 3, 3)}  # random: unbalanced draws happen
    f = fed(digits, partition="label-groups", groups=3, clients=9, group_assign="blocks", seed=3)
    assert [c.group for c in f.clients] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    f = fed(digits, partition="rotation", groups=3, clients=9, seed=3)  # auto: blocks, as user-centric's S2
    assert [c.group for c in f.clients] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    f = fed(digits, partition="rotation", groups=3, clients=9, group_assign="random", seed=3)
    assert [c.group for c in f.clients] != [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_rotation_with_dirichlet_label_shift(digits):
    """User-centric S2: rotation groups with a Dirichlet(0.4) label distribution per user on top."""
    def top_share(f):
        return np.mean([label_counts(digits, c).max() / label_counts(digits, c).sum() for c in f.clients])

    plain = fed(digits, partition="rotation", groups=4, clients=8)
    shifted = fed(digits, partition="rotation", groups=4, clients=8, label_shift=0.4)
    assert top_share(plain) < 0.2 < 0.3 < top_share(shifted)  # iid ~ 0.1-0.15; Dir(0.4) much more skewed
    assert [c.group for c in shifted.clients] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c.transform.get("rotate", 0) for c in shifted.clients] == [0, 0, 1, 1, 2, 2, 3, 3]
    everyone = np.concatenate([held(c) for c in shifted.clients])
    assert len(np.unique(everyone)) == len(everyone)  # still disjoint


@pytest.mark.parametrize("kw, match", [
    (dict(partition="rotation", label_shift=-1.0), "label_shift=-1.0"),
    (dict(partition="rotation", label_shift=float("nan")), "label_shift=nan"),
    (dict(partition="iid", label_shift=0.4), "label_shift=0.4: applies to partition rotation or permutation"),
    (dict(partition="label-groups", group_assign="shuffled"), "group_assign='shuffled'"),
])
def test_partition_option_errors(kw, match):
    from rayfl.config import make_config

    with pytest.raises(UserError, match=match):
        make_config(None, kw).check()


def test_sine_latent_intervals():
    ds = load_dataset(Config(dataset="sine"))
    f = fed(ds, partition="latent", groups=5, clients=5)
    ranges = [(ds.x[held(c)].min(), ds.x[held(c)].max()) for c in f.clients]
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(4))  # client i's interval left of client i+1's
    assert len(f.holdout) == 0
    fed(ds, partition="iid")


# ------------------------------------------------------------------------------------------------ splits

def test_split_fractions_and_seeds(digits):
    f = fed(digits, partition="iid", val_frac=0.2, test_frac=0.3)
    for c in f.clients:
        n = c.num_samples
        assert abs(len(c.val) - 0.2 * n) <= 1 and abs(len(c.test) - 0.3 * n) <= 1
        assert len(set(c.train) | set(c.val) | set(c.test)) == n
    same = fed(digits, partition="iid", val_frac=0.2, test_frac=0.3)
    other = fed(digits, partition="iid", val_frac=0.2, test_frac=0.3, seed=1)
    assert all(np.array_equal(a.test, b.test) for a, b in zip(f.clients, same.clients))
    assert not all(np.array_equal(a.test, b.test) for a, b in zip(f.clients, other.clients))
    assert all(len(c.val) == 0 and len(c.train) > 0 for c in fed(digits, val_frac=0.0).clients)


def test_ood_swaps_pairs(digits):
    base = fed(digits, partition="latent", groups=5, clients=10)
    ood = fed(digits, partition="latent", groups=5, clients=10, ood=True)
    owners = {tuple(c.test): i for i, c in enumerate(base.clients)}
    seen = set()
    for i, (b, o) in enumerate(zip(base.clients, ood.clients)):
        assert np.array_equal(b.train, o.train)
        j = owners[tuple(o.test)]
        assert j != i and np.array_equal(o.val, base.clients[j].val)
        seen.add(j)
    assert seen == set(range(10))


def test_holdout_balanced(digits):
    f = fed(digits, partition="pathological")
    counts = np.bincount(digits.y[f.holdout], minlength=10)
    assert counts.min() == counts.max() > 0 and len(f.holdout) <= 0.1 * len(digits.y)
    assert np.array_equal(f.holdout, fed(digits, partition="iid").holdout)


# ------------------------------------------------------------------------------------------------ materialize

def test_materialize_rotation(digits):
    f = fed(digits, partition="rotation", groups=4)
    for c in f.clients:
        data = materialize(digits.x, digits.y, c)
        raw = torch.from_numpy(digits.x[c.train])
        assert torch.equal(data["train"][0], torch.rot90(raw, c.group, dims=(2, 3)))
        assert data["train"][0].dtype == torch.float32 and data["test"][1].dtype == torch.int64
    assert {c.group for c in f.clients} == {0, 1, 2, 3}


def test_materialize_permutation_and_ood_transform(digits):
    f = fed(digits, partition="permutation", groups=3, clients=6)
    perms = {c.group: c.transform.get("perm") for c in f.clients}
    assert perms[0] is None and perms[1] != perms[2] and sorted(perms[1]) == list(range(10))
    c = f.clients[-1]
    data = materialize(digits.x, digits.y, c)
    assert data["train"][1].tolist() == [perms[2][v] for v in digits.y[c.train]]
    ood = fed(digits, partition="rotation", groups=2, clients=4, ood=True)
    for c in ood.clients:  # val/test keep the rotation of the client they came from
        k = c.transform["eval"].get("rotate", 0)
        data = materialize(digits.x, digits.y, c)
        assert torch.equal(data["test"][0], torch.rot90(torch.from_numpy(digits.x[c.test]), k, dims=(2, 3)))


def test_materialize_regression():
    ds = load_dataset(Config(dataset="sine"))
    data = materialize(ds.x, ds.y, fed(ds, partition="iid").clients[0])
    assert data["train"][1].dtype == torch.float32 and data["train"][1].shape[1] == 1


# ------------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("kw, match", [
    (dict(partition="pathological", classes_per_client=11), "classes_per_client=11"),
    (dict(partition="label-groups", groups=11, clients=20), "groups=11"),
    (dict(partition="rotation", groups=5, clients=10), "groups=5"),
    (dict(partition="latent", groups=4, clients=3), "groups=4"),
    (dict(partition="iid", clients=5000), "clients=5000"),
    (dict(partition="iid", clients=900), "too few"),
    (dict(partition="iid", samples_per_client=2), "too few"),
    (dict(partition="iid", ood=True, clients=1), "ood"),
    (dict(partition="nope"), "partition='nope'"),
])
def test_user_errors(digits, kw, match):
    with pytest.raises(UserError, match=match):
        fed(digits, **kw)


def test_user_errors_by_dataset():
    sine = load_dataset(Config(dataset="sine"))
    for p in ("pathological", "dirichlet", "majority", "label-groups", "rotation", "permutation"):
        with pytest.raises(UserError, match="regression"):
            fed(sine, partition=p)
    with pytest.raises(UserError, match="needs images"):
        fed(load_dataset(Config(dataset="synthetic")), partition="rotation")
    tiny = Dataset("tiny", np.zeros((20, 4), np.float32), np.arange(20) % 2, "classification", 2, (4,))
    with pytest.raises(UserError, match="groups=3"):
        fed(tiny, partition="permutation", groups=3, clients=3)


def test_digits_are_scikit_learns_digits():
    """The embedded default is read from scikit-learn's file directly: the same images and labels as
    ``load_digits`` gives (before our standardization)."""
    from sklearn.datasets import load_digits

    from rayfl.data.datasets import _digits, _standardize

    d = load_digits()
    ours = _digits()
    expected = _standardize((d.images.astype(np.float32) / 16.0)[:, None, :, :])
    assert ours.x.shape == (1797, 1, 8, 8) and ours.input_shape == (1, 8, 8)
    np.testing.assert_array_equal(ours.y, d.target)
    np.testing.assert_allclose(ours.x, expected, rtol=0, atol=1e-6)
