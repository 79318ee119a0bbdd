"""What differential privacy costs: DP-SGD's FedAvg round against the plain round in rayfl, and rayfl's private
training of one client against Opacus alone on the same model, batches and steps.

Workloads are bench_peers.py's (benchmarks/peers/workload.py): random 28x28 inputs, batch 32, SGD lr 0.05, one
local epoch, every client every round; ``cnn10`` is LeNet-5 (61,706 parameters) and ``mlp10`` the 784-200-10 MLP
(159,010), 10 clients x 1000 samples each.

1. Rounds: the same FedAvg run through rayfl's public path, plain and with ``dp_noise`` > 0 (sample-level DP-SGD:
   Poisson batches, per-sample norms from each layer's input and output gradient (``rayfl.clipping``), clipping,
   noise, the accountant), on Ray with the
   default placement (``--runtime local``: in this process). Steady seconds per round: the median of rounds
   2..end, then the median over repetitions; MLflow off unless ``--mlflow`` (its cost is not DP's).
2. One client's local epoch on client 0's training split: rayfl's plain training (``training.train_epochs``,
   FlatSGD), rayfl's private path (``privacy.train_epochs``), the same with the per-sample gradients materialized
   (``torch.func``, ``noisy_gradient(materialize=True)``), and Opacus 1.6 alone (``PrivacyEngine.make_private``
   on the unflattened model with torch's SGD and DPOptimizer), once with its hook-based per-sample gradients and
   once with its fast gradient clipping (``grad_sample_mode="ghost"``: ghost norms and a second backward pass),
   fed the very Poisson batches rayfl draws (a batch sampler over the same indices), the same σ, C and number of
   steps. Median seconds per epoch over ``--epochs`` epochs, interleaved, after one warm-up epoch each.

    .venv/bin/python benchmarks/bench_dp.py                                   # both workloads, 3 repetitions
    .venv/bin/python benchmarks/bench_dp.py --workloads mlp10 --rounds 2 --reps 1 --samples 50 --runtime local

Torch threads are rayfl's default (1 per client actor) everywhere, so the one-client numbers compare engines,
not thread counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from workload import WORKLOADS, config_values, steady, write_idx  # noqa: E402


def prepared_for(workload: str, data_root: str, rounds: int, samples: int | None, dp: dict):
    from rayfl.config import make_config
    from rayfl.experiment import prepare

    values = {**config_values(workload, data_root, rounds, "sqlite:///:memory:"), **dp}
    if samples:
        values["samples_per_client"] = samples
    return prepare(make_config(None, values))


def round_seconds(workload, data_root, args, dp: dict) -> float:
    """Steady seconds per round of the FedAvg run (median over repetitions)."""
    from runs import run_experiment

    times = []
    for _ in range(args.reps):
        prepared = prepared_for(workload, data_root, args.rounds, args.samples, dp)
        with tempfile.TemporaryDirectory() as tmp:
            tracking = ({"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-dp", "run_name": workload}
                        if args.mlflow else None)
            out, stamps = run_experiment(prepared, args.runtime, tracking)
        times.append(steady(stamps))
        eps = out["final"].get("dp_epsilon_max")
        print(f"  {workload} {'DP' if dp else 'plain'}: {times[-1]:.4f} s/round, test acc "
              f"{out['final'].get('test_acc_mean', float('nan')):.3f}" + (f", epsilon {eps:.3g}" if eps else ""),
              flush=True)
    return statistics.median(times)


def epoch_seconds(workload, data_root, args) -> dict[str, float]:
    """Seconds per local epoch of client 0: rayfl plain, rayfl DP-SGD, Opacus alone on the same batches."""
    import torch
    from torch import nn

    from rayfl import privacy, training
    from rayfl.data import materialize
    from rayfl.privacy import Account, DPSettings

    torch.set_num_threads(1)
    p = prepared_for(workload, data_root, 1, args.samples, {})
    x, y = materialize(p.dataset.x, p.dataset.y, p.federation.clients[0])["train"]  # as a client holds it
    n, batch = x.shape[0], p.cfg.batch_size
    loss_fn = nn.functional.cross_entropy
    dp = DPSettings(args.sigma, args.clip, 1e-5)
    rate, steps = privacy.batch_plan(n, batch)

    def flat_model():
        return training.load_vector(training.flatten(p.model_spec.build()), p.initial)

    def plain(gen):
        model = flat_model()
        training.train_epochs(model, x, y, 1, batch, training.FlatSGD(model, p.cfg.lr), loss_fn, gen)

    def private(gen, materialize=False):
        model = flat_model()
        client = type("Client", (), {"state": {}})()
        noisy = privacy.noisy_gradient
        if materialize:  # the per-sample gradients themselves (torch.func), as before the norms' rules
            privacy.noisy_gradient = lambda *a, **k: noisy(*a, **k, materialize=True)
        try:
            privacy.train_epochs(model, x, y, 1, batch, training.FlatSGD(model, p.cfg.lr), loss_fn, gen,
                                 Account(dp, client))
        finally:
            privacy.noisy_gradient = noisy

    def materialized(gen):
        private(gen, materialize=True)

    def opacus(gen, mode="hooks"):
        import warnings

        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        # the Poisson batches rayfl's private path draws from this generator (the noise draws aside)
        batches = [privacy.poisson_batch(n, rate, gen, "cpu").tolist() for _ in range(steps)]
        loader = DataLoader(TensorDataset(x, y), batch_sampler=batches,
                            collate_fn=lambda items: (torch.stack([a for a, _ in items]) if items else x[:0],
                                                      torch.stack([b for _, b in items]) if items else y[:0]))
        model = training.load_vector(p.model_spec.build(), p.initial)
        with warnings.catch_warnings():  # Opacus's notices about secure RNG and backward hooks
            warnings.simplefilter("ignore")
            made = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=p.cfg.lr), data_loader=loader,
                noise_multiplier=args.sigma, max_grad_norm=args.clip, poisson_sampling=False, grad_sample_mode=mode,
                criterion=nn.CrossEntropyLoss())
            if mode == "ghost":  # fast gradient clipping: its criterion runs the two backward passes
                model, opt, criterion, loader = made
            else:
                (model, opt, loader), criterion = made, nn.CrossEntropyLoss()
            model.train()
            for xb, yb in loader:
                opt.zero_grad()
                criterion(model(xb), yb).backward()
                opt.step()

    def opacus_ghost(gen):
        opacus(gen, "ghost")

    out = {}
    engines = (("plain", plain), ("rayfl_dp", private), ("rayfl_materialized", materialized),
               ("opacus", opacus), ("opacus_ghost", opacus_ghost))
    times = {name: [] for name, _ in engines}
    for _, fn in engines:
        fn(torch.Generator().manual_seed(0))  # warm-up: lazy imports and first-use work
    for e in range(args.epochs):  # interleaved: a busy machine's slow spell falls on every engine alike
        for name, fn in engines:
            t0 = time.perf_counter()
            fn(torch.Generator().manual_seed(e + 1))
            times[name].append(time.perf_counter() - t0)
    for name, _ in engines:
        out[name] = statistics.median(times[name])
        print(f"  {workload} one client, {name}: {out[name]:.4f} s/epoch ({steps} steps)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="cnn10,mlp10")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per run (at least 3: the first is not timed)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=5, help="timed epochs of the one-client comparison")
    ap.add_argument("--samples", type=int, default=0, help="samples per client (0: the workload's)")
    ap.add_argument("--runtime", choices=("ray", "local"), default="ray")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mlflow", action="store_true", help="track the rounds in MLflow (off: DP's cost alone)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as data_root:
        for workload in args.workloads.split(","):
            _, clients, samples = WORKLOADS[workload]
            write_idx(data_root, clients * (args.samples or samples))
            plain = round_seconds(workload, data_root, args, {})
            private = round_seconds(workload, data_root, args, {"dp_noise": args.sigma, "dp_clip": args.clip})
            epoch = epoch_seconds(workload, data_root, args)
            rows.append((workload, plain, private, epoch))
    print(f"\nsigma={args.sigma}, C={args.clip}, runtime {args.runtime}, {args.rounds} rounds x {args.reps} reps")
    print("| workload | plain round (s) | DP round (s) | DP / plain | one client: plain epoch (s) | rayfl DP epoch (s) "
          "| rayfl materialized (s) | Opacus hooks (s) | Opacus ghost (s) | DP / plain epoch | rayfl DP / Opacus ghost |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, plain, private, e in rows:
        print(f"| {workload} | {plain:.4f} | {private:.4f} | {private / plain:.2f} | {e['plain']:.4f} | "
              f"{e['rayfl_dp']:.4f} | {e['rayfl_materialized']:.4f} | {e['opacus']:.4f} | {e['opacus_ghost']:.4f} | "
              f"{e['rayfl_dp'] / e['plain']:.2f} | {e['rayfl_dp'] / e['opacus_ghost']:.2f} |")


if __name__ == "__main__":
    main()
