"""A worker node lost mid-run does not hang the run: on a real multi-node Ray cluster on this machine, the
node of client actors (not the driver's) is removed after a round, and the run ends with the final
metrics of the uninterrupted run; with no room left for the lost actors it ends in one line naming the
node, leaving a checkpoint that --resume finishes to the same result.

One cluster for every case (tests/multinode_cluster.py): a head with no CPUs and four workers of one CPU;
client actors ask for 0.9 CPU, so each worker holds one and a lost actor needs a whole free worker. Six
clients (three actors) leave a spare worker; eight (four actors) fill the cluster. Each case runs the real
`rayfl run --address` in a process of its own, reads its round lines as they come, and removes a node
through the cluster's helper after round LOSE_AFTER. The uninterrupted result each case must equal is
computed in this process with every client in a LocalRuntime (the Ray runtime's results equal it:
tests/integration/test_ray_run.py), from the same config.

A sweep on the same cluster: the node of a trial's process is lost, and Tune's retry goes on from the trial's
own checkpoint to the uninterrupted result.

Beside them, without the cluster: the checkpoint the loop leaves from its newest snapshot when no room comes
(in one process), and a call that reaches a client actor Ray restarted (on the local test instance).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayfl.experiment import prepare
from rayfl.loop import Loop, NoCapacity
from rayfl.runtime import ClientsLost, LocalRuntime

from conftest import same, tiny
from multinode_cluster import LocalCluster, isolated_env, kill_leftovers, private_root, remove_root

WORKERS = 4
ROUNDS = 12
LOSE_AFTER = 1  # the node goes once round 1 is shown (rounds take a fraction of a second: the loss lands a few later)
RUN_TIMEOUT = 150  # one run: about 20-30 s on two idle cores; the margin is for a shared machine
BASE = {"dataset": "synthetic", "partition": "iid", "rounds": ROUNDS, "samples_per_client": 60, "lr": 0.1,
        "batch_size": 16, "local_epochs": 5, "clients_per_actor": 2, "cpus_per_actor": 0.9}
CASES = {  # algorithm -> (config, where the lost actor goes)
    "fedavg": ({"algo": "fedavg", "clients": 6, "participation": 0.67}, "spare"),
    "fedfomo": ({"algo": "fedfomo", "clients": 6, "participation": 0.67, "params": {"M": 2}}, "spare"),
    # capacity_wait set: the user asks to wait for room (else the clients would move to the surviving actors)
    "persfl": ({"algo": "persfl", "clients": 8, "params": {"lam_grid": [0.0, 0.5], "T_grid": [1.0]},
                "capacity_wait": 120}, "added"),
}


@pytest.fixture(scope="module")
def cluster():
    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux (/proc) for the process bookkeeping")
    root = private_root("rfl-nl-")
    env = isolated_env(root, RAY_AUTH_MODE="disabled")
    helper = None
    try:
        helper = LocalCluster(root, env, head=dict(num_cpus=0), workers=[dict(num_cpus=1)] * WORKERS)
        helper.actors()  # the helper connects to its cluster now, not while a run waits on it
        yield {"helper": helper, "root": root, "env": env, "uri": f"sqlite:///{root}/mlflow.db"}
    finally:
        left = helper.close() if helper is not None else kill_leftovers(root)[1]
        remove_root(root)
        assert not left, f"processes survived teardown: {left}"


def flags(values: dict) -> list[str]:
    out = []
    for k, v in values.items():
        if k == "params":
            for name, value in v.items():
                out += ["-p", f"{name}={json.dumps(value)}"]
        else:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def rayfl(cluster, args: list[str], on_round=None, command: str = "run",
          round_line: str = r"round\s+(\d+)/") -> tuple[int, str, str]:
    """`rayfl COMMAND --address <the cluster> ARGS` to its end; ``on_round(k)`` at each line matching
    ``round_line`` (k counted from 1). Returns (exit status, stdout, stderr)."""
    script = Path(sys.executable).with_name("rayfl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rayfl.cli"]
    err_path = Path(cluster["root"]) / f"stderr-{time.monotonic_ns()}"
    with open(err_path, "w+") as err:
        proc = subprocess.Popen([*cmd, command, "--address", cluster["helper"].info["gcs"], *args], env=cluster["env"],
                                cwd=cluster["root"], stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        out, deadline = [], time.monotonic() + RUN_TIMEOUT
        try:
            for line in proc.stdout:
                out.append(line)
                m = re.match(round_line, line)
                if m and on_round:
                    on_round(int(m.group(1)))
                if time.monotonic() > deadline:
                    break
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                err.seek(0)
                pytest.fail(f"`rayfl {command}` did not end in {RUN_TIMEOUT}s:\n{''.join(out)[-3000:]}\n{err.read()[-3000:]}")
        err.seek(0)
        return proc.returncode, "".join(out), err.read()


def lose_a_client_node(helper: LocalCluster, lost: list) -> None:
    """Remove a worker node that hosts client actors and not the driver."""
    live = helper.actors()
    driver = {a["node"] for a in live if a["class"] == "DriverActor"}
    clients = {a["node"] for a in live if a["class"] == "ClientActor"}
    candidates = sorted(clients - driver - {helper.info["head"]})
    assert candidates, f"no node hosts client actors without the driver: {live}"
    helper.remove(candidates[0])
    lost.append(candidates[0])


def lose_the_driver_node(helper: LocalCluster, lost: list) -> None:
    """Remove the driver actor's node (and any client actor on it)."""
    [driver] = [a["node"] for a in helper.actors() if a["class"] == "DriverActor"]
    helper.remove(driver)
    lost.append(driver)


