"""The algorithm contract is written in one place: every capability the platform reads is declared, with a
docstring, in rayfl/algorithms/base.py, and read only through its reader there."""

from __future__ import annotations

import ast
import os
import re

import pytest

from rayfl.algorithms import base
from rayfl.algorithms.base import CAPABILITIES, PROMISES, ClientLogic, Server, capability, declared

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sources():
    for folder in ("rayfl", "actors"):
        for here, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(here, name)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT), f.read()


def _documented_attributes(cls_name: str) -> dict[str, str]:
    """Class attribute -> the string literal right after it, in base.py's class ``cls_name``."""
    with open(base.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out = {}
    for first, second in zip(cls.body, cls.body[1:]):
        target = first.target if isinstance(first, ast.AnnAssign) else (
            first.targets[0] if isinstance(first, ast.Assign) else None)
        if isinstance(target, ast.Name) and isinstance(second, ast.Expr) and isinstance(second.value, ast.Constant) \
                and isinstance(second.value.value, str):
            out[target.id] = second.value.value
    return out


def test_every_capability_is_declared_with_a_docstring_on_its_base_class():
    for name, owner in CAPABILITIES.items():
        docs = _documented_attributes(owner.__name__)
        assert name in vars(owner), name
        assert docs.get(name, "").strip(), f"{owner.__name__}.{name} has no docstring"
    assert PROMISES <= set(CAPABILITIES)


def _direct_reads(text: str) -> list[int]:
    """Lines of ``text`` that read a capability other than through ``capability``: ``x.NAME``,
    ``getattr(x, "NAME")``, ``hasattr(x, "NAME")``, ``vars(x).get("NAME")``."""
    lines = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in CAPABILITIES and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value in CAPABILITIES
                                                for a in node.args):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name != "capability":
                lines.append(node.lineno)
    return lines


def test_the_platform_reads_capabilities_only_through_the_reader():
    found = [f"{path}:{no}" for path, text in _sources()
             if not path.startswith(os.path.join("rayfl", "algorithms"))  # they declare them; base.py reads them
             for no in _direct_reads(text)]
    assert not found, found


def test_the_direct_read_finder_finds_each_form():
    text = ("a = getattr(s, 'uses_holdout', False)\nb = s.growing_state\nc = vars(k).get('averages')\n"
            "d = capability(s, 'averages')\ne = 'ClientLogic.private_training'\n")
    assert sorted(_direct_reads(text)) == [1, 2, 3]


def test_capabilities_that_steer_the_platform_are_read_through_capability():
    used = set()
    for path, text in _sources():
        used |= set(re.findall(r"""capability\([^)]*["'](\w+)["']\)""", text))
    assert used <= set(CAPABILITIES), used - set(CAPABILITIES)
    assert {"averages", "growing_state", "client_ids", "private_training", "local_buffers", "uses_holdout"} <= used


def test_a_promise_is_not_inherited_and_a_plain_capability_is():
    class Child(ClientLogic):
        uses_holdout = True
        private_training = True
        local_buffers = True

    class GrandChild(Child):
        pass

    assert capability(GrandChild, "uses_holdout") is True  # inherited
    assert capability(GrandChild, "private_training") is None  # a promise: its own word only
    assert capability(GrandChild(None), "local_buffers") is False
    assert capability(Child(None), "private_training") is True
    assert declared(GrandChild, "uses_holdout") is None

    class Grows(Server):
        growing_state = ("tree",)

    class Sub(Grows):
        pass

    assert capability(Sub, "growing_state") == ("tree",)
    assert capability(Sub, "client_ids") == ()


def test_an_unknown_capability_is_an_error_not_a_no():
    with pytest.raises(KeyError):
        capability(ClientLogic, "uses_holdouts")


def _imports(path: str, top_level_only: bool) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_algorithms_share_helpers_through_common_not_through_each_other():
    """An algorithm module imports another only to extend that algorithm (FedAvg's server and client);
    helpers two algorithms share come from rayfl.algorithms.common."""
    folder = os.path.dirname(base.__file__)
    from rayfl.algorithms import MODULES

    for module in MODULES:
        path = os.path.join(folder, f"{module}.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayfl.algorithms."):
                other = node.module.rsplit(".", 1)[1]
                if other in ("base", "common", "layers"):
                    continue
                names = {a.name for a in node.names}
                assert other == "baselines" and names <= {"FedAvgClient", "FedAvgServer"}, (module, other, names)


