"""Plugins: algorithms, datasets and models from outside the package, each a built-in's equal.

A plugin is a ``.py`` file or a dotted module name that defines ``ALGORITHM``, ``DATASET`` or ``MODEL`` (or the
lists ``ALGORITHMS``, ``DATASETS``, ``MODELS``). They are loaded, in this order, from: the entry points of
installed packages (groups ``rayfl.algorithms``, ``rayfl.datasets``, ``rayfl.models``), ``$RAYFL_PLUGINS``
(paths or module names separated by ``os.pathsep``), and ``--plugin`` / ``plugins=[...]``. Everything is checked
as it is registered: a mistake is one line before Ray starts.

Ray runs the work in other processes. What was registered here travels with the run (:func:`carried`, inside
what the driver, the client actors and a sweep's trials receive) and is registered there when it arrives; a
module loaded from a file is not importable there, so its classes are pickled by value, and so are the modules
this process imported from a plugin's folder (its helpers: a plugin file's folder is put on ``sys.path`` as a
script's is). The actors' arguments travel :class:`Sealed`: a module a node still lacks (imported from
elsewhere) is one line naming it and the node, from the actor's first call, not an actor that dies while Ray
reads its arguments. A run directory records which plugins were loaded (paths and module names, never code),
for ``--resume``, which imports none of them: they must be given again (:func:`write_record`,
:func:`rayfl.resume.check_recorded_plugins`); :func:`loaded_sources` is the list a cluster's runtime
environment would ship.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import re
import sys
import types
from typing import Any, Iterable

from rayfl import algorithms as registry
from rayfl.user_input import UserError

ENV = "RAYFL_PLUGINS"
RECORD = "plugins.yaml"  # in a run directory, beside config.yaml
# what a plugin module may define, per kind, and the function of rayfl that registers one
KINDS = {"algorithm": ("ALGORITHM", "ALGORITHMS"), "dataset": ("DATASET", "DATASETS"), "model": ("MODEL", "MODELS")}
REGISTERS = {"dataset": ("rayfl.data.datasets", "register_dataset"), "model": ("rayfl.models", "register_model")}
ENTRY_POINT_GROUPS = {"dataset": "rayfl.datasets", "model": "rayfl.models"}  # algorithms: the registry reads its own
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")

_loaded: dict[str, dict] = {}  # source (an absolute path or a module name) -> {"module", "algorithms"}
_entry_points = {"read": False}


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def add_plugin_argument(parser) -> None:
    """``--plugin FILE_OR_MODULE`` (repeatable) on a subcommand; :func:`load_plugins` loads what it gives."""
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                        help=f"a .py file or a dotted module defining ALGORITHM, DATASET or MODEL (or lists "
                             f"ALGORITHMS, ...), loaded before anything else; repeatable (also ${ENV})")


def register_algorithm(algorithm: Any) -> list[str]:
    """Make an algorithm known by name to run, tune, compare and ``rayfl algos``: an
    ``Algorithm(name, Params, Server, ClientLogic, ...)`` as the built-in modules make (or a list of them, or a
    module defining ``ALGORITHM`` / ``ALGORITHMS``). It is checked against the contract of
    :mod:`rayfl.algorithms.base` now (:class:`rayfl.UserError` naming what is wrong); a name taken by a built-in
    or another registered algorithm is refused, the same object registered again is fine. Returns the names."""
    module = algorithm if isinstance(algorithm, types.ModuleType) else None
    source = _source_of(module) if module is not None else None
    return registry.register_algorithm(algorithm, source=source or _python_source(algorithm))


def load_plugins(sources: Iterable[str] | str | None = None, env: bool = True) -> list[str]:
    """The entry points (once per process), then ``$RAYFL_PLUGINS`` (unless ``env`` is False), then ``sources``;
    a source loaded before is not loaded again. Returns the sources given, as loaded (absolute paths)."""
    read_entry_points()
    if env:
        for source in env_sources():
            load_plugin(source, origin=ENV)
    return [load_plugin(source) for source in as_sources(sources)]


def as_sources(value: Any, name: str = "plugins") -> list[str]:
    """``plugins=`` as given to the Python API: a path or module name, or a list of them."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, os.PathLike)) for v in value):
        raise UserError(f"{name}={_shown(value)}: a list of plugin files (.py) or module names")
    return [os.fspath(v) for v in value]


def env_sources() -> list[str]:
    return [s.strip() for s in os.environ.get(ENV, "").split(os.pathsep) if s.strip()]