def uninterrupted_final(values: dict) -> dict:
    """The run's final metrics with every client in this process (no Ray), as MLflow's results/final.json."""
    from rayfl.tracking import final_summary

    p = prepare(tiny(**{**BASE, **values}))
    return json.loads(json.dumps(final_summary(Loop(p, LocalRuntime(p)).run().final)))


def logged_final(cluster, run_name: str) -> tuple[dict, dict]:
    """results/final.json and the metrics of the run called ``run_name``, as the run logged them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cluster["uri"])
    exp = client.get_experiment_by_name("node-loss")
    [run] = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'")
    assert run.info.status == "FINISHED", run.info.status
    dst = Path(cluster["root"]) / "dl" / run_name
    dst.mkdir(parents=True, exist_ok=True)
    with open(client.download_artifacts(run.info.run_id, "results/final.json", str(dst))) as f:
        return json.load(f), run.data.metrics


def results(final: dict) -> dict:
    """What a run computed: its final metrics but wall-clock times and fault counters."""
    return {k: v for k, v in final.items() if not k.endswith("seconds") and k != "client_restarts"}


def assert_equal_finals(got: dict, want: dict) -> None:
    got, want = results(got), results(want)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k] or (got[k] != got[k] and want[k] != want[k]), (k, got[k], want[k])


def run_args(cluster, values: dict, name: str) -> list[str]:
    return [*flags({**BASE, **values}), "--tracking-uri", cluster["uri"], "--experiment", "node-loss",
            "--run-name", name, "--out-dir", f"{cluster['root']}/runs"]


@pytest.mark.parametrize("algo", list(CASES))
def test_a_lost_client_node_is_replaced_and_the_run_ends_as_if_nothing_happened(cluster, algo):
    values, where = CASES[algo]
    helper, lost = cluster["helper"], []

    def on_round(k: int) -> None:
        if k == LOSE_AFTER and not lost:
            lose_a_client_node(helper, lost)
            if where == "added":  # the cluster is full: no room until a node is added, as an autoscaler would
                time.sleep(2)
                helper.add(num_cpus=1)

    rc, out, err = rayfl(cluster, run_args(cluster, values, f"lose-{algo}"), on_round)
    if where == "spare":  # back to four workers for the next case
        helper.add(num_cpus=1)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert lost and "client actor lost in round" in err, f"{out[-3000:]}\n{err[-3000:]}"
    final, metrics = logged_final(cluster, f"lose-{algo}")
    assert metrics["client_restarts"] >= 1
    assert_equal_finals(final, uninterrupted_final(values))


def test_a_lost_driver_node_is_replaced_from_the_checkpoint_and_the_run_ends_as_if_nothing_happened(cluster):
    """The driver's node leaves (not its process killed): the submitter starts a driver elsewhere, which goes
    on from the last checkpoint with new client actors."""
    values = {"algo": "fedfomo", "clients": 6, "participation": 0.67, "params": {"M": 2}, "checkpoint_every": 1}
    helper, lost = cluster["helper"], []

    def on_round(k: int) -> None:
        if k == LOSE_AFTER and not lost:
            lose_the_driver_node(helper, lost)

    rc, out, err = rayfl(cluster, run_args(cluster, values, "lose-driver"), on_round)
    helper.add(num_cpus=1)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert lost and f"the driver actor died (its node {lost[0]} left the cluster)" in err, err[-3000:]
    final, _ = logged_final(cluster, "lose-driver")
    assert_equal_finals(final, uninterrupted_final(values))


def test_with_no_room_left_the_run_ends_in_one_line_and_resume_finishes_it(cluster):
    """Eight clients fill the four workers: the lost actor finds no room within capacity_wait. While it waits
    the run says what for; then it ends with one line naming the lost node and the checkpoint it left (the
    newest snapshot: no checkpoint was due, checkpoint_every is 0); with a node added, --resume goes on from
    it to the uninterrupted result."""
    values = {"algo": "fedavg", "clients": 8, "participation": 0.67, "capacity_wait": 10}
    helper, lost = cluster["helper"], []

    def on_round(k: int) -> None:
        if k == LOSE_AFTER and not lost:
            lose_a_client_node(helper, lost)

    t0 = time.monotonic()
    rc, out, err = rayfl(cluster, run_args(cluster, values, "no-room"), on_round)
    ended = time.monotonic() - t0
    assert rc == 1, f"{out[-3000:]}\n{err[-3000:]}"
    said = [line for line in err.splitlines() if line.startswith("rayfl:")]
    assert len(said) == 2, err[-3000:]
    waiting, line = said  # what it waits for, while it waits; then the one line it ends with
    assert lost[0] in waiting and "waiting up to 10s for room (capacity_wait)" in waiting, waiting
    assert err.rstrip().endswith(line) and line.startswith("rayfl: run stopped: client actor(s) "), err[-3000:]
    assert lost[0] in line and "capacity_wait=10s" in line, line
    m = re.search(r"checkpoint of round (\d+) kept: go on with: rayfl run --resume (\S+)$", line)
    assert m, line
    kept_round, run_dir = int(m.group(1)), m.group(2)
    assert LOSE_AFTER <= kept_round < ROUNDS and os.path.isfile(os.path.join(run_dir, "checkpoint.rayfl"))
    assert ended < RUN_TIMEOUT

    helper.add(num_cpus=1)
    rc, out, err = rayfl(cluster, ["--resume", run_dir])
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert f"resuming after round {kept_round}/" in out
    final, _ = logged_final(cluster, "no-room")
    assert_equal_finals(final, uninterrupted_final(values))


@pytest.mark.parametrize("algo", ["fedavg", "fedfomo"])
def test_with_no_room_left_the_lost_clients_move_to_the_surviving_actors_and_the_run_ends_as_if_nothing_happened(
        cluster, algo):
    """Eight clients fill the four workers and capacity_wait is left as it is: this cluster cannot grow (no
    autoscaler), so the lost actor's clients are not waited for but re-hosted in a surviving actor from the
    driver's snapshot, the rounds since replayed, and the run ends within seconds of the loss with the final
    metrics of the uninterrupted run."""
    values = {**CASES[algo][0], "clients": 8}
    helper, lost, when = cluster["helper"], [], []

    def on_round(k: int) -> None:
        if k == LOSE_AFTER and not lost:
            lose_a_client_node(helper, lost)
            when.append(time.monotonic())

    try:
        rc, out, err = rayfl(cluster, run_args(cluster, values, f"rehost-{algo}"), on_round)
        ended = time.monotonic()
    finally:
        if lost:
            helper.add(num_cpus=1)  # back to four workers
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert lost and "their clients move to the surviving client actors" in err, err[-3000:]
    assert "waiting up to" not in err and ended - when[0] < 90, err[-3000:]
    final, metrics = logged_final(cluster, f"rehost-{algo}")
    assert metrics["client_restarts"] >= 1
    assert_equal_finals(final, uninterrupted_final(values))
    print(f"{algo}: ended {ended - when[0]:.1f}s after the loss")


def test_default_sizing_places_every_actor_on_one_cpu_workers(cluster):
    """No --cpus-per-actor, no --clients-per-actor: a 0-CPU head and 1-CPU workers get one actor per worker,
    each sized to fit its node beside the driver's share (a cluster-wide share would leave one unplaced)."""
    values = {k: v for k, v in BASE.items() if k not in ("cpus_per_actor", "clients_per_actor")}
    args = [*flags({**values, "algo": "fedavg", "clients": 4, "rounds": 2, "capacity_wait": 30}),
            "--tracking-uri", cluster["uri"], "--experiment", "node-loss", "--run-name", "default-sizing",
            "--out-dir", f"{cluster['root']}/runs"]
    rc, out, err = rayfl(cluster, args)
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    final, _ = logged_final(cluster, "default-sizing")
    assert_equal_finals(final, uninterrupted_final({"algo": "fedavg", "clients": 4, "rounds": 2,
                                                    "clients_per_actor": 1}))  # one host per client, as placed


