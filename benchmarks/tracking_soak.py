"""Fault soak, tracking outage: runs whose MLflow tracking server is killed (SIGKILL of its process group) after
a random round must finish with the uninterrupted twin's metrics, and every record must reach the server.

A private ``mlflow server`` on 127.0.0.1 (a free port, its own store and artifact root) and a private local Ray
instance. One uninterrupted twin, then ``--outages`` runs whose server is killed after a random round and
restarted on the same port and store a random 5 to ``--outage`` seconds later (the run's end waits for it), then
``--gone`` runs whose server stays away past ``tracking_wait`` (a few seconds): their records stay in the run
directory, the server is started again and ``rayfl.sync`` delivers them, and a second sync must send nothing.

Each run's MLflow run must then hold what the twin's holds: the same metric keys (timings aside) at the same
steps, each (key, step) once and with the twin's values, the same artifact paths, FINISHED; and the longest gap
between two rounds reported during an outage is printed (no round waits for the server).

    .venv/bin/python benchmarks/tracking_soak.py                       # 4 outages, 2 servers gone for good
    .venv/bin/python benchmarks/tracking_soak.py --outages 1 --gone 1 --rounds 8
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rayfl.config import make_config  # noqa: E402
from rayfl.experiment import prepare  # noqa: E402

TIMINGS = ("seconds", "tracking_cpu_seconds")  # metric keys whose values differ between any two runs


class Server:
    def __init__(self, root: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.root, self.proc = root, None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        t0 = time.monotonic()
        mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
        log = open(os.path.join(self.root, "server.log"), "ab")
        self.proc = subprocess.Popen([mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers",
                                      "1", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
                                      "--artifacts-destination", f"{self.root}/artifacts"],
                                     stdout=log, stderr=log, start_new_session=True)
        while True:
            try:
                if urllib.request.urlopen(f"{self.uri}/health", timeout=1).read() == b"OK":
                    return time.monotonic() - t0
            except OSError:
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def held(client, run_id: str) -> tuple[dict, set]:
    """What an MLflow run holds: {(key, step): [values]} (timings aside) and its artifact paths."""
    metrics = {}
    for key in client.get_run(run_id).data.metrics:
        if not key.endswith(TIMINGS):
            for m in client.get_metric_history(run_id, key):
                metrics.setdefault((key, m.step), []).append(m.value)
    paths, todo = set(), [None]
    while todo:
        for f in client.list_artifacts(run_id, todo.pop()):
            (todo.append(f.path) if f.is_dir else paths.add(f.path))
    return metrics, paths


def compare(client, twin_id: str, run_id: str) -> list[str]:
    """How the run's records differ from the twin's (empty: not at all)."""
    (tm, tp), (rm, rp) = held(client, twin_id), held(client, run_id)
    problems = [f"{k} logged {len(v)} times" for k, v in rm.items() if len(v) > 1]
    problems += [f"{k} missing" for k in tm.keys() - rm.keys()] + [f"{k} extra" for k in rm.keys() - tm.keys()]
    problems += [f"{k}: {rm[k]} != {tm[k]}" for k in tm.keys() & rm.keys() if rm[k][:1] != tm[k][:1]
                 and not (rm[k][0] != rm[k][0] and tm[k][0] != tm[k][0])]
    problems += [f"artifact {p} missing" for p in tp - rp] + [f"artifact {p} extra" for p in rp - tp]
    status = client.get_run(run_id).info.status
    return problems + ([f"status {status}"] if status != "FINISHED" else [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outages", type=int, default=4)
    ap.add_argument("--gone", type=int, default=2)
    ap.add_argument("--outage", type=float, default=20.0, help="longest outage, seconds (shortest: 5)")
    ap.add_argument("--algo", default="fedavg")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="of the soak's random choices")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import ray
    from mlflow.tracking import MlflowClient

    import rayfl
    from rayfl.actors.launch import launch

    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="rayfl-tracking-soak-")
    server = Server(work)
    print(f"mlflow server up in {server.start():.1f} s at {server.uri}; work in {work}", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    client = MlflowClient(server.uri)
    exp = client.create_experiment("tracking-soak")
    values = {"algo": args.algo, "dataset": "synthetic", "partition": "iid", "clients": args.clients,
              "rounds": args.rounds, "samples_per_client": 60, "lr": 0.1, "batch_size": 16, "clients_per_actor": 2}

    def run(name: str, wait: float, kill_after: int | None, back_after: float | None) -> dict:
        cfg = make_config(None, {**values, "tracking_wait": wait})
        times, back = {}, threading.Event()

        def on_round(rec: dict) -> None:
            times[rec["step"]] = time.monotonic()
            if kill_after is not None and rec["step"] + 1 == kill_after:
                server.stop()
                times["down"] = time.monotonic()
                if back_after is not None:
                    threading.Timer(back_after, lambda: (server.start(), times.__setitem__("up", time.monotonic()),
                                                         back.set())).start()

        run_dir = os.path.join(work, name)
        t0 = time.monotonic()
        out = launch(prepare(cfg), {"tracking_uri": server.uri, "experiment_id": exp, "run_name": name},
                     checkpoint_dir=run_dir, on_round=on_round)
        if back_after is not None:
            back.wait()  # its restart (the run's end waited for it)
        steps = sorted(k for k in times if isinstance(k, int))
        during = [times[b] - times[a] for a, b in zip(steps, steps[1:]) if kill_after and a + 1 >= kill_after]
        return {**out, "run_dir": run_dir, "seconds": time.monotonic() - t0, "times": times,
                "max_gap": max(during, default=0.0), "end_wait": time.monotonic() - times[steps[-1]]}

    failures, lines = 0, []
    try:
        twin = run("twin", 300, None, None)
        print(f"twin: {twin['seconds']:.1f} s, final {twin['final'].get('test_acc_mean', float('nan')):.4f}", flush=True)
        for i in range(args.outages):
            after, away = rng.randint(1, args.rounds - 1), rng.uniform(5, args.outage)
            out = run(f"outage-{i}", 300, after, away)
            problems = compare(client, twin["run_id"], out["run_id"]) + (
                ["the run kept records unsent"] if out["tracking_unsent"] else [])
            failures += bool(problems)
            lines.append(f"outage {i}: server killed after round {after}, back {away:.1f} s later (restart "
                         f"included: {out['times']['up'] - out['times']['down']:.1f} s); longest round gap during it "
                         f"{out['max_gap']:.2f} s; end waited {out['end_wait']:.1f} s; "
                         + ("every record delivered, as the twin's" if not problems else "; ".join(problems[:5])))
            print(lines[-1], flush=True)
        for i in range(args.gone):
            after = rng.randint(1, args.rounds - 1)
            out = run(f"gone-{i}", 3, after, None)
            left = bool(out["tracking_unsent"])
            server.start()
            sent = rayfl.sync(out["run_dir"])
            again = rayfl.sync(out["run_dir"])
            problems = compare(client, twin["run_id"], out["run_id"]) + (
                [] if left else ["no records kept"]) + ([f"second sync sent {again}"] if any(again.values()) else [])
            failures += bool(problems)
            lines.append(f"gone {i}: server killed after round {after} for good; end waited {out['end_wait']:.1f} s "
                         f"(tracking_wait=3); sync sent {sent['metrics']} points, {sent['files']} artifact trees, "
                         f"{sent['tags']} tags, status {sent['status']}; second sync sent nothing: "
                         f"{not any(again.values())}; "
                         + ("every record delivered, as the twin's" if not problems else "; ".join(problems[:5])))
            print(lines[-1], flush=True)
    finally:
        server.stop()
        ray.shutdown()
    total = args.outages + args.gone
    print(f"\n{total - failures} of {total} runs equal to their twin with every record delivered")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
