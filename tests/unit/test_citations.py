"""Comments and docs cite what a reader can look up: a paper (author, year, section or equation) or the
authors' code, never a file that a clone of this repository does not hold (design notes or specifications
kept beside the checkout, their numbered "pitfalls"). Dataset paths in commands (``../shared/datasets/...``)
are data, not citations, and stay allowed."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Tables of results written by the comparison runs (their cells hold the data paths the runs were given), and
# this file, whose examples spell out what is refused.
EXEMPT = {"benchmarks/results_compare.md", "tests/unit/test_citations.py"}
FORBIDDEN = [  # (what it is, pattern); case-insensitive
    ("a numbered specification", re.compile(r"\bspecs?\s*(?:\d{3}\b|§|p\d|pit[f]all)", re.I)),
    ("a specification file", re.compile(r"\bspecs/\d{3}_", re.I)),
    ("a specification's pitfall", re.compile(r"\bpit[f]alls?\b", re.I)),
    ("the design notes", re.compile(r"\bdesign\.md\b", re.I)),
    ("a file beside the checkout", re.compile(r"(?:\.\./|/work/)shared/(?!datasets/)", re.I)),
]


def repository_files() -> list[str]:
    """Tracked files plus untracked ones git does not ignore (what the next commit may add), minus removed ones."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sorted({p for p in out.split("\0") if p and os.path.isfile(os.path.join(ROOT, p))})


def offences(text: str) -> list[tuple[int, str, str]]:
    """(line number, what is cited, the line) for each forbidden citation in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            if pattern.search(line):
                hits.append((number, what, line.strip()))
    return hits


def test_the_patterns_catch_what_they_are_for_and_spare_data_paths():
    caught = [
        "(spec 001 §8)", "Spec P7: the E-step", "spec §3.4, P5", "(spec pitfall §7.4)", "pitfall P1",
        "see specs/002_federico.md", "(DESIGN.md section 6)", "../shared/specs/000_fedfomo.md",
        "/work/shared/notes/ray-mlflow-verified.md",
    ]
    spared = [
        "--data-root ../shared/datasets/mnist-t10k", 'MNIST = "/work/shared/datasets/mnist-t10k"',
        "(Zhang et al., 2021, §3.1, Eq. 3)", "the authors' code", "spec = DatasetSource(name, load)",
        "for key, spec in data.items():", "/home/ubuntu/rayfl-shared/runs", "the column j of W, not the row",
    ]
    assert [line for line in caught if not offences(line)] == []
    assert [line for line in spared if offences(line)] == []


def test_no_file_cites_what_a_clone_does_not_hold():
    files = repository_files()
    assert "rayfl/metrics.py" in files and "tests/unit/test_citations.py" in files  # the listing reached the tree
    found = []
    for rel in files:
        if rel in EXEMPT:
            continue
        with open(os.path.join(ROOT, rel), "rb") as fh:
            raw = fh.read()
        if b"\0" in raw:
            continue  # binary
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # not text
        found += [f"{rel}:{n}: {what}: {line}" for n, what, line in offences(text)]
    assert found == [], "cite the paper (author, year, section / equation) instead:\n" + "\n".join(found)
