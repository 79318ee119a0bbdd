"""A run resumed after a divergence may lower its step sizes, and nothing else (rayfl.resume.with_step_sizes):
the checkpoint is re-keyed to the new config with the change recorded, config.yaml says the new values, and
the loop goes on with them."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from conftest import tiny
from rayfl.config import UserError
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop, RunStopped
from rayfl.resume import step_size_note
from rayfl.runtime import LocalRuntime
from rayfl.session import load_run_dir

CFG = dict(algo="pfedme", rounds=3, checkpoint_every=1, lr=0.1)


class StopAfterFirst(Callback):
    def on_round(self, loop, record) -> None:
        loop.stop_requested = True


@pytest.fixture
def run_dir(tmp_path):
    """A 3-round pFedMe run directory (config.yaml) stopped after round 1, with that round's checkpoint."""
    cfg = tiny(**CFG)
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    p = prepare(cfg)
    with pytest.raises(RunStopped):
        Loop(p, LocalRuntime(p), [StopAfterFirst()], str(directory)).run()
    assert Loop.read_checkpoint(str(directory), cfg)["step"] == 0
    return str(directory)


def files(run_dir: str) -> dict[str, bytes]:
    return {name: open(os.path.join(run_dir, name), "rb").read() for name in sorted(os.listdir(run_dir))}


def test_lower_step_sizes_rekey_the_checkpoint_and_the_saved_config(run_dir):
    cfg = load_run_dir(run_dir, {"lr": 0.05, "params": {"personal_lr": 0.01}})
    assert cfg == dataclasses.replace(tiny(**CFG), lr=0.05, params={"personal_lr": 0.01})
    state = Loop.read_checkpoint(run_dir, cfg)  # the new config's checkpoint now
    assert state["step"] == 0
    assert state["step_size_changes"] == [{"from_round": 2, "lr": [0.1, 0.05], "param.personal_lr": [0.09, 0.01]}]
    saved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert saved["lr"] == 0.05 and saved["params"] == {"personal_lr": 0.01} and saved["rounds"] == 3
    assert load_run_dir(run_dir) == cfg  # a later --resume goes on with them
    assert step_size_note(state["step_size_changes"]) == ("lr 0.1 -> 0.05 from round 2; personal_lr 0.09 -> 0.01 "
                                                          "from round 2")


def test_the_loop_goes_on_with_the_new_step_sizes_and_keeps_the_record(run_dir):
    cfg = load_run_dir(run_dir, {"lr": 0.05})
    p = prepare(cfg)
    loop = Loop(p, LocalRuntime(p), checkpoint_dir=run_dir).run()
    assert loop.start_step == 1 and [h["step"] for h in loop.history][-1] == 2
    assert loop.step_size_changes == [{"from_round": 2, "lr": [0.1, 0.05]}]
    state = Loop.read_checkpoint(run_dir, cfg)
    assert state["step"] == 2 and state["step_size_changes"] == loop.step_size_changes


def test_the_same_step_sizes_change_nothing(run_dir):
    before = files(run_dir)
    assert load_run_dir(run_dir, {"lr": 0.1}) == tiny(**CFG)
    assert files(run_dir) == before


@pytest.mark.parametrize("changes, name", [({"batch_size": 8}, "batch_size=8"),
                                           ({"params": {"lam": 30.0}}, "params.lam=30.0")])
def test_anything_but_a_step_size_is_refused_and_nothing_is_changed(run_dir, changes, name):
    before = files(run_dir)
    with pytest.raises(UserError) as e:
        load_run_dir(run_dir, changes)
    assert str(e.value) == (f"--resume {run_dir!r} with {name}: a resumed run keeps its saved config but for its "
                            f"step sizes (--lr, -p personal_lr); start a new run to change {name.split('=')[0]}")
    assert files(run_dir) == before


def test_a_step_size_that_is_not_a_finite_number_is_one_line_and_changes_nothing(run_dir):
    before = files(run_dir)
    with pytest.raises(UserError, match=r"^--resume .*: lr="):
        load_run_dir(run_dir, {"lr": float("nan")})
    assert files(run_dir) == before
