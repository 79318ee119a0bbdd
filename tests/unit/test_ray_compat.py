"""Ray's private internals are used in one module (rayfl/ray_compat.py), behind a check of Ray's version: a Ray
outside the supported range, or one without a private name rayfl uses, is one line before anything starts.
``--search optuna`` without optuna names the extra that brings it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from rayfl import ray_compat
from rayfl.cli import main
from rayfl.config import UserError

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
TINY = ["--dataset", "synthetic", "--clients", "3", "--rounds", "1", "--samples-per-client", "40"]


@pytest.mark.parametrize("version", ["2.52.0", "2.60.0", "2.61.0", "2.99.3", "2.60.0rc1", "2.60.0.post1"])
def test_a_ray_in_the_supported_range_passes(version):
    ray_compat.check_ray_version(version)


@pytest.mark.parametrize("version, why", [
    ("3.0.0", "a new major"), ("3.0.0rc1", "a new major"), ("10.1.0", "a new major"),
    ("2.51.9", "it has no token authentication"), ("2.50.0", "it has no token authentication"),
    ("1.13.1", "it has no token authentication"), ("nightly", "not a version number")])
def test_a_ray_outside_the_range_is_one_line_naming_the_range(version, why):
    with pytest.raises(UserError) as e:
        ray_compat.check_ray_version(version)
    text = str(e.value)
    assert text.startswith(f"ray=={version}: rayfl supports ray>=2.52,<3 (") and why in text
    assert "\n" not in text and "constraints.txt" in text


def test_no_ray_installed_is_one_line(monkeypatch):
    monkeypatch.setattr(ray_compat, "installed_ray_version", lambda: None)
    with pytest.raises(UserError, match=r"^ray: not installed; rayfl supports ray>=2\.52,<3"):
        ray_compat.check_ray_version()


def test_the_installed_ray_is_read_from_its_metadata():
    from importlib.metadata import version

    assert ray_compat.installed_ray_version() == version("ray")
    ray_compat.check_ray_version()  # the Ray the suite runs on is a supported one


@pytest.mark.parametrize("command", [["run"], ["tune"], ["compare", "--algos", "fedavg,local"]])
def test_the_commands_that_start_ray_refuse_an_unsupported_ray_before_anything(command, monkeypatch, tmp_path,
                                                                                capsys):
    import rayfl.api
    import rayfl.session

    monkeypatch.setattr(ray_compat, "installed_ray_version", lambda: "3.1.0")
    monkeypatch.setattr(rayfl.session, "init_ray", lambda *a: pytest.fail("Ray started"))
    monkeypatch.setattr(rayfl.session, "start_ray", lambda *a: pytest.fail("Ray started"))
    argv = [*command, *TINY, "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "--out-dir", str(tmp_path / "runs")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("rayfl: error: ray==3.1.0: rayfl supports ray>=2.52,<3 (") and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()


def test_the_api_refuses_an_unsupported_ray_before_ray_starts(monkeypatch):
    import ray

    from rayfl.session import init_ray

    monkeypatch.setattr(ray_compat, "installed_ray_version", lambda: "2.40.0")
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init called"))
    before = dict(os.environ)
    with pytest.raises(UserError, match=r"^ray==2\.40\.0: rayfl supports ray>=2\.52,<3"):
        init_ray(None)
    assert dict(os.environ) == before


def test_a_ray_without_a_private_name_is_one_line_and_the_environment_is_restored(monkeypatch):
    """A supported version number whose private names moved: one line at start, not an AttributeError later."""
    import ray
    import ray._raylet

    from rayfl.session import init_ray

    monkeypatch.delattr(ray._raylet.AuthenticationTokenLoader, "reset_cache")
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init called"))
    before = dict(os.environ)
    with pytest.raises(UserError) as e:
        init_ray(None)
    text = str(e.value)
    assert text.startswith(f"ray=={ray_compat.installed_ray_version()}: rayfl supports ray>=2.52,<3 (this one "
                           f"lacks a private name rayfl uses: ") and "reset_cache" in text, text
    assert dict(os.environ) == before


def test_the_private_instance_options_are_what_ray_init_takes():
    import inspect

    import ray

    options = ray_compat.private_instance_options("127.0.0.1", 4 << 20)
    assert options == {"_node_ip_address": "127.0.0.1", "_system_config": {"max_direct_call_object_size": 4 << 20}}
    source = inspect.getsource(ray.init)  # taken from **kwargs (any other keyword is Ray's RuntimeError)
    assert all(f'kwargs.pop("{key}"' in source for key in options), sorted(options)


PRIVATE = re.compile(r"ray\._private|ray\._raylet|ray\._common|_global_node|_system_config|(?<!get)_node_ip_address|"
                     r"_internal_kv|authentication_test_utils")


def test_ray_private_names_appear_only_in_ray_compat():
    """Every other rayfl module goes through rayfl.ray_compat (its Ray-facing code and the engine's actors)."""
    users = []
    for folder in ("rayfl", "actors"):
        for here, _, names in os.walk(ROOT / folder):
            for name in names:
                path = Path(here) / name
                if name.endswith(".py") and path != ROOT / "rayfl" / "ray_compat.py":
                    users += [f"{path.relative_to(ROOT)}:{i}" for i, line in
                              enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if PRIVATE.search(line)]
    assert users == []
    assert PRIVATE.search((ROOT / "rayfl" / "ray_compat.py").read_text())  # the pattern finds what it looks for


def test_search_optuna_without_optuna_names_the_extra(monkeypatch, tmp_path, capsys):
    import rayfl.session
    from rayfl.sweep.search import _search_alg

    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError, as when not installed
    with pytest.raises(UserError) as e:
        _search_alg("optuna", 0, 1, "val_acc_mean", "max")
    assert "pip install 'rayfl[optuna]'" in str(e.value)
    monkeypatch.setattr(rayfl.session, "init_ray", lambda *a: pytest.fail("Ray started"))
    argv = ["tune", "--search", "optuna", *TINY, "--tracking-uri", f"sqlite:///{tmp_path}/m.db",
            "--out-dir", str(tmp_path / "runs")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--search optuna: optuna is not installed (`pip install 'rayfl[optuna]'`" in err
