"""constraints.txt pins the versions the suite passes with: what is installed here satisfies it, every
distribution rayfl's requirements pull in is pinned there, and pyproject.toml's ranges admit every pin."""

from __future__ import annotations

import importlib.util
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def pins(path: Path = ROOT / "constraints.txt") -> dict[str, Requirement]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert canonicalize_name(req.name) not in found, f"{req.name} pinned twice"
            found[canonicalize_name(req.name)] = req
    return found


def pinned_version(req: Requirement) -> Version:
    [spec] = req.specifier
    assert spec.operator == "==" and "*" not in spec.version, f"{req}: a constraint pins one version"
    return Version(spec.version)


def unsatisfied(constraints: dict[str, Requirement]) -> list[str]:
    """``name: installed X, constraints.txt says Y`` for each installed distribution whose pin it misses (a pin
    for a distribution not installed here, another platform's or an extra's, constrains nothing)."""
    wrong = []
    for name, req in constraints.items():
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue
        if not req.specifier.contains(installed, prereleases=True):
            wrong.append(f"{req.name}: installed {installed}, constraints.txt says {req.specifier}")
    return wrong


def test_the_installed_versions_satisfy_the_constraints():
    constraints = pins()
    assert {"ray", "torch", "torchvision", "mlflow", "numpy", "pandas", "opacus", "scikit-learn", "pyyaml",
            "matplotlib", "psutil", "threadpoolctl", "pytest", "pytest-xdist", "jsonschema", "optuna"} <= set(constraints)
    assert str(constraints["torch"].specifier) == "==2.14.1" and str(constraints["torchvision"].specifier) == "==0.29.1"
    assert unsatisfied(constraints) == []


def test_a_version_other_than_the_pinned_one_is_reported(tmp_path):
    """The check can fail: ray pinned one patch release above the installed one."""
    ray = Version(version("ray"))
    other = tmp_path / "constraints.txt"
    other.write_text(f"# a comment\nray=={ray.major}.{ray.minor}.{ray.micro + 1}\nno-such-distribution==1.0\n")
    assert unsatisfied(pins(other)) == [f"ray: installed {version('ray')}, constraints.txt says "
                                        f"=={ray.major}.{ray.minor}.{ray.micro + 1}"]


def test_every_distribution_rayfl_pulls_in_is_pinned():
    """A new dependency (or a new dependency of a dependency) is added to constraints.txt too: regenerate it with
    .ci/constraints.py, which walks the same requirements."""
    spec = importlib.util.spec_from_file_location("freeze_constraints", ROOT / ".ci" / "constraints.py")
    freeze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(freeze)
    pulled = freeze.closure()
    assert {"ray", "torch", "mlflow", "numpy", "pandas", "opacus", "grpcio", "sqlalchemy"} <= set(pulled)
    assert sorted(set(pulled) - set(pins())) == []


def test_pyproject_ranges_admit_every_pin_and_bound_the_next_major():
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    constraints = pins()
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra, reqs in project["optional-dependencies"].items() if extra != "bench"
                     for r in reqs]
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in constraints, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pinned_version(constraints[name]), prereleases=True), (str(req), constraints[name])
    bounded = {canonicalize_name(r.name): r.specifier for r in requirements}
    for name in ("ray", "torch", "torchvision", "mlflow", "numpy", "pandas", "opacus", "optuna"):
        pinned = pinned_version(constraints[name])
        assert not bounded[name].contains(f"{pinned.major + 1}.0.0", prereleases=True), (name, str(bounded[name]))


def test_the_run_time_ray_range_is_pyprojects():
    from rayfl.ray_compat import SUPPORTED, check_ray_version

    with open(ROOT / "pyproject.toml", "rb") as f:
        [ray] = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"] if r.startswith("ray")]
    assert ray.specifier == SpecifierSet(SUPPORTED)
    check_ray_version(str(pinned_version(pins()["ray"])))
