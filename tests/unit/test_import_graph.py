"""rayfl's modules import one another without a cycle, counting imports inside functions too.

An import moved into a function still runs: it only hides the cycle from whoever reads the module's head,
and the cycle comes back as a half-initialised module when the import order changes. The graph is built from
the source with ``ast`` (nothing is imported), over the packages pyproject.toml maps (``rayfl.actors`` lives
in the top-level ``actors/`` folder).
"""

from __future__ import annotations

import ast
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def package_dirs(root: str = ROOT) -> dict[str, str]:
    """Package name -> its folder: ``rayfl`` and what pyproject.toml's ``package-dir`` maps under it."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        mapped = tomllib.load(f).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    dirs = {"rayfl": os.path.join(root, "rayfl")}
    dirs.update({name: os.path.join(root, path) for name, path in mapped.items() if name.startswith("rayfl.")})
    return dirs


def module_files(dirs: dict[str, str]) -> dict[str, str]:
    """Module name -> source file, for every .py under each package folder."""
    files: dict[str, str] = {}
    for package, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        for here, subdirs, names in os.walk(folder, followlinks=True):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            rel = os.path.relpath(here, folder)
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in sorted(names):
                if name.endswith(".py"):
                    mod = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    files.setdefault(mod, os.path.join(here, name))
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The rayfl modules that ``module``'s source imports, anywhere in it (module level, functions, classes;
    ``from . import x``; ``importlib.import_module`` with a literal name, or an f-string whose literal
    prefix names a package: every module under it). Blocks under ``if TYPE_CHECKING:`` never run and are
    left out."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()

    def add(name: str) -> None:
        if name in known:
            out.add(name)
        # importing a.b.c runs a/__init__ and a/b/__init__ first: edges to those packages too, except the
        # ones this module sits in (they are being initialised already when it runs)
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known and not (module == parent or module.startswith(parent + ".")):
                out.add(parent)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base)  # a submodule, or a name from the package's __init__
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                prefix = str(arg.values[0].value)
                if prefix.endswith("."):
                    out.update(m for m in known if m.startswith(prefix))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(module)
    return out


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    files = module_files(package_dirs(root))
    known = set(files)
    graph = {}
    for mod, path in files.items():
        with open(path, encoding="utf-8") as f:
            graph[mod] = imported_names(mod, f.read(), path.endswith("__init__.py"), known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, within the component."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles among rayfl's modules:\n" + "\n".join(" -> ".join(c) for c in found)


# The command line's layer: the parser, the config flags, the subcommands' parsers. Below it (the API, the
# sweep and comparison runners, the engine) settings travel as keyword arguments and dataclasses.
COMMAND_LAYER = {"rayfl.cli", "rayfl.flags", "rayfl.sweep.command", "rayfl.comparison.command"}


def test_argparse_stays_in_the_command_layer():
    files = module_files(package_dirs())
    users = set()
    for mod, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "argparse" or n.startswith("argparse.") for n in names):
                users.add(mod)
    assert users and users <= COMMAND_LAYER, sorted(users - COMMAND_LAYER)


def test_every_package_folder_is_installed():
    """pyproject.toml lists its packages by hand (rayfl.actors lives outside rayfl/): every folder holding an
    __init__.py is listed, at the folder it maps to, and no symlink stands in for a mapping."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    dirs = package_dirs()
    found = {m for m, path in module_files(dirs).items() if path.endswith("__init__.py")}
    assert listed == found
    for name in listed:
        folder = dirs.get(name, os.path.join(ROOT, *name.split(".")))
        assert os.path.isfile(os.path.join(folder, "__init__.py")), name
    for here, subdirs, _ in os.walk(os.path.join(ROOT, "rayfl")):
        assert not [d for d in subdirs if os.path.islink(os.path.join(here, d))], here


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The parser finds what it must: a cycle closed by an import inside a function, by ``from . import``, by
    ``importlib.import_module`` with a literal, and the mapped rayfl.actors folder; a TYPE_CHECKING block
    closes none."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = {"rayfl.actors" = "actors"}\n')
    pkg, actors = tmp_path / "rayfl", tmp_path / "actors"
    pkg.mkdir(), actors.mkdir()
    (pkg / "__init__.py").write_text("")
    (actors / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from rayfl import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('rayfl.actors.d')\n")
    (actors / "d.py").write_text("def g():\n    import rayfl.c\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rayfl import f\n")
    (pkg / "f.py").write_text("from rayfl.e import x\n")
    # a package whose __init__ imports a module that imports what imports the package's other module
    (pkg / "g").mkdir()
    (pkg / "g" / "__init__.py").write_text("from rayfl.g.top import run\n")
    (pkg / "g" / "top.py").write_text("from rayfl.g import low\nfrom rayfl import h\n")
    (pkg / "g" / "low.py").write_text("")
    (pkg / "h.py").write_text("def f():\n    from rayfl.g.low import x\n")
    graph = import_graph(str(tmp_path))
    assert graph["rayfl.a"] == {"rayfl.b"} and graph["rayfl.b"] == {"rayfl.a"}
    assert graph["rayfl.actors.d"] == {"rayfl.c"} and graph["rayfl.e"] == set()
    assert graph["rayfl.g.top"] == {"rayfl.g.low", "rayfl.h"}  # rayfl.g is its own package: no edge
    assert graph["rayfl.h"] == {"rayfl.g", "rayfl.g.low"}  # rayfl.g's __init__ runs first
    assert sorted(cycles(graph)) == [["rayfl.a", "rayfl.b", "rayfl.a"],
                                     ["rayfl.actors.d", "rayfl.c", "rayfl.actors.d"],
                                     ["rayfl.g", "rayfl.g.top", "rayfl.h", "rayfl.g"]]


def mlflow_importers(dirs: dict[str, str] | None = None) -> set[str]:
    """The modules that import MLflow anywhere in their source (module level, functions, ``import_module`` or
    ``__import__`` with a literal name), found with ``ast`` (nothing is imported)."""
    def is_mlflow(name: str) -> bool:
        return name == "mlflow" or name.startswith("mlflow.")

    users = set()
    for mod, path in module_files(dirs or package_dirs()).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and (
                    _is_import_module(node.func) or (isinstance(node.func, ast.Name) and node.func.id == "__import__")):
                names = [str(node.args[0].value)]
            if any(is_mlflow(n) for n in names):
                users.add(mod)
    return users


def test_only_the_tracking_package_imports_mlflow():
    """MLflow is behind one port: every module that imports it is rayfl.tracking or below it."""
    users = mlflow_importers()
    outside = sorted(m for m in users if m != "rayfl.tracking" and not m.startswith("rayfl.tracking."))
    assert "rayfl.tracking.callback" in users and "rayfl.tracking.runs" in users  # the scan sees imports
    assert not outside, f"modules outside rayfl/tracking/ that import mlflow: {outside}"


def test_the_mlflow_scan_sees_every_way_of_importing_it(tmp_path):
    """Each form an import of MLflow can take is found, in a function too; a name that only starts with
    "mlflow" (``mlflow_hint``) or a relative import is not MLflow."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    forms = {"a": "import mlflow\n", "b": "def f():\n    from mlflow.entities import Metric\n",
             "c": "import importlib\nimportlib.import_module('mlflow.tracking')\n", "d": "__import__('mlflow')\n",
             "e": "import os, mlflow.tracking as t\n", "quiet": "from rayfl.progress import mlflow_hint\nimport mlflowx\n"}
    for name, source in forms.items():
        (pkg / f"{name}.py").write_text(source)
    assert mlflow_importers({"rayfl": str(pkg)}) == {"rayfl.a", "rayfl.b", "rayfl.c", "rayfl.d", "rayfl.e"}