def load_plugin(source: str, origin: str = "plugin") -> str:
    """Import one plugin (a ``.py`` file or a dotted module name) and register what it defines; returns its
    key (the file's absolute path, or the module name). ``origin`` names where it was given, for errors."""
    what = f"{origin}={_shown(source, 400)}" if origin == "plugin" else f"{origin} entry {_shown(source, 400)}"
    before = set(registry.registered_algorithms())  # a module may register its algorithms as it is imported
    key, module = _import(source, what)
    if key in _loaded:
        return key
    found = {kind: _objects(module, names) for kind, names in KINDS.items()}
    try:
        names = registry.register_algorithm(found["algorithm"], source=key) if found["algorithm"] else []
        for kind in ("dataset", "model"):
            for obj in found[kind]:
                _register(kind, obj)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None
    for name in registry.registered_algorithms():
        if name not in before and name not in names:
            registry.note_source(name, key)  # registered by the module itself: it came from this plugin
            names.append(name)
    if not any(found.values()) and not names:
        raise UserError(f"{what}: defines none of {', '.join(n for pair in KINDS.values() for n in pair)}")
    _loaded[key] = {"module": module, "algorithms": names}
    return key


def _import(source: str, what: str) -> tuple[str, types.ModuleType]:
    """(key, module): a file imported under a name of its own (the same file always the same module), or a
    module imported from ``sys.path``. A failing import is one line with its message, not a traceback."""
    text = str(source).strip()
    if not text or "\0" in text:
        raise UserError(f"{what}: a plugin is a .py file or a dotted module name")
    is_path = text.endswith(".py") or os.sep in text or "/" in text or not MODULE_NAME.match(text)
    if is_path:
        path = os.path.abspath(os.path.expanduser(text))
        if not os.path.exists(path):
            raise UserError(f"{what}: no such file (a plugin is a .py file or a dotted module name)")
        if not os.path.isfile(path) or not path.endswith(".py"):
            raise UserError(f"{what}: not a .py file (a plugin is a .py file or a dotted module name)")
        if path in _loaded:
            return path, _loaded[path]["module"]
        stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        name = f"rayfl_plugin_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
        folder = os.path.dirname(path)
        if folder not in sys.path:  # its sibling modules import as they would beside a script
            sys.path.insert(0, folder)
            importlib.invalidate_caches()
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name while it runs
        try:
            with _import_guard(what):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        module.__rayfl_plugin__ = path
        return path, module
    if text in _loaded:
        return text, _loaded[text]["module"]
    try:
        with _import_guard(what, module=text):
            module = importlib.import_module(text)
    except _NotFound:
        raise UserError(f"{what}: no such file or module (a plugin is a .py file, or a dotted module name "
                        f"importable from sys.path)") from None
    module.__rayfl_plugin__ = text
    return text, module


SLOW_IMPORT_S = 5.0  # an import still going after this long is announced (it may be waiting on something)


class _NotFound(Exception):
    pass


class _ExitCalled(BaseException):
    def __init__(self, code):
        super().__init__(f"os._exit({code})")


@contextlib.contextmanager
def _import_guard(what: str, module: str = ""):
    """Importing a plugin: whatever it raises, an exit included (``sys.exit``, ``os._exit`` while it imports, a
    KeyboardInterrupt), is one line naming it; an import still going after SLOW_IMPORT_S is announced."""
    import threading

    timer = threading.Timer(SLOW_IMPORT_S, lambda: print(f"rayfl: importing {what} is taking more than "
                                                         f"{SLOW_IMPORT_S:g} s ...", file=sys.stderr, flush=True))
    timer.daemon = True
    real_exit = os._exit

    def refuse_exit(code=0):
        raise _ExitCalled(code)

    os._exit = refuse_exit
    timer.start()
    try:
        yield
    except ModuleNotFoundError as e:
        if module and e.name and (module == e.name or module.startswith(e.name + ".")):
            raise _NotFound() from None  # the module itself, not one it imports
        raise UserError(f"{what}: importing it failed: {_first_line(e)}") from None
    except (SystemExit, _ExitCalled) as e:
        call = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else str(e)
        raise UserError(f"{what}: importing it called {call}; a plugin must define its algorithms, datasets or "
                        f"models, not end the program") from None
    except BaseException as e:  # noqa: BLE001 - whatever the file raises, a KeyboardInterrupt included: one line
        if isinstance(e, UserError):
            raise
        raise UserError(f"{what}: importing it failed: {_first_line(e)}") from None
    finally:
        timer.cancel()
        os._exit = real_exit


def _objects(module: types.ModuleType, names: tuple[str, str]) -> list:
    one, many = names
    try:
        out = [getattr(module, one)] if hasattr(module, one) else []
        listed = getattr(module, many, None)
    except Exception as e:  # noqa: BLE001 - a module __getattr__ that raises: one line naming the plugin
        raise UserError(f"plugin {_source_of(module) or module.__name__}: reading {one} / {many} from it raised "
                        f"{_first_line(e)}") from None
    if listed is not None:
        if not isinstance(listed, (list, tuple)):
            raise UserError(f"plugin {_source_of(module)}: {many} must be a list")
        out += list(listed)
    return out


