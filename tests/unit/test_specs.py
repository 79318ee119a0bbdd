"""The typed layer under ``run``, ``tune`` and ``compare`` (rayfl.specs): each sweep and comparison default is
written once, as a field of its options class, and both doors are built from it (``rayfl tune`` / ``rayfl
compare``'s flags, :func:`rayfl.tune` / :func:`rayfl.compare`'s signatures); the ``--resume`` rules, for a run
and a sweep from either door, are one function."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os

import pytest

import rayfl
from rayfl.config import UserError
from rayfl.flags import add_options
from rayfl.specs import (COMPARE_DEFAULTS, SWEEP_DEFAULTS, CompareOptions, SweepOptions, SweepSpec, check_resume,
                         option)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOORS = [(SweepOptions, "tune", rayfl.tune, "rayfl/api.py", "tune"),
         (CompareOptions, "compare", rayfl.compare, "rayfl/comparison/run.py", "compare")]


def subparser(command: str) -> argparse.ArgumentParser:
    from rayfl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("options, command, api, path, function", DOORS, ids=["tune", "compare"])
def test_every_option_default_reaches_the_api_and_the_command_line(options, command, api, path, function):
    """The API's keyword and the command's flag of every option default to the field's default (a flag whose
    'not given' the command works out later says the default in its help)."""
    parameters = inspect.signature(api).parameters
    parser = subparser(command)
    parsed = vars(parser.parse_args([]))
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(options):
        assert parameters[f.name].default == f.default, f.name
        if f.metadata.get("flag", "") is None:  # the API's keyword alone: no flag
            assert f.name not in actions, f.name
            continue
        if "cli_default" in f.metadata:
            assert parsed[f.name] == f.metadata["cli_default"] and " ".join(map(str, f.default)) in actions[f.name].help
        else:
            assert parsed[f.name] == f.default, f.name
        if "choices" in f.metadata and not callable(f.metadata["choices"]):
            assert tuple(actions[f.name].choices) == tuple(f.metadata["choices"])


@pytest.mark.parametrize("options, command, api, path, function", DOORS, ids=["tune", "compare"])
def test_each_option_default_is_written_once(options, command, api, path, function):
    """In the API's source every option's default is the options class's attribute, never a literal written a
    second time; no module adds an option's flag by hand (rayfl.flags.add_options builds them all); the table
    of defaults is the fields'."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    args = [*fn.args.posonlyargs, *fn.args.args]
    given = dict(zip([a.arg for a in args][len(args) - len(fn.args.defaults):], fn.args.defaults))
    given.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
    for f in dataclasses.fields(options):
        default = given[f.name]
        assert isinstance(default, ast.Attribute) and default.attr == f.name and \
            isinstance(default.value, ast.Name) and default.value.id == options.__name__, \
            f"{path}: {function}({f.name}=...) must read {options.__name__}.{f.name}"
    flags = {f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in dataclasses.fields(options)}
    for here, _, names in os.walk(os.path.join(ROOT, "rayfl")):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(here, name), encoding="utf-8") as f:
                    source = ast.parse(f.read())
                for node in ast.walk(source):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                        literal = [a.value for a in node.args if isinstance(a, ast.Constant)]
                        assert not set(literal) & flags, f"{name}: adds {literal} by hand"
    assert (SWEEP_DEFAULTS if options is SweepOptions else COMPARE_DEFAULTS) == {
        f.name: f.default for f in dataclasses.fields(options)}


def test_compare_shows_its_progress_by_default():
    """rayfl.compare prints its lines unless told not to, as run and tune do: the default is the field's, and the
    command has no --progress flag (it always prints them; --quiet drops its round lines)."""
    assert CompareOptions.progress is True and COMPARE_DEFAULTS["progress"] is True
    assert inspect.signature(rayfl.compare).parameters["progress"].default is True
    with pytest.raises(UserError, match="--progress"):
        subparser("compare").parse_args(["--progress"])


def test_compare_refuses_a_progress_that_is_neither_a_switch_nor_a_callable():
    from rayfl.specs import CompareSpec

    with pytest.raises(UserError, match=r"^progress='yes': must be True, False or a callable"):
        CompareSpec(progress="yes").check()