class NoRoomRuntime(LocalRuntime):
    """In-process clients whose hosts are lost at client call ``at`` and never come back (restoring finds no
    room), as RayRuntime does when a lost node's actors get no room within capacity_wait."""

    def __init__(self, prepared, at: int):
        super().__init__(prepared)
        self.at, self.calls = at, 0

    def call(self, step, messages, reduce=None):
        self.calls += 1
        if self.calls == self.at:
            raise ClientsLost(f"hosts lost in call {self.at}")
        return super().call(step, messages, reduce)

    def restore_clients(self, saved):
        raise NoCapacity("no room for the lost hosts")


@pytest.mark.parametrize("algo,snapshot_every", [("fedavg", 1), ("fedfomo", 2)])
def test_with_no_room_the_newest_snapshot_is_left_as_a_checkpoint_that_resumes_to_the_same_result(
        algo, snapshot_every, tmp_path):
    """In one process (no Ray): the loop writes its newest in-memory snapshot as the run's checkpoint when the
    lost clients cannot be hosted again, and a run resumed from it ends as the uninterrupted one, every
    client's state included (with a snapshot every other round, rounds reported after it are not kept)."""
    values = {**BASE, **CASES[algo][0], "rounds": 5, "local_epochs": 1, "snapshot_every": snapshot_every}
    p = prepare(tiny(**values))
    full = Loop(p, LocalRuntime(p)).run()
    with pytest.raises(NoCapacity) as e:
        Loop(p, NoRoomRuntime(p, at=7), checkpoint_dir=str(tmp_path)).run()
    directory, step = e.value.checkpoint
    assert directory == str(tmp_path) and 0 <= step < 4  # no checkpoint was due: checkpoint_every is 0
    assert (step + 1) % snapshot_every == 0
    resumed = Loop(p, LocalRuntime(p), checkpoint_dir=str(tmp_path)).run()
    assert resumed.start_step == step + 1
    assert [results(h) for h in resumed.history] == [results(h) for h in full.history]
    assert same(resumed.runtime.client_states(), full.runtime.client_states())


