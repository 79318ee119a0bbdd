"""The partition report: its numbers on a hand-built federation, the warning's threshold, the table and the
figure logged with a run, and the report of a real prepared experiment."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rayfl.data.federation import ClientData
from rayfl.data.report import MIN_EVAL_SAMPLES, PartitionReport

# labels 0..3; client 0: six training samples of classes 0 and 1, 2 validation, 2 test; client 1: ten of class
# 2, 10 and 10; client 2: four of each class, 9 validation, 12 test
Y = np.array([0, 0, 0, 1, 1, 1] + [2] * 10 + [0, 1, 2, 3] * 4 + [3] * 60)


def client(train, n_val, n_test, start, group=None, transform=None):
    val = np.arange(start, start + n_val)
    return ClientData(np.asarray(train), val, np.arange(start + n_val, start + n_val + n_test), group,
                      transform or {})


def prepared(clients, task="classification", y=Y):
    return SimpleNamespace(dataset=SimpleNamespace(task=task, y=y, num_classes=4),
                           federation=SimpleNamespace(clients=clients))


HAND = [client(range(0, 6), 2, 2, 32), client(range(6, 16), 10, 10, 36), client(range(16, 32), 9, 12, 56)]


def test_numbers_of_a_hand_built_partition():
    r = PartitionReport.of(prepared(HAND))
    assert r.n_train.tolist() == [6, 10, 16] and r.n_val.tolist() == [2, 10, 9] and r.n_test.tolist() == [2, 10, 12]
    assert r.counts.tolist() == [[3, 3, 0, 0], [0, 0, 10, 0], [4, 4, 4, 4]]
    assert r.classes_per_client().tolist() == [2, 1, 4]
    assert r.line() == ("3 clients; training samples min 6 / median 10 / max 16; "
                        "classes per client min 1 / median 2 / max 4 (of 4)")
    table = r.table()
    assert list(table.columns) == ["client", "n_train", "n_val", "n_test", "classes",
                                   "class_0", "class_1", "class_2", "class_3"]  # no group column: no groups
    assert table["class_2"].tolist() == [0, 10, 4]
    back = PartitionReport.from_dict(r.to_dict())  # what a Ray driver gets
    assert back.line() == r.line() and np.array_equal(back.counts, r.counts)


def test_warning_counts_clients_below_the_threshold_of_validation_or_test_samples():
    r = PartitionReport.of(prepared(HAND))
    assert MIN_EVAL_SAMPLES == 10
    assert r.small().tolist() == [True, False, True]  # 10 and 10 is enough; 9 validation samples is not
    text = r.warning()
    assert text.startswith("2 of 3 clients have fewer than 10 validation or test samples (fewest: 2 validation, "
                           "2 test): their accuracy moves in steps of 1/n")
    assert "chosen on validation" in text and "FedFomo's model weights" in text
    assert r.warning(threshold=2) is None and r.small(threshold=3).tolist() == [True, False, False]
    # no validation split at all (val_frac=0) is not a small one, and then nothing is chosen on it
    no_val = PartitionReport.of(prepared([client(range(0, 6), 0, 12, 32), client(range(6, 16), 0, 3, 44)]))
    assert no_val.small().tolist() == [False, True]
    assert "chosen on validation" not in no_val.warning() and "fewest: 3 test" in no_val.warning()


def test_groups_permuted_labels_and_regression():
    perm = {"perm": [1, 0, 3, 2]}  # a permutation group trains on relabelled samples
    r = PartitionReport.of(prepared([client(range(0, 6), 10, 10, 32, group=0),
                                     client(range(0, 6), 10, 10, 32, group=1, transform=perm)]))
    assert r.counts.tolist() == [[3, 3, 0, 0], [3, 3, 0, 0]]  # classes 0 and 1 swapped into each other
    assert list(r.table().columns[:2]) == ["client", "group"] and r.table()["group"].tolist() == [0, 1]
    r = PartitionReport.of(prepared(HAND, task="regression"))
    assert r.counts is None and r.line() == "3 clients; training samples min 6 / median 10 / max 16"
    assert "class_0" not in r.table()
    assert PartitionReport.of(prepared(HAND, y=None)).counts is None  # a Ray driver's dataset: sizes only


def test_partition_figure_is_a_stacked_bar_per_client_with_the_legend_outside():
    from rayfl import plots

    counts = PartitionReport.of(prepared(HAND)).counts
    fig = plots.partition_plot(counts, "digits, dirichlet")
    ax = fig.axes[0]
    heights = np.zeros(3)
    for bars in ax.containers:
        heights += [b.get_height() for b in bars]
    assert heights.tolist() == [6, 10, 16]  # one bar per client, its classes stacked
    assert len(ax.containers) == 4 and ax.get_legend().get_title().get_text() == "label"
    fig.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # beside the bars, not on them


def test_report_of_a_prepared_experiment():
    from conftest import tiny

    from rayfl.experiment import prepare

    p = prepare(tiny(clients=4, samples_per_client=20, partition="pathological", classes_per_client=2))
    r = PartitionReport.of(p)
    assert r.n_train.tolist() == [len(c.train) for c in p.federation.clients]
    assert (r.counts.sum(axis=1) == r.n_train).all() and (r.classes_per_client() <= 2).all()
    assert r.small().all() and r.warning().startswith("4 of 4 clients")  # 4 validation, 4 test samples each


@pytest.mark.parametrize("values, text", [([3], "min 3 / median 3 / max 3"),
                                         ([1, 2, 3, 10], "min 1 / median 2.5 / max 10")])
def test_spread(values, text):
    r = PartitionReport(np.array(values), np.zeros(len(values), int), np.zeros(len(values), int))
    assert f"training samples {text}" in r.line()