def test_the_flags_follow_their_fields():
    """A changed default (or help) in the options class is the flag's: the parser is built from the fields."""
    @dataclasses.dataclass
    class Changed(SweepOptions):
        search: str = option("random", "how trials are drawn ({default})", choices=("grid", "random"))
        num_samples: int | None = option(7, "trials", type=int, metavar="N")

    parser = argparse.ArgumentParser()
    add_options(parser, Changed)
    args = parser.parse_args([])
    assert (args.search, args.num_samples, args.scheduler, args.stage_reuse) == ("random", 7, "fifo", True)
    assert parser.parse_args(["--no-stage-reuse"]).stage_reuse is False
    assert next(a for a in parser._actions if a.dest == "search").help == "how trials are drawn (random)"


@pytest.mark.parametrize("resume, given, kind, style, message", [
    (123, [], "run", "api", "resume=123: must be a run directory (a path)"),
    (123, [], "sweep", "api", "resume=123: must be a directory (a path)"),
    ("", [], "run", "flag", "--resume '': empty path; give a run directory"),
    (" ", [], "sweep", "api", "resume=' ': empty path; give a sweep directory"),
    ("d", ["--lr", "--batch-size"], "run", "flag", "--resume 'd' with --batch-size: a resumed run keeps its saved "
     "config; give only --resume DIR (and --address, --quiet, or a lower step size: --lr, -p NAME_lr=VALUE)"),
    ("d", ["lr", "rounds"], "run", "api", "resume='d': a resumed run uses its own config.yaml; pass no other "
                                          "settings than a lower step size (lr=, params={'NAME_lr': ...})"),
    ("d", ["--tracking-uri", "--num-samples"], "sweep", "flag",
     "--resume 'd' with --num-samples: a resumed sweep keeps its saved settings; give only --resume DIR (and "
     "--tracking-uri, --stage-cache, --address, --quiet)"),
    ("d", ["space"], "sweep", "api", "resume='d': a resumed sweep uses its own settings; pass no others (but "
                                     "tracking_uri, stage_cache)"),
])
def test_the_resume_rules_are_one_function(resume, given, kind, style, message):
    with pytest.raises(UserError) as e:
        check_resume(resume, given, kind, style)
    assert str(e.value) == message


def test_a_resume_may_say_where_a_sweep_writes_and_nothing_else():
    assert check_resume(None, ["--lr"], "run", "flag") is None
    assert check_resume("d", [], "run", "flag") == "d"
    assert check_resume(os.path.join("a", "b"), ["tracking_uri", "stage_cache"], "sweep", "api") == "a/b"
    spec = SweepSpec(values={"tracking_uri": "x"}, resume="d", stage_reuse=False)
    assert spec.given() == ["--tracking-uri", "--no-stage-reuse"]
    with pytest.raises(UserError, match="with --no-stage-reuse: a resumed sweep keeps its saved settings"):
        spec.check()
    api = SweepSpec(values={"stage_cache": "s"}, resume="d", search="random", call="rayfl.tune(...)")
    assert api.given() == ["stage_cache", "search"]
    with pytest.raises(UserError, match="a resumed sweep uses its own settings"):
        api.check()


@pytest.mark.parametrize("spec, message", [
    (SweepSpec(num_samples=0), "--num-samples=0: must be an integer >= 1"),
    (SweepSpec(num_samples=0, call="rayfl.tune()"), "num_samples=0: must be an integer >= 1"),
    (SweepSpec(num_samples=10_001, call="rayfl.tune()"), "num_samples=10001: a sweep runs at most 10,000 trials"),
    (SweepSpec(search="bayes", call="rayfl.tune()"), "search='bayes': unknown; allowed: grid, random, optuna"),
    (SweepSpec(mode="up", call="rayfl.tune()"), "mode='up': allowed: max, min"),
    (SweepSpec(name="a/b"), "--name='a/b': must be a directory name"),
    (SweepSpec(space={"grid": {"lr": [object()]}}, call="rayfl.tune()"), "space: holds <object"),
])
def test_a_sweep_spec_checks_its_options_once_for_both_doors(spec, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        spec.check()