def test_a_call_that_reaches_a_restarted_client_actor_is_a_loss_not_a_result(ray_session):
    """Ray restarts a dead client actor with its clients at their initial state; a call that reaches the new
    process without any call having failed (nothing was in flight when the old one died) must not pass for
    the run's clients: the runtime tells the processes apart and raises ClientsLost, so the loop restores."""
    import ray

    from rayfl.actors.resources import ActorResources
    from rayfl.actors.runtime import RayRuntime, start_client_actors

    p = prepare(tiny(algo="local", clients=2, clients_per_actor=1, rounds=1))
    resources = ActorResources(0.5, 0.0)
    actors, _kept = start_client_actors(p, ray.put(p.dataset.x), ray.put(p.dataset.y), resources, 2)
    runtime = RayRuntime(p, actors, resources)
    try:
        pid = runtime.placement()[0]["pid"]
        runtime.call("train", {0: {}, 1: {}})
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # until Ray has restarted it: a call then reaches the new process
            try:
                ray.get(actors[0].__ray_ready__.remote(), timeout=10)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "Ray did not restart the client actor"
                time.sleep(0.2)
        with pytest.raises(ClientsLost, match="client actor 0 was restarted"):
            runtime.call("train", {0: {}, 1: {}})
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "soon", True, None])
def test_capacity_wait_must_be_a_finite_number_of_seconds(value):
    from rayfl.config import UserError, make_config

    with pytest.raises(UserError, match=r"^capacity_wait="):
        make_config(None, {"capacity_wait": value}).check()
    assert make_config(None, {"capacity_wait": "0"}).capacity_wait == 0.0
    assert make_config(None, {}).capacity_wait == 600.0


