"""What federation a run built: per client its split sizes and its training labels per class.

A researcher reads it three ways: one console line (clients; training samples min / median / max; classes
per client min / median / max), a warning when some clients' validation or test splits are too small to be
read (a client's accuracy on n samples moves in steps of 1/n, and whatever is chosen on validation rests on
those n), and the table and figure logged with the run (``results/partition.csv``, ``plots/partition.png``).
Built in the process that holds the data (a Ray driver gets the federation without the arrays), so it
travels to the tracker as plain data (:meth:`PartitionReport.to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayfl.metrics import MIN_EVAL_SAMPLES  # noqa: F401 - below this a split is too small to be read


@dataclass
class PartitionReport:
    """Split sizes per client and, for classification, the training labels per class (clients x classes)."""

    n_train: np.ndarray
    n_val: np.ndarray
    n_test: np.ndarray
    counts: np.ndarray | None = None  # clients x classes, the labels a client trains on; None for regression
    groups: list | None = None  # the partition's group of each client, where it has them

    @classmethod
    def of(cls, prepared) -> "PartitionReport":
        """The report of a prepared experiment (its dataset's labels must be at hand)."""
        ds, clients = prepared.dataset, prepared.federation.clients
        sizes = {s: np.array([len(getattr(c, s)) for c in clients], dtype=np.int64) for s in ("train", "val", "test")}
        counts = None
        if ds.task == "classification" and ds.y is not None:
            counts = np.zeros((len(clients), int(ds.num_classes)), dtype=np.int64)
            for i, c in enumerate(clients):
                y = np.asarray(ds.y[c.train], dtype=np.int64)
                if c.transform.get("perm") is not None:  # permutation groups train on relabelled samples
                    y = np.asarray(c.transform["perm"], dtype=np.int64)[y]
                counts[i] = np.bincount(y, minlength=counts.shape[1])
        groups = [c.group for c in clients]
        return cls(sizes["train"], sizes["val"], sizes["test"], counts,
                   groups if any(g is not None for g in groups) else None)

    @property
    def clients(self) -> int:
        return len(self.n_train)

    def classes_per_client(self) -> np.ndarray | None:
        return None if self.counts is None else (self.counts > 0).sum(axis=1)

    def line(self) -> str:
        """One line: clients; training samples min / median / max; classes per client min / median / max."""
        parts = [f"{self.clients} clients", f"training samples {_spread(self.n_train)}"]
        classes = self.classes_per_client()
        if classes is not None:
            parts.append(f"classes per client {_spread(classes)} (of {self.counts.shape[1]})")
        return "; ".join(parts)

    def small(self, threshold: int = MIN_EVAL_SAMPLES) -> np.ndarray:
        """Clients with fewer than ``threshold`` validation or test samples (a split of size 0 everywhere is
        one the config turned off, not a small one)."""
        mask = np.zeros(self.clients, dtype=bool)
        for n in (self.n_val, self.n_test):
            if n.any():
                mask |= n < threshold
        return mask

    def warning(self, threshold: int = MIN_EVAL_SAMPLES) -> str | None:
        """What small validation and test splits do to the results, or None when no client has one."""
        small = self.small(threshold)
        if not small.any():
            return None
        fewest = ", ".join(f"{int(n[small].min())} {name}" for name, n in (("validation", self.n_val),
                                                                            ("test", self.n_test)) if n.any())
        text = (f"{int(small.sum())} of {self.clients} clients have fewer than {threshold} validation or test "
                f"samples (fewest: {fewest}): their accuracy moves in steps of 1/n")
        if self.n_val.any():
            text += (", and what is chosen on validation (FedFomo's model weights, PersFL's teachers and "
                     "per-client λ and T, a sweep's best trial) rests on those few samples")
        return text

    def table(self):
        """A row per client: its group, split sizes, classes held and training labels per class."""
        import pandas as pd

        df = pd.DataFrame({"client": np.arange(self.clients)})
        if self.groups is not None:
            df["group"] = self.groups
        df["n_train"], df["n_val"], df["n_test"] = self.n_train, self.n_val, self.n_test
        if self.counts is not None:
            df["classes"] = self.classes_per_client()
            for k in range(self.counts.shape[1]):
                df[f"class_{k}"] = self.counts[:, k]
        return df

    def to_dict(self) -> dict:
        """Plain lists: what a Ray driver gets (its copy of the dataset has no labels)."""
        return {"n_train": self.n_train.tolist(), "n_val": self.n_val.tolist(), "n_test": self.n_test.tolist(),
                "counts": None if self.counts is None else self.counts.tolist(), "groups": self.groups}

    @classmethod
    def from_dict(cls, d: dict) -> "PartitionReport":
        counts = None if d.get("counts") is None else np.asarray(d["counts"], dtype=np.int64)
        return cls(*(np.asarray(d[k], dtype=np.int64) for k in ("n_train", "n_val", "n_test")), counts,
                   d.get("groups"))


def _spread(values: np.ndarray) -> str:
    return f"min {int(values.min())} / median {float(np.median(values)):g} / max {int(values.max())}"
