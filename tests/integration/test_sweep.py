"""`rayfl tune`: space files (checked before any trial), trial resources, what the console shows (the plan,
``k/N done`` with the time left, reused stages, where to look), the MLflow parent/child runs and the parent's
description, and PersFL's shared stage 1. The sweeps run on a private 2-CPU Ray instance (conftest's
``ray_session``)."""

from __future__ import annotations

import glob
import os

import pytest

from rayfl import sweep
from rayfl.algorithms import algorithm_names
from rayfl.cli import main
from rayfl.config import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--dataset", "synthetic", "--partition", "iid", "--clients", "3", "--rounds", "2",
        "--samples-per-client", "40", "--batch-size", "16", "--clients-per-actor", "3"]  # one client actor: in-process trials


def write(tmp_path, text: str, name: str = "space.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------------------------- spaces
def test_every_algorithm_has_a_valid_default_space():
    files = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "tune_spaces", "*.yaml"))}
    assert {"local", "fedavg", "fedavg-ft", "fedfomo", "persfl", "federico", "usercentric", "fedmoe"} <= files
    for algo in algorithm_names():
        plan = sweep.plan_sweep(sweep.load_space(sweep.find_space_file(algo)), {}, {"algo": algo}, {})
        assert sweep.validate_space(plan) >= 2, algo
        assert plan.space.swept(), algo


def test_default_space_found_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sweep.find_space_file("persfl") == os.path.join(ROOT, "tune_spaces", "persfl.yaml")


BAD = [
    ("grid: {lr: [0.1, 0.2]\n", "fedavg", "not valid YAML"),
    ("grid: {epsilon: [0.1, 0.2]}\n", "fedavg", "grid.epsilon: unknown key"),
    ("grid: {val_frac: [0.2, 1.5]}\n", "fedavg", "grid.val_frac: val_frac=1.5"),
    ("random: {val_frac: {uniform: [0.1, 1.2]}}\n", "fedavg", "random.val_frac: val_frac=1.2"),
    ("random: {lr: {loguniform: [0, 0.1]}}\n", "fedavg", "random.lr: loguniform needs low > 0"),
    ("random: {lr: {gaussian: [0, 1]}}\n", "fedavg", "random.lr: unknown distribution"),
    ("grid: {ft_epochs: [0, 1]}\n", "fedavg-ft", "grid.ft_epochs: ft_epochs=0"),
    ("grid: {lr: 0.1}\n", "fedavg", "grid.lr: must be a non-empty list"),
    ("serach: {lr: [1]}\n", "fedavg", "unknown section 'serach'; allowed: fixed, grid, random"),
    ("gird: {lr: [1]}\n", "fedavg", "unknown section 'gird' (did you mean 'grid'?)"),
    ("grid: {local_epoch: [1, 2]}\n", "fedavg", "grid.local_epoch: unknown key (did you mean 'local_epochs'?)"),
    ("grid: {val_frac: [0.3, 0.5], test_frac: [0.3, 0.5]}\n", "fedavg", "the combination val_frac=0.5, test_frac=0.5"),
    ("grid: {lam: [0.5, 1.5]}\n", "persfl", "grid.lam: lam=1.5"),
    ("grid: {T: [0, 1]}\n", "persfl", "grid.T: T=0"),
    ("grid: {epsilon: [0.3, 1.2]}\n", "fedfomo", "grid.epsilon: epsilon=1.2"),
    ("fixed: {clients: 4}\ngrid: {M: [2, 5]}\n", "fedfomo", "grid.M: M=5"),
    ("random: {M: {uniform: [1, 3]}}\n", "fedfomo", "random.M: M is an integer"),
]


