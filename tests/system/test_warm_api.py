"""The Python API keeps the private Ray instance it started, and the last run's actors, for the next call in the
same process (a notebook): a second run of the same shape reuses them and computes what a fresh start does;
``rayfl.shutdown()`` ends them, and so does the interpreter's exit, leaving no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SCRIPT = r"""
import json, sys
import psutil, ray
import rayfl

d = sys.argv[1]
TINY = dict(algo="fedfomo", params={"M": 2}, dataset="synthetic", partition="iid", clients=3, rounds=2,
            samples_per_client=60, lr=0.1, batch_size=16, tracking_uri=f"sqlite:///{d}/m.db", out_dir=f"{d}/runs")
out = {"pids": []}

def on(event):
    if event["event"] == "start":
        out["pids"].append(sorted(a["pid"] for a in event["placement"]) + [event["driver_pid"]])

def results(r):
    table = r.history.drop(columns=[c for c in r.history.columns if c.endswith("seconds")])
    return {"history": table.astype(str).to_dict("list"), "final": {k: str(v) for k, v in r.final.items()
                                                                    if not k.endswith("seconds")}}

first = rayfl.run(**TINY, progress=on)
out["up_after_first"] = ray.is_initialized()
second = rayfl.run(**TINY, progress=on)
rayfl.shutdown()
out["up_after_shutdown"] = ray.is_initialized()
out["after_shutdown"] = [p.pid for p in psutil.Process().children(recursive=True)]
third = rayfl.run(**TINY, progress=on)  # a fresh instance and fresh actors
out["results"] = [results(first), results(second), results(third)]
out["up_after_third"] = ray.is_initialized()
out["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(out))
"""


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_api_keeps_ray_and_actors_between_runs_and_ends_them(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second, third = out["pids"]
    assert out["up_after_first"] and second == first  # Ray kept, the client actors and the driver reused
    assert not out["up_after_shutdown"] and not any(alive(p) for p in first)
    assert not set(third) & set(first)  # started again after shutdown()
    fresh, reused, fresh_again = out["results"]
    assert reused == fresh and fresh_again == fresh  # fresh, reused and fresh again: the same run
    assert fresh["final"]["round"] == fresh["history"]["round"][-1]  # (the whole run compared)
    assert out["up_after_third"] and out["children"]
    deadline = time.monotonic() + 30  # the interpreter's exit ended the instance: Ray's processes, the actors
    while any(alive(p) for p in [*out["children"], *third]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in [*out["children"], *third, *out["after_shutdown"]] if alive(p)]
    assert os.listdir(tmp_path / "runs")
