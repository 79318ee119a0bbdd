"""FedeRiCo on the sine toy: is there a band of collaboration between neighbouring intervals?

Reads the final collaborator weights W (``algorithm/W.npy``) of every FedeRiCo child run of one
``rayfl compare --preset federico-sine`` parent run and prints, per interval gap d = |g_i - g_k|, the mean
co-usage (W Wᵀ)_ik (how much clients i and k use the same models, whoever owns them) and the mean
owner-aligned weight w_ik (how much i uses the model owned by k). A band (Fig. 1 of the paper) shows as
values falling with d; a uniform W gives 1/K everywhere.

    .venv/bin/python benchmarks/sine_band.py PARENT_RUN_ID --tracking-uri sqlite:///mlflow.db
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np


def gap_profile(W: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(co-usage, owner weight) means per gap d = 0 .. max |g_i - g_k| (nan where no pair has that gap)."""
    gap = np.abs(groups[:, None] - groups[None, :])
    C = W @ W.T
    d = np.arange(gap.max() + 1)
    co = np.array([C[gap == k].mean() if (gap == k).any() else np.nan for k in d])
    own = np.array([W[gap == k].mean() if (gap == k).any() else np.nan for k in d])
    return co, own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parent", help="the compare parent run id")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    args = ap.parse_args(argv)
    from mlflow import MlflowClient

    client = MlflowClient(args.tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        import pandas as pd

        runs = pd.read_csv(client.download_artifacts(args.parent, "compare/runs.csv", tmp))
        profiles = []
        for _, r in runs[runs["algo"] == "federico"].iterrows():
            W = np.load(client.download_artifacts(r["run_id"], "algorithm/W.npy", tmp))
            # the sine preset: latent groups = clients, client i on the i-th interval from the left
            co, own = gap_profile(W, np.arange(len(W)))
            profiles.append((co, own))
            print(f"seed {r['seed']}: co-usage by gap", np.round(co, 4), " owner weight by gap", np.round(own, 4))
    co = np.array([p[0] for p in profiles])
    own = np.array([p[1] for p in profiles])
    print("mean over seeds, co-usage  :", " ".join(f"d={d}: {m:.4f} ± {s:.4f}" for d, (m, s) in
                                            enumerate(zip(co.mean(0), co.std(0, ddof=1) if len(co) > 1 else 0 * co[0]))))
    print("mean over seeds, owner w_ik:", " ".join(f"d={d}: {m:.4f} ± {s:.4f}" for d, (m, s) in
                                            enumerate(zip(own.mean(0), own.std(0, ddof=1) if len(own) > 1 else 0 * own[0]))))
    print(f"uniform W: {1 / co.shape[1]:.4f} everywhere")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