def _register(kind: str, obj: Any) -> None:
    """A dataset or model, through the function of rayfl that registers one (``register_dataset``,
    ``register_model``)."""
    module, function = REGISTERS[kind]
    register = getattr(importlib.import_module(module), function, None)
    if register is None:
        raise UserError(f"this rayfl cannot register a {kind} ({module}.{function} is missing)")
    try:
        register(obj)
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from None


def read_entry_points() -> None:
    """Once per process: every entry point of the groups ``rayfl.algorithms`` (through the registry, which reads
    it on its first use anyway), ``rayfl.datasets`` and ``rayfl.models``."""
    registry.algorithm_names()
    if _entry_points["read"]:
        return
    from importlib.metadata import entry_points

    for kind, group in ENTRY_POINT_GROUPS.items():
        for ep in entry_points(group=group):
            where = f"entry point {ep.name} = {ep.value} (group {group})"
            try:
                obj = ep.load()
            except Exception as e:  # noqa: BLE001
                raise UserError(f"{where}: importing it failed: {_first_line(e)}") from None
            objs = _objects(obj, KINDS[kind]) if isinstance(obj, types.ModuleType) else (
                list(obj) if isinstance(obj, (list, tuple)) else [obj])
            try:
                for item in objs:
                    _register(kind, item)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
    _entry_points["read"] = True


def loaded_sources() -> list[str]:
    """The plugins this process loaded, as given (absolute paths, module names), in order: what a run
    directory records and a cluster's workers would need shipped."""
    return list(_loaded)


def _source_of(module: types.ModuleType | None) -> str | None:
    return getattr(module, "__rayfl_plugin__", None) if module is not None else None


def _python_source(obj: Any) -> str:
    """Where an algorithm registered from Python came from: ``python:MODULE`` of its Server class."""
    from rayfl.algorithms import algorithms_in

    algos = algorithms_in(obj)
    return f"python:{algos[0].Server.__module__}" if algos else "python"


# --------------------------------------------------------------------------------------------------
# Travelling to Ray workers
# --------------------------------------------------------------------------------------------------
class Plugins:
    """The registrations of the submitting process, as they travel to the processes Ray runs work in. Unpickled
    there, they register themselves (before anything in that process looks a name up): Ray re-creates a
    restarted actor from its arguments, so a restarted actor has them again too."""

    def __init__(self, algorithms: dict, algorithm_sources: dict, datasets: dict, models: dict, sources: list):
        self.algorithms, self.algorithm_sources = algorithms, algorithm_sources
        self.datasets, self.models, self.sources = datasets, models, sources

    def __bool__(self) -> bool:
        return bool(self.algorithms or self.datasets or self.models)

    def __repr__(self) -> str:
        return (f"Plugins(algorithms={sorted(self.algorithms)}, datasets={sorted(self.datasets)}, "
                f"models={sorted(self.models)}, sources={self.sources})")

    def __reduce__(self):
        return _arrive, (self.algorithms, self.algorithm_sources, self.datasets, self.models, self.sources)

    def install(self) -> None:
        registry.adopt(self.algorithms.values(), self.algorithm_sources)
        for module, registered in (("rayfl.data.datasets", self.datasets), ("rayfl.models", self.models)):
            if registered:  # (importing rayfl.models imports torch: only when there is something to restore)
                importlib.import_module(module).restore(registered)


def _arrive(algorithms: dict, algorithm_sources: dict, datasets: dict, models: dict, sources: list) -> Plugins:
    plugins = Plugins(algorithms, algorithm_sources, datasets, models, sources)
    plugins.install()
    return plugins


def carried() -> Plugins:
    """This process's registrations, ready to travel: the registered algorithms, datasets and models, with the
    modules that are not importable by name elsewhere (a plugin file, a module found only on this process's
    ``sys.path``) marked for pickling by value."""
    algos = registry.registered_algorithms()
    sources = {n: registry.algorithm_source(n) for n in algos if registry.algorithm_source(n)}
    # a registry that was never imported holds nothing (and importing rayfl.models would import torch)
    datasets = _registered("rayfl.data.datasets")
    models = _registered("rayfl.models")
    modules = {info["module"].__name__ for info in _loaded.values()} | set(_siblings())
    for algo in algos.values():
        modules.update(c.__module__ for c in (algo.Params, algo.Server, algo.ClientLogic) if _not_findable(c.__module__))
    for obj in [*datasets.values(), *models.values()]:
        for part in (obj, getattr(obj, "load", None), getattr(obj, "factory", None)):
            name = getattr(part, "__module__", None)
            if name and name in sys.modules and _not_findable(name):
                modules.add(name)
    _by_value(sorted(modules))
    return Plugins(algos, sources, datasets, models, loaded_sources())