def test_common_imports_no_torch_when_imported():
    """A driver running FedAvg imports baselines and so common: torch only inside the helpers that train."""
    path = os.path.join(os.path.dirname(base.__file__), "common.py")
    top = _imports(path, top_level_only=True)
    assert not {m for m in top if m.split(".")[0] == "torch" or m == "rayfl.training"}, top
    assert "torch" in _imports(path, top_level_only=False)


def test_algorithms_reach_privacy_through_its_public_api_only():
    from rayfl import privacy

    folder = os.path.dirname(base.__file__)
    used = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "privacy":
                used.setdefault(node.attr, set()).add(name)
            if isinstance(node, ast.ImportFrom) and node.module == "rayfl.privacy":
                used.update({a.name: {name} for a in node.names})
    assert set(used) <= set(privacy.FOR_ALGORITHMS), {k: v for k, v in used.items() if k not in privacy.FOR_ALGORITHMS}
    assert "private_gradients" in used and all(callable(getattr(privacy, n)) for n in privacy.FOR_ALGORITHMS)


def test_params_are_parsed_once_and_carried_to_the_server_and_every_host(monkeypatch):
    from conftest import tiny
    from rayfl.algorithms.base import Algorithm
    from rayfl.experiment import prepare
    from rayfl.loop import Loop
    from rayfl.runtime import LocalRuntime

    cfg = tiny(algo="fedprox", rounds=1, params={"mu": "0.25"})
    parsed = []
    make = Algorithm.make_params
    monkeypatch.setattr(Algorithm, "make_params", lambda self, values=None: parsed.append(values) or make(self, values))
    p = prepare(cfg)
    runtime = LocalRuntime(p, n_hosts=2)
    loop = Loop(p, runtime).run()
    assert len(parsed) == 1  # by cfg.check(), inside prepare
    assert p.params.mu == 0.25 and type(p.params).__name__ == "FedProxParams"
    assert loop.server.params is p.params
    assert all(host.logic.params is p.params for host in runtime.hosts) and len(runtime.hosts) == 2


def test_a_host_spec_carries_what_a_host_builds_from():
    from conftest import tiny
    from rayfl.experiment import HostSpec, prepare

    p = prepare(tiny(algo="fedavg", rounds=1))
    spec = p.host_spec()
    assert isinstance(spec, HostSpec)
    assert (spec.cfg, spec.algorithm, spec.params, spec.model_spec, spec.task) == (
        p.cfg, p.algorithm, p.params, p.model_spec, p.info.task)
    assert spec.x is p.dataset.x and spec.y is p.dataset.y and spec.initial is p.initial
    assert spec.holdout is p.federation.holdout
    light = spec.without_arrays()
    assert light.x is None and light.y is None and light.initial is None and light.holdout is spec.holdout
    assert light.with_arrays(spec.x, spec.y, spec.initial) == spec


def _string_keys(path: str, names: set[str]) -> set[str]:
    """Constant keys the module at ``path`` reads or writes on variables called one of ``names``
    (``up["x"]``, ``up.setdefault("x", ...)``, ``msg.get("x")``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in names \
                and node.args and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


def test_the_keys_a_host_reads_and_writes_are_declared_in_message_and_upload():
    from rayfl.algorithms.base import Message, Upload

    host = os.path.join(ROOT, "rayfl", "host.py")
    assert _string_keys(host, {"msg"}) == {"models"} <= Message.__optional_keys__
    written = _string_keys(host, {"up"})
    assert written == {"seconds", "dp_epsilon"} and written <= Upload.__optional_keys__
    for typed in (Message, Upload):
        docs = _documented_attributes(typed.__name__)
        assert set(docs) == set(typed.__optional_keys__) and all(d.strip() for d in docs.values())
    assert Upload.__optional_keys__ >= {"weights", "n"}  # what FedAvg's reduction reads


def test_the_architecture_page_names_files_that_exist_and_is_linked():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    paths = set(re.findall(r"`((?:rayfl|actors)/[\w/.]+)`", text))
    assert {"rayfl/loop.py", "rayfl/checkpoint.py", "rayfl/recovery.py", "rayfl/user_dp.py",
            "rayfl/algorithms/common.py", "rayfl/reduce.py"} <= paths
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, missing
    assert text.count("```text") == 1  # one picture
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "docs/architecture.md" in f.read()