def test_a_sweep_trial_whose_node_is_lost_is_retried_from_its_own_checkpoint(cluster):
    """`rayfl tune --address`: the node that runs a trial (its clients in the trial's own process) leaves the
    cluster after the trial's round 3 (a trial checkpoints every round; rounds slow enough that the loss lands
    mid-trial); Tune retries the trial on the nodes left, it goes on from its
    own rayfl checkpoint (the disk outlives the node), and its final metrics are those of the same experiment
    never interrupted."""
    import pandas as pd

    helper, lost = cluster["helper"], []
    values = {"algo": "fedavg", "dataset": "synthetic", "partition": "iid", "clients": 3, "rounds": ROUNDS,
              "samples_per_client": 60, "lr": 0.1, "batch_size": 16, "local_epochs": 40, "clients_per_actor": 3}
    space = Path(cluster["root"]) / "space-node-loss.yaml"
    space.write_text("grid:\n  lr: [0.1]\n")
    args = [*flags({k: v for k, v in values.items() if k != "lr"}), "--space", str(space), "--max-concurrent", "1",
            "--tracking-uri", cluster["uri"], "--experiment", "node-loss-tune",
            "--storage-path", f"{cluster['root']}/tune", "--name", "nl"]

    def on_round(k: int) -> None:
        if k >= 3 and not lost:
            actors = helper.actors()  # the trial's process is Tune's function-trainable actor
            live = [a for a in actors if "ImplicitFunc" in a["class"] and a["node"] != helper.info["head"]]
            assert len(live) == 1, f"not one trial actor on a worker node: {actors}"
            helper.remove(live[0]["node"])
            lost.append(live[0]["node"])

    try:
        rc, out, err = rayfl(cluster, args, on_round, command="tune", round_line=r"trial \S+ round (\d+)/")
    finally:
        if lost:
            helper.add(num_cpus=1)  # back to four workers
    text = out + err
    assert rc == 0 and lost, text[-3000:]
    assert re.search(r"^trial \S+ lost its process; retried \(1 so far\)", text, re.M), text[-3000:]
    sweep_dir = Path(cluster["root"]) / "tune" / "nl"
    with open(sweep_dir / "rayfl_trials.json") as f:
        [rec] = json.load(f)["trials"].values()
    assert rec["status"] == "DONE" and rec["result"]["round"] == ROUNDS
    assert 0 < rec["result"]["rounds_run"] < ROUNDS  # the retry went on from a checkpoint, not from round 1
    table = pd.read_csv(sweep_dir / "results.csv")
    want = uninterrupted_final(values)
    assert len(table) == 1 and table.rounds[0] == ROUNDS
    assert table.test_acc_mean[0] == pytest.approx(want["test_acc_mean"], abs=1e-6)
    assert table.val_acc_mean[0] == pytest.approx(want["val_acc_mean"], abs=1e-6)


def test_a_tracking_server_down_is_one_line_before_any_actor_starts_on_a_cluster(cluster):
    """With --address the run's driver opens the store from the cluster: a tracking server that does not answer
    there is one line, exit 2, within seconds of connecting and before any actor starts (no actor line)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    rc, out, err = rayfl(cluster, [*flags({**BASE, "algo": "fedavg", "clients": 2}), "--tracking-uri", uri,
                                   "--out-dir", f"{cluster['root']}/runs"])
    assert rc == 2 and err.strip().splitlines() == [
        f"rayfl: error: tracking_uri='{uri}': cannot open experiment 'rayfl' there (no server answers at "
        f"127.0.0.1:{port}: Connection refused)"], err[-3000:]
    assert "actors" not in out and time.monotonic() - t0 < 60, out[-2000:]


def test_a_save_left_on_the_drivers_node_is_restored_only_from_the_process_it_was_asked_of(ray_session):
    """A save kept in place (the client actor shares the driver's node: copying it would only cost a wait) is
    checked when restored: made by the process it was asked of, it is its state; made by a process Ray
    restarted meanwhile (another token: fresh clients), the snapshot is a loss, not a state to load."""
    from rayfl.actors.runtime import LocalSave

    ref = ray_session.put(("token-a", {0: b"state"}))
    assert LocalSave.value(LocalSave(ref, "token-a")) == {0: b"state"}
    with pytest.raises(ClientsLost, match="restarted client actor"):
        LocalSave.value(LocalSave(ref, "token-b"))
    assert LocalSave.value({1: b"kept"}) == {1: b"kept"}  # a save already copied here is as it is