def _plugin_folders() -> set[str]:
    """The folders the loaded plugins came from: a file's own folder; for a module, the ``sys.path`` entry
    that holds its top-level package."""
    folders = set()
    for key in _loaded:
        if os.path.isabs(key):
            folders.add(os.path.dirname(os.path.realpath(key)))
            continue
        file = getattr(sys.modules.get(key.split(".")[0]), "__file__", None)
        if file:  # (a namespace package has none)
            file = os.path.realpath(file)
            folder = os.path.dirname(file)
            folders.add(os.path.dirname(folder) if os.path.basename(file) == "__init__.py" else folder)
    return folders


def _siblings() -> list[str]:
    """Modules this process imported from a plugin's folder (its helpers), neither rayfl nor installed: they
    travel by value with the plugin, since the workers' disks do not have that folder."""
    folders = _plugin_folders()
    if not folders:  # no plugin loaded: nothing is its helper (and the walk over every module costs seconds)
        return []
    out = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or not _not_findable(name):
            continue
        real = os.path.realpath(file)
        if any(real.startswith(folder + os.sep) for folder in folders):
            out.append(name)
    return out


def _registered(module: str) -> dict:
    if module not in sys.modules:
        return {}
    registered = getattr(sys.modules[module], "registered", None)
    return dict(registered()) if registered else {}


def _not_findable(name: str) -> bool:
    """A module that a Ray worker may not import by name: one not installed (a plugin file's own name, a module
    found on a ``sys.path`` entry this process added or on ``$PYTHONPATH``: a worker's path holds the installed
    packages, the submitter's working directory and script directory only). ``__main__`` is pickled by value
    anyway; rayfl and installed packages are imported."""
    module = sys.modules.get(name)
    if module is None or name == "__main__" or name.split(".")[0] == "rayfl":
        return False
    file = getattr(module, "__file__", None)
    if not file:
        return False  # built in, or a namespace package
    file = os.path.realpath(file)
    return not any(file.startswith(folder + os.sep) for folder in _installed_folders())


@functools.lru_cache(maxsize=1)
def _installed_folders() -> tuple[str, ...]:
    """Where the standard library and installed packages live (read once: sysconfig expands its templates anew
    on every call, a millisecond each, and a process holds a thousand modules)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}))


class Sealed:
    """A value that travels pickled apart, so that a module it needs and the receiving node lacks is one line
    naming the module and the node when it is opened (:meth:`open`, in a method of the actor that got it), not
    an actor that dies while Ray reads its arguments (and is started again, to die the same way)."""

    def __init__(self, value: Any):
        self.value = value

    def __reduce__(self):
        from ray import cloudpickle

        return _unseal, (cloudpickle.dumps(self.value), loaded_sources())

    def open(self) -> Any:
        return self.value


class Unreadable:
    """A :class:`Sealed` value whose unpickling failed on this node: :meth:`open` says why, in one line."""

    def __init__(self, error: BaseException, sources: list[str]):
        import socket

        self.missing = getattr(error, "name", None)
        self.detail, self.sources, self.node = _first_line(error), sources, socket.gethostname()
        try:
            import ray

            self.node = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray: the host name
            pass

    def open(self) -> Any:
        what = f"plugin={self.sources!r}" if self.sources else "run"
        if self.missing:
            raise UserError(f"{what}: module {self.missing!r} is not importable on node {self.node} ({self.detail}); "
                            f"put it in the plugin's folder (which travels with the run) or install it on every node")
        raise UserError(f"{what}: cannot be read on node {self.node} ({self.detail})")


def _unseal(blob: bytes, sources: list[str]) -> Sealed | Unreadable:
    from ray import cloudpickle

    try:
        return Sealed(cloudpickle.loads(blob))
    except Exception as e:  # noqa: BLE001 - an import or attribute the node lacks: said when opened
        return Unreadable(e, sources)


def _by_value(modules: list[str]) -> None:
    if not modules:
        return
    from ray import cloudpickle

    for name in modules:
        if name in sys.modules and name != "__main__":
            cloudpickle.register_pickle_by_value(sys.modules[name])




# --------------------------------------------------------------------------------------------------
# A run directory's record, for --resume
# --------------------------------------------------------------------------------------------------
def write_record(run_dir: str, algo: str) -> None:
    """``plugins.yaml`` in a run directory: the plugins loaded when it started (paths, module names) and where
    its algorithm came from; nothing when it used only what is built in and installed."""
    import yaml

    entries = [{"source": key, "algorithms": info["algorithms"]} for key, info in _loaded.items()]
    source = registry.algorithm_source(algo)
    if source and source.startswith("python:"):
        entries.append({"source": source, "algorithms": [algo]})
    path = os.path.join(run_dir, RECORD)
    if not entries:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path, "w") as f:
        yaml.safe_dump({"plugins": entries}, f, sort_keys=False)


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