@pytest.mark.parametrize("text, algo, expected", BAD)
def test_bad_space_is_one_line_naming_file_and_key(tmp_path, capsys, text, algo, expected):
    path = write(tmp_path, text)
    assert main(["tune", "--algo", algo, "--space", path, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfl: error: ") and "\n" not in err, err
    assert path in err and expected in err, err
    assert not (tmp_path / "tune").exists()  # nothing started


@pytest.mark.parametrize("kwargs, expected", [
    ({"num_samples": 2.5}, "num_samples=2.5: must be an integer >= 1"),
    ({"max_concurrent": "a"}, "max_concurrent='a': must be an integer >= 1"),
    ({"grace_period": True}, "grace_period=True: must be an integer >= 1"),
    ({"name": "a/b"}, "name='a/b': must be a directory name"),
    ({"name": ".."}, "name='..': must be a directory name"),
    ({"resume": 3}, "resume=3: must be a directory"),
])
def test_api_sweep_arguments_are_one_line_errors(tmp_path, kwargs, expected):
    import rayfl

    with pytest.raises(UserError) as e:
        rayfl.tune(algo="fedavg", out_dir=str(tmp_path), **({} if "resume" in kwargs else {"clients": 3}), **kwargs)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "tune").exists()


def test_random_space_kinds_are_only_the_known_distributions(tmp_path, capsys):
    path = write(tmp_path, "random: {lr: {run: [echo, hi]}}\n")
    assert main(["tune", "--algo", "fedavg", "--space", path, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfl: error: ") and "\n" not in err and "random.lr: unknown distribution 'run'" in err


def test_flags_fix_swept_keys_and_test_metric_refused(tmp_path, capsys):
    plan = sweep.plan_sweep(sweep.load_space(write(tmp_path, "fixed: {rounds: 9}\ngrid: {lr: [0.1, 0.2], local_epochs: [1, 2]}\n")),
                            {}, {"algo": "fedavg", "lr": "0.3", "rounds": "2"}, {})
    assert plan.space.swept() == ["local_epochs"] and plan.notes
    assert plan.config({"local_epochs": 2}).lr == 0.3 and plan.config({}).rounds == 2
    path = write(tmp_path, "grid: {lr: [0.1, 0.2]}\n")
    assert main(["tune", "--algo", "fedavg", "--space", path, "--metric", "test_acc_mean", *TINY,
                 "--out-dir", str(tmp_path)]) == 2
    assert "never on test" in capsys.readouterr().err


def test_trial_bundles_are_what_the_actors_ask():
    from conftest import tiny

    cfg = tiny(clients=5, clients_per_actor=2)
    bundles = sweep.trial_bundles(cfg, {"CPU": 1.0, "GPU": 0.5})
    assert len(bundles) == 2 + 3  # trial, driver, 3 client actors
    assert bundles[1] == {"CPU": 0.05}
    assert all(b == bundles[2] for b in bundles[2:]) and bundles[2]["GPU"] == pytest.approx(0.5 / 3, abs=1e-4)
    assert sweep.bundle_total(bundles)["CPU"] <= 1.0 and sweep.bundle_total(bundles)["GPU"] <= 0.5


def test_a_one_slot_share_is_one_bundle_and_default_concurrency_is_one_trial_per_slot():
    """A trial whose share holds one client actor runs in its own process: one bundle of its share; the
    default number of trials at once is the cluster's slots (torch_threads CPUs each), at most the trials."""
    from conftest import tiny

    from rayfl.sweep.command import _default_concurrency

    cfg = tiny(clients=10)  # clients_per_actor auto, torch_threads 1
    assert sweep.trial_bundles(cfg, {"CPU": 1.0, "GPU": 0.0}) == [{"CPU": 1.0}]
    assert sweep.trial_bundles(cfg, {"CPU": 1.0, "GPU": 0.5}) == [{"CPU": 1.0, "GPU": 0.5}]
    assert len(sweep.trial_bundles(cfg, {"CPU": 2.0, "GPU": 0.0})) == 2 + 2  # two slots: driver + 2 actors
    base = {k: v for k, v in vars(cfg).items() if k != "params"}
    assert _default_concurrency({"n_trials": 35, "base": base}, {"CPU": 2.0}) == 2
    assert _default_concurrency({"n_trials": 3, "base": base}, {"CPU": 16.0}) == 3
    assert _default_concurrency({"n_trials": 35, "base": {**base, "torch_threads": 4}}, {"CPU": 16.0}) == 4


def test_trial_names_put_the_knobs_first():
    name = sweep.trial_name({"lam": 0.5, "T": 5}, {"algo": "persfl", "dataset": "digits", "seed": 0})
    assert name == "lam=0.5,T=5 · persfl-digits-s0"
    assert sweep.trial_name({}, {"algo": "fedavg"}) == "fedavg-digits-s0"


def test_sweep_counter_divides_by_all_trials_not_those_created_so_far():
    from types import SimpleNamespace as T

    from rayfl.sweep.progress import eta_line, finished_count

    created = [T(status="TERMINATED"), T(status="RUNNING"), T(status="RUNNING")]
    assert finished_count(created, created[1], total=4) == (2, 4)  # Tune had created 3 of the 4 trials
    assert finished_count(created, created[1], total=0) == (2, 3)
    # the time left at the pace of the trials that ended in this process (a resumed sweep's earlier ones apart)
    assert eta_line(2, 4, 2, 30.0) == "2/4 done, elapsed 0:30, eta 0:30"
    assert eta_line(7, 10, 1, 30.0) == "7/10 done, elapsed 0:30, eta 1:30"
    assert eta_line(4, 4, 4, 61.0) == "4/4 done, elapsed 1:01"


def test_what_a_sweep_will_run_and_its_best_trial():
    import pandas as pd

    from rayfl.sweep.command import best_of, sweep_plan, trial_resources

    meta = {"algo": "persfl", "n_trials": 6, "search": "grid", "num_samples": 1, "metric": "val_acc_mean",
            "swept": ["lam", "T", "lr"],
            "space": {"grid": {"lam": [0.0, 0.5], "T": [1, 3, 5]}, "random": {"lr": {"loguniform": [0.001, 0.1]}}}}
    assert sweep_plan(meta) == ("persfl, 6 trial(s): lam in {0, 0.5} x T in {1, 3, 5} x lr ~ loguniform(0.001, 0.1) "
                                "(grid)")
    assert trial_resources([{"CPU": 1.0}]) == "1 CPU, its clients in its own process"
    assert trial_resources([{"CPU": 0.05}, {"CPU": 0.05}, {"CPU": 0.95, "GPU": 0.5}, {"CPU": 0.95, "GPU": 0.5}]) == \
        "2 CPUs and 1 GPU: a driver and 2 client actors"
    table = pd.DataFrame({"lam": [0.5, 0.0], "T": [3, 1], "lr": [0.01, 0.02], "val_acc_mean": [0.9, 0.8]})
    best = best_of(table, meta)
    assert best == {"lam": 0.5, "T": 3, "lr": 0.01, "val_acc_mean": 0.9} and type(best["T"]) is int
    assert best_of(table.assign(val_acc_mean=float("nan")), meta) == {}


# --------------------------------------------------------------------------------------------- sweeps
def _children(uri, parent):
    import mlflow

    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name("rayfl")
    return mlflow.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")


def test_grid_sweep_2x2_four_children_one_parent(ray_session, tmp_path, capsys):
    import mlflow
    import pandas as pd

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write(tmp_path, "grid:\n  lr: [0.05, 0.2]\n  local_epochs: [1, 2]\n")
    code = main(["tune", "--algo", "fedavg", "--space", path, *TINY, "--tracking-uri", uri, "--max-concurrent", "2",
                 "--storage-path", str(tmp_path / "tune"), "--name", "t2x2", "--quiet", "--ui-port", "5055"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "best (val_acc_mean" in out and "sweep results" in out
    # what will run, in words (not Tune's resource dicts), then k/N done with the time left, then where to look
    setup = out.splitlines()[0]
    assert setup == ("rayfl tune: fedavg, 4 trial(s): lr in {0.05, 0.2} x local_epochs in {1, 2} (grid); 2 at once, "
                     "each 1 CPU, its clients in its own process; optimizing val_acc_mean (max, fifo)"), setup
    done = [line for line in out.splitlines() if line.startswith("rayfl tune: ") and " done, elapsed " in line]
    assert [line.split()[2] for line in done] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(", eta " in line for line in done[:3]) and ", eta " not in done[3]
    assert all("val_acc_mean 0." in line for line in done)
    sweep_dir = tmp_path / "tune" / "t2x2"
    table = pd.read_csv(sweep_dir / "results.csv")
    assert len(table) == 4 and set(table.status) == {"DONE"}
    assert {(r.lr, r.local_epochs) for r in table.itertuples()} == {(0.05, 1), (0.05, 2), (0.2, 1), (0.2, 2)}

    mlflow.set_tracking_uri(uri)
    parents = mlflow.search_runs(mlflow.get_experiment_by_name("rayfl").experiment_id,
                                 filter_string="tags.`rayfl.kind` = 'sweep'")
    assert len(parents) == 1 and parents.status[0] == "FINISHED"
    parent = parents.run_id[0]
    kids = _children(uri, parent)
    assert len(kids) == 4 and set(kids.status) == {"FINISHED"}
    # once per sweep: its federation (the caveat with it when its splits are small) and where to watch it
    assert [line for line in out.splitlines() if "partition: " in line] == [
        "rayfl tune: partition: 3 clients; training samples min 24 / median 24 / max 24; classes per client "
        "min 10 / median 10 / max 10 (of 10)"], out
    caveat = [line for line in out.splitlines() if line.startswith("rayfl tune: warning: ")]
    assert len(caveat) == 1 and "have fewer than 10 validation or test samples" in caveat[0]
    # the addresses printed point at the UI's port given (--ui-port), and say how to start it there
    assert f"rayfl tune: watch it in MLflow: http://127.0.0.1:5055/#/experiments/" in out and parent in out
    assert f"look at it: mlflow ui --backend-store-uri {uri} --port 5055" in out
    assert {(float(a), int(b)) for a, b in zip(kids["params.lr"], kids["params.local_epochs"])} == \
        {(0.05, 1), (0.05, 2), (0.2, 1), (0.2, 2)}
    assert set(kids["tags.rayfl.role"]) == {"trial"} and parents["tags.rayfl.role"][0] == "sweep"
    assert {n.split(" · ")[0] for n in kids["tags.mlflow.runName"]} == \
        {"lr=0.05,local_epochs=1", "lr=0.05,local_epochs=2", "lr=0.2,local_epochs=1", "lr=0.2,local_epochs=2"}
    client = mlflow.MlflowClient(uri)
    assert out.rstrip().splitlines()[-2] == (f"  this sweep: http://127.0.0.1:5055/#/experiments/{kids.experiment_id[0]}"
                                             f"/runs/{parent}?workflowType=machine_learning")
    # the parent: provenance tags as a run has them, and the best trial's knobs and metric as its description
    tags = client.get_run(parent).data.tags
    assert {"rayfl.version", "rayfl.command", "rayfl.cwd", "mlflow.source.name"} <= set(tags)
    assert tags["rayfl.algo"] == "fedavg" and set(kids["tags.rayfl.command"]) == {tags["rayfl.command"]}
    best = table.sort_values("val_acc_mean", ascending=False).iloc[0]
    note = tags["mlflow.note.content"]
    # its first line: the selection metric, named, and the best trial's test mean and worst client
    head = note.splitlines()[0]
    assert head.startswith(f"**best val_acc_mean {best.val_acc_mean:.2%}** · test accuracy {best.test_acc_mean:.2%}"
                           f" · worst client ") and len(head) <= 100, head
    assert note.splitlines()[2].startswith(f"Best trial: lr={best.lr:g}, local_epochs={best.local_epochs}, val_acc_mean "
                                           f"{best.val_acc_mean:.4f} (final round), its run [lr=")
    assert "fedavg, 4 trial(s): lr in {0.05, 0.2} x local_epochs in {1, 2} (grid); fedavg on synthetic (iid)" in note
    assert note.count("| DONE |") == 4
    for run_id in kids.run_id:
        assert len(client.get_metric_history(run_id, "val_acc_mean")) == 2  # one per round
        # the selection metric again under the name MLflow lists first (the compare page, the chart view)
        selection = client.get_metric_history(run_id, "Selection/val_acc_mean")
        assert [(m.step, m.value) for m in selection] == \
            [(m.step, m.value) for m in client.get_metric_history(run_id, "val_acc_mean")]
    assert set(kids["tags.rayfl.selection_metric"]) == {"val_acc_mean"}
    # MLflow's system metrics: each trial's (its process) and the sweep's own (the parent, this process)
    for run_id in [*kids.run_id, parent]:
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= \
            set(client.get_run(run_id).data.metrics), run_id
    arts = {a.path for a in client.list_artifacts(parent, "results")} | {a.path for a in client.list_artifacts(parent, "plots")}
    assert "results/results.csv" in arts
    assert {"plots/val_acc_mean_vs_lr.png", "plots/val_acc_mean_vs_local_epochs.png",
            "plots/val_acc_mean_lr_x_local_epochs.png"} <= arts  # a heatmap for a two-knob grid

    # resources: 2 at once on 2 CPUs gives each trial one CPU, one client actor's worth: each trial ran its
    # clients in its own process (one bundle of at most 1 CPU), the trials side by side, and Tune reused
    # those processes (4 trials, at most 2 processes).
    results = pd.read_csv(sweep_dir / "results.csv")
    assert results.mlflow_run_id.notna().all()
    import json

    progress = [pd.read_json(p, lines=True).iloc[-1] for p in glob.glob(str(sweep_dir / "*" / "result.json"))]
    assert len(progress) == 4 and all(p.bundle_cpus <= 1.0 + 1e-9 for p in progress)
    assert len({p.trial_pid for p in progress}) <= 2 and len({p.pg_id for p in progress}) <= 2
    spans = sorted((p.trial_start, p.trial_end) for p in progress)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), "no two trials overlapped"
    bundles = [json.loads(b) for b in kids["params.tune_bundles"]]
    assert all(len(b) == 1 and b[0]["CPU"] <= 1.0 + 1e-9 for b in bundles)
    assert set(kids["params.n_actors"]) == {"1"}


def test_a_trial_with_more_than_one_slot_runs_on_its_own_actors(ray_session, tmp_path, capsys):
    """One trial at a time on 2 CPUs: the trial's share holds 2 client actors, so it gets a driver and client
    actors pinned to its placement group, as a run does."""
    import json

    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write(tmp_path, "grid:\n  lr: [0.05]\n")
    code = main(["tune", "--algo", "fedavg", "--space", path, *TINY, "--clients-per-actor", "auto", "--tracking-uri",
                 uri, "--max-concurrent", "1", "--storage-path", str(tmp_path / "tune"), "--name", "t1", "--quiet"])
    assert code == 0, capsys.readouterr().out
    mlflow.set_tracking_uri(uri)
    kids = mlflow.search_runs(mlflow.get_experiment_by_name("rayfl").experiment_id,
                              filter_string="tags.`rayfl.role` = 'trial'")
    assert len(kids) == 1 and kids.status[0] == "FINISHED"
    bundles = json.loads(kids["params.tune_bundles"][0])
    assert kids["params.n_actors"][0] == "2" and len(bundles) == 2 + 2 and sum(b["CPU"] for b in bundles) <= 2.0


def test_persfl_reuse_gives_the_stage2_result_of_a_run_without_it(ray_session, tmp_path, capsys):
    """Two (lam, T) trials share one stage 1 through the stage cache; each equals a plain run of that (lam, T)
    that computes its own. No extra run: the trial that reuses it shows stage 1's rounds as its own."""
    import mlflow
    import pandas as pd

    from conftest import tiny
    from rayfl.experiment import prepare
    from rayfl.loop import Loop
    from rayfl.runtime import LocalRuntime

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write(tmp_path, "grid:\n  lam: [0.0, 0.5]\n  T: [3]\n")
    code = main(["tune", "--algo", "persfl", "--space", path, *TINY, "--lr", "0.1", "--tracking-uri", uri,
                 "--max-concurrent", "2", "--storage-path", str(tmp_path / "tune"), "--name", "p", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    entries = glob.glob(str(tmp_path / "tune" / "p" / "stages" / "*" / "checkpoint.*"))
    assert len(entries) == 1  # one stage 1 for both trials
    progress = [pd.read_json(p, lines=True).iloc[-1] for p in glob.glob(str(tmp_path / "tune" / "p" / "*" / "result.json"))]
    assert sorted(int(p.rounds_run) for p in progress) == [1, 3]  # one computed stage 1 (2 rounds) + stage 2
    assert all(p.total_rounds == 3 and p["round"] == 3 for p in progress)
    parent = mlflow.search_runs(mlflow.get_experiment_by_name("rayfl").experiment_id,
                                filter_string="tags.`rayfl.kind` = 'sweep'").run_id[0]
    kids = _children(uri, parent)
    assert list(kids["params.tune_role"]) == ["trial", "trial"] and set(kids.status) == {"FINISHED"}
    assert sorted(kids["tags.rayfl.stage_reused"].fillna("")) == ["", "fedavg"]
    assert out.count(" reuses rounds 1-2: a shared stage another trial computed") == 1  # said, even with --quiet
    for note in kids["tags.mlflow.note.content"]:  # the trial's single lam and T, not the empty grids that force it
        assert "grid=" not in note and "lam=" in note
    client = mlflow.MlflowClient(uri)
    for run_id in kids.run_id:  # the reusing trial's curve starts at round 1 too
        assert [m.step for m in client.get_metric_history(run_id, "val_acc_mean")] == [1, 2, 3]
    table = pd.read_csv(tmp_path / "tune" / "p" / "results.csv")
    for row in table.itertuples():
        cfg = tiny(algo="persfl", samples_per_client=40, params={"lam": row.lam, "T": row.T, "lam_grid": (), "T_grid": ()})
        loop = Loop(prepare(cfg), LocalRuntime(prepare(cfg))).run()
        assert loop.final["val_acc_mean"] == pytest.approx(row.val_acc_mean, abs=1e-6)
        assert loop.final["test_acc_mean"] == pytest.approx(row.test_acc_mean, abs=1e-6)
