"""The algorithm registry: the built-in modules in MODULES (each defines ``ALGORITHMS``, a list of Algorithm),
and algorithms registered from outside the package: :func:`register_algorithm` (what ``rayfl --plugin FILE``
and ``rayfl.register_algorithm`` end in, :mod:`rayfl.plugins`) and entry points in the group
``rayfl.algorithms`` of installed packages, read when the registry is first read.

A registered algorithm is checked against the contract of :mod:`rayfl.algorithms.base` when it is registered,
so that a mistake in it is one line before anything starts, not an error in an actor: :class:`AlgorithmError`,
a user error (the command's one line and exit status 2).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import TYPE_CHECKING, Any, Iterable

from rayfl.user_input import UserError

if TYPE_CHECKING:
    from rayfl.algorithms.base import Algorithm

MODULES = ("baselines", "fedfomo", "persfl", "federico", "usercentric", "fedmoe", "fedprox", "fedavg_data",
           "oracle", "lgfedavg", "fedper", "perfedavg", "pfedme", "mocha", "cfl", "fedem")
DEFAULT_ALGORITHM = "fedavg"  # what a config that names none runs
ENTRY_POINT_GROUP = "rayfl.algorithms"
# a name is a command-line value, a comparison's row label (``ALGO:KEY=VALUE``), a file name (tune_spaces/NAME.yaml)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\Z")

_registered: dict[str, "Algorithm"] = {}  # name -> algorithm registered from outside the package
_sources: dict[str, str] = {}  # name -> where it was registered from (a file, a module, an entry point)
_adopted: set[str] = set()  # names taken from the submitting process (adopt): they stand over entry points here
_entry_points = {"state": "unread"}  # unread | reading | read


class AlgorithmError(UserError, ValueError):
    """An algorithm that does not satisfy the contract, a name that clashes, or an entry point that fails."""


def _modules():
    """The algorithm modules, each imported only when reached: some import torch, which a driver running
    FedAvg never needs (about 2 s of its start-up)."""
    for mod in MODULES:
        try:
            yield importlib.import_module(f"rayfl.algorithms.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"rayfl.algorithms.{mod}":
                raise
            # not written yet


def builtin_algorithms() -> dict[str, "Algorithm"]:
    return {algo.name: algo for module in _modules() for algo in module.ALGORITHMS}


def _registry() -> dict[str, "Algorithm"]:
    _read_entry_points()
    return {**builtin_algorithms(), **_registered}


def algorithm_names() -> list[str]:
    return list(_registry())


def get_algorithm(name: str) -> "Algorithm":
    _read_entry_points()
    if name in _registered:
        return _registered[name]
    for module in _modules():
        for algo in module.ALGORITHMS:
            if algo.name == name:
                return algo
    raise KeyError(f"algo={name!r}: unknown; allowed: {', '.join(_registry())}")


def algorithm_source(name: str) -> str | None:
    """Where a registered algorithm came from (None: a built-in one)."""
    return _sources.get(name)


def registered_algorithms() -> dict[str, "Algorithm"]:
    """The algorithms registered from outside the package, by name (what travels to Ray workers)."""
    return dict(_registered)


# --------------------------------------------------------------------------------------------------
# Registering
# --------------------------------------------------------------------------------------------------
def algorithms_in(obj: Any) -> list["Algorithm"]:
    """The algorithms ``obj`` holds: an Algorithm, a list of them, or a module defining ``ALGORITHM`` or
    ``ALGORITHMS``."""
    import types

    from rayfl.algorithms.base import Algorithm

    if isinstance(obj, types.ModuleType):
        found = []
        if hasattr(obj, "ALGORITHM"):
            found.append(obj.ALGORITHM)
        found += list(getattr(obj, "ALGORITHMS", None) or [])
        if not found:
            raise AlgorithmError(f"module {obj.__name__!r} defines neither ALGORITHM nor ALGORITHMS")
        items = found
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        items = [obj]
    for item in items:
        if not isinstance(item, Algorithm):
            raise AlgorithmError(f"{_shown(item)}: not an algorithm; expected rayfl.algorithms.base.Algorithm("
                                 f"name, Params, Server, ClientLogic, ...), a list of them, or a module defining "
                                 f"ALGORITHM or ALGORITHMS")
    return items


def register_algorithm(obj: Any, source: str | None = None) -> list[str]:
    """Register the algorithms ``obj`` holds (see :func:`algorithms_in`), each checked against the contract and
    against the names taken (a built-in's, another registered one's; registering the same object again is
    fine). All or none: a bad one leaves the registry as it was. Returns their names."""
    algos = algorithms_in(obj)
    _read_entry_points()
    taken = builtin_algorithms()
    new = []
    for algo in algos:
        check_algorithm(algo)
        if algo.name in taken:
            raise AlgorithmError(f"algo={algo.name!r}: already the name of a built-in algorithm; give yours "
                                 f"another name")
        if _registered.get(algo.name) is algo or any(a is algo for a in new) or algo.name in _adopted:
            continue
        if algo.name in _registered or any(a.name == algo.name for a in new):
            where = _sources.get(algo.name) or source
            raise AlgorithmError(f"algo={algo.name!r}: already registered" + (f" (from {where})" if where else "")
                                 + "; give yours another name")
        new.append(algo)
    for algo in new:
        _registered[algo.name] = algo
        if source:
            _sources[algo.name] = source
    return [a.name for a in algos]


def adopt(algos: Iterable["Algorithm"], sources: dict[str, str] | None = None) -> None:
    """Take algorithms already checked in the process that submitted the work (a Ray worker receiving them):
    the submitter's algorithm replaces one of the same name left from other work in this process, or read from
    an entry point here (the same code, imported rather than unpickled)."""
    for algo in algos:
        old = _registered.get(algo.name)
        if old is not None and (old.Params, old.Server, old.ClientLogic) == (algo.Params, algo.Server,
                                                                            algo.ClientLogic):
            continue  # the same classes: this process's own registration (a copy of what it sent)
        _registered[algo.name] = algo
        _adopted.add(algo.name)
        if sources and algo.name in sources:
            _sources[algo.name] = sources[algo.name]


def note_source(name: str, source: str) -> None:
    """Record where a registered algorithm came from (a plugin whose module registered it as it was imported)."""
    if name in _registered:
        _sources[name] = source


def unregister_algorithm(name: str) -> None:
    """Forget a registered algorithm (a notebook that redefines one); built-in ones stay."""
    _registered.pop(name, None)
    _sources.pop(name, None)
    _adopted.discard(name)


def _read_entry_points() -> None:
    """Once per process: the algorithms that installed packages declare in the group ``rayfl.algorithms``
    (``name = package.module`` or ``package.module:ALGORITHM``). One that fails to load is an AlgorithmError each
    time the registry is read, naming it."""
    if _entry_points["state"] != "unread":
        return  # read, or being read (an entry point's module that itself reads the registry)
    from importlib.metadata import entry_points

    _entry_points["state"] = "reading"
    try:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            where = f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP})"
            try:
                obj = ep.load()
            except Exception as e:  # noqa: BLE001 - whatever the package raises, one line naming it
                raise AlgorithmError(f"{where}: importing it failed: {_first_line(e)}") from None
            try:
                register_algorithm(obj, source=f"entry point {ep.value}")
            except AlgorithmError as e:
                raise AlgorithmError(f"{where}: {e}") from None
    except BaseException:
        _entry_points["state"] = "unread"
        raise
    _entry_points["state"] = "read"


# --------------------------------------------------------------------------------------------------
# The contract, checked
# --------------------------------------------------------------------------------------------------
def check_algorithm(algo: "Algorithm") -> None:
    """Raise AlgorithmError naming the first way ``algo`` breaks the contract of :mod:`rayfl.algorithms.base`."""
    from rayfl.algorithms.base import ClientLogic, Matrix, Server

    name = algo.name
    if not isinstance(name, str) or not NAME.match(name):
        raise AlgorithmError(f"algo={_shown(name)}: an algorithm's name is letters, digits, '-' and '_' (starting "
                             f"with a letter or digit)")
    what = f"algo={name!r}"
    params = algo.Params
    if not isinstance(params, type) or not dataclasses.is_dataclass(params):
        raise AlgorithmError(f"{what}: Params={_shown(params)} is not a dataclass (its knobs are dataclass fields "
                             f"with defaults; rayfl.algorithms.base.NoParams for none)")
    for f in dataclasses.fields(params):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise AlgorithmError(f"{what}: Params field {f.name!r} has no default (every knob needs one: "
                                 f"a run that does not set it uses it)")
    if not callable(getattr(params, "check", None)):
        raise AlgorithmError(f"{what}: Params has no check(self, n_clients) method (raise ValueError for bad values)")
    if not (isinstance(algo.Server, type) and issubclass(algo.Server, Server)):
        raise AlgorithmError(f"{what}: Server={_shown(algo.Server)} is not a subclass of "
                             f"rayfl.algorithms.base.Server")
    if algo.Server.run_round is Server.run_round:
        raise AlgorithmError(f"{what}: Server {algo.Server.__name__} does not define run_round(self, stage, "
                             f"rnd, participants, call): one round, top to bottom")
    if not (isinstance(algo.ClientLogic, type) and issubclass(algo.ClientLogic, ClientLogic)):
        raise AlgorithmError(f"{what}: ClientLogic={_shown(algo.ClientLogic)} is not a subclass of "
                             f"rayfl.algorithms.base.ClientLogic")
    steps = [m for m in dir(algo.ClientLogic) if m.startswith("step_") and m != "step_evaluate"
             and callable(getattr(algo.ClientLogic, m))]
    if not steps:
        raise AlgorithmError(f"{what}: ClientLogic {algo.ClientLogic.__name__} defines no step_<name>(self, "
                             f"client, msg, models) method: the client steps its Server calls")
    knobs = {f.name for f in dataclasses.fields(params)}
    for key, implied in dict(algo.implies).items():
        for k in [key, *dict(implied)]:
            if k not in knobs:
                raise AlgorithmError(f"{what}: implies names {k!r}, not a knob of its Params (knobs: "
                                     f"{', '.join(sorted(knobs)) or 'none'})")
    for stage, suffix in dict(algo.compare_before).items():
        if not isinstance(stage, str) or not isinstance(suffix, str) or not NAME.match(suffix):
            raise AlgorithmError(f"{what}: compare_before={{{stage!r}: {suffix!r}}}: a stage name -> a row-label "
                                 f"suffix of letters, digits, '-' and '_'")
    for artifact, matrix in dict(algo.plots).items():
        if not isinstance(matrix, Matrix):
            raise AlgorithmError(f"{what}: plots[{artifact!r}]={_shown(matrix)}: expected "
                                 f"rayfl.algorithms.base.Matrix(title, ...)")
    for text in ("summary", "work"):
        if not isinstance(getattr(algo, text), str):
            raise AlgorithmError(f"{what}: {text}={_shown(getattr(algo, text))}: must be a string")


def _shown(value: Any) -> str:
    if isinstance(value, type):
        return f"class {value.__qualname__}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
