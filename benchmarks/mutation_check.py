"""Mutation testing of rayfl/algorithms/: does a one-token change to an algorithm make its unit tests fail?

Each mutant is ONE small change to one module (an operator or a constant swapped, a sign dropped), made by
rewriting the module's syntax tree and applied to a private copy of the source tree, never to this one.
The algorithm's own unit tests (Ray-free, ``LocalRuntime``) then run in that copy under a timeout; a
mutant is *killed* when they fail (or time out), *survives* when they pass. Run outside CI:

    .venv/bin/python benchmarks/mutation_check.py                 # a seeded sample, a few minutes
    .venv/bin/python benchmarks/mutation_check.py --all --jobs 2  # every mutant (much longer)
    .venv/bin/python benchmarks/mutation_check.py --module fedfomo --list

Survivors are printed with their line so that a person can judge whether each is equivalent (the same
behaviour, e.g. ``<`` vs ``<=`` where equality cannot happen) or a hole in the tests.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# module -> its unit tests (no Ray: every test here runs the algorithms in one process)
TESTS = {
    "baselines": ["tests/unit/test_baselines.py", "tests/unit/test_loop.py"],
    "fedfomo": ["tests/unit/test_fedfomo.py"],
    "federico": ["tests/unit/test_federico.py"],
    "usercentric": ["tests/unit/test_usercentric.py"],
    "fedmoe": ["tests/unit/test_fedmoe.py"],
    "persfl": ["tests/unit/test_persfl.py"],
    "layers": ["tests/unit/test_layers.py"],
    "fedprox": ["tests/unit/test_fedprox.py"],
    "fedavg_data": ["tests/unit/test_fedavg_data.py"],
    "oracle": ["tests/unit/test_oracle.py"],
    "lgfedavg": ["tests/unit/test_lgfedavg.py"],
    "fedper": ["tests/unit/test_fedper.py"],
    "perfedavg": ["tests/unit/test_perfedavg.py"],
    "pfedme": ["tests/unit/test_pfedme.py"],
    "mocha": ["tests/unit/test_mocha.py"],
    "cfl": ["tests/unit/test_cfl.py"],
    "fedem": ["tests/unit/test_fedem.py"],
}
BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
          ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # the index-th mutation point of the module, in tree-walk order
    line: int
    what: str


def _docstring_ids(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.add(id(body[0].value))
    return out


def mutation_points(tree: ast.AST) -> list[tuple[ast.AST, str, callable]]:
    """(node, description, apply) for every place one token can be changed."""
    points = []
    skip = _docstring_ids(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
            new = BINOPS[type(node.op)]
            points.append((node, f"{type(node.op).__name__} -> {new.__name__}",
                           lambda n=node, new=new: setattr(n, "op", new())))
        elif isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in CMPOPS:
                    new = CMPOPS[type(op)]
                    points.append((node, f"{type(op).__name__} -> {new.__name__}",
                                   lambda n=node, k=k, new=new: n.ops.__setitem__(k, new())))
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            points.append((node, f"{type(node.op).__name__} -> {new.__name__}",
                           lambda n=node, new=new: setattr(n, "op", new())))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            points.append((node, f"drop {type(node.op).__name__}",  # `drop Not` is done in mutated_source
                           lambda n=node: setattr(n, "op", ast.UAdd()) if isinstance(n.op, ast.USub) else None))
        elif isinstance(node, ast.Constant) and id(node) not in skip:
            v = node.value
            if isinstance(v, bool):
                points.append((node, f"{v} -> {not v}", lambda n=node: setattr(n, "value", not n.value)))
            elif isinstance(v, int):
                new = 1 if v == 0 else (0 if v == 1 else v + 1)
                points.append((node, f"{v} -> {new}", lambda n=node, new=new: setattr(n, "value", new)))
            elif isinstance(v, float):
                new = 1.0 if v == 0 else (0.0 if v == 1 else v * 2)
                points.append((node, f"{v} -> {new}", lambda n=node, new=new: setattr(n, "value", new)))
    return points


def mutants(module: str) -> list[Mutant]:
    src = (ROOT / "rayfl" / "algorithms" / f"{module}.py").read_text()
    return [Mutant(module, i, getattr(node, "lineno", 0), what)
            for i, (node, what, _) in enumerate(mutation_points(ast.parse(src)))]


def mutated_source(m: Mutant) -> str:
    tree = ast.parse((ROOT / "rayfl" / "algorithms" / f"{m.module}.py").read_text())
    points = mutation_points(tree)
    node, what, apply = points[m.index]
    if what == "drop Not":  # replace `not x` by `x` in its parent
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, node.operand)
                elif isinstance(value, list) and any(v is node for v in value):
                    value[[i for i, v in enumerate(value) if v is node][0]] = node.operand
    else:
        apply()
    return ast.unparse(ast.fix_missing_locations(tree))


def make_copy() -> Path:
    work = Path(tempfile.mkdtemp(prefix="rayfl-mut-"))
    shutil.copytree(ROOT / "rayfl", work / "rayfl", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "actors", work / "actors", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml",):
        if (ROOT / f).exists():
            shutil.copy(ROOT / f, work / f)
    return work


def run_tests(work: Path, module: str, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS[module]]
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if r.returncode == 0 else "killed"


def check(m: Mutant, timeout: float) -> tuple[Mutant, str]:
    work = make_copy()
    try:
        try:
            src = mutated_source(m)
            compile(src, m.module, "exec")
        except (SyntaxError, ValueError, TypeError):
            return m, "invalid"
        (work / "rayfl" / "algorithms" / f"{m.module}.py").write_text(src)
        return m, run_tests(work, m.module, timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", choices=sorted(TESTS), help="only these modules (repeatable)")
    ap.add_argument("--sample", type=int, default=60, help="mutants drawn at random over all modules (seeded)")
    ap.add_argument("--all", action="store_true", help="every mutant instead of a sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run (timeout = killed)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    pool = [m for mod in (args.module or sorted(TESTS)) for m in mutants(mod)]
    if not args.all and args.sample < len(pool):
        pool = sorted(random.Random(args.seed).sample(pool, args.sample), key=lambda m: (m.module, m.index))
    if args.list:
        for m in pool:
            print(f"{m.module}.py:{m.line}: {m.what}")
        return 0
    print(f"{len(pool)} mutants", flush=True)
    results = []
    with ThreadPoolExecutor(args.jobs) as ex:
        for m, outcome in ex.map(lambda m: check(m, args.timeout), pool):
            results.append((m, outcome))
            print(f"{outcome:9s} {m.module}.py:{m.line}: {m.what}", flush=True)
    valid = [r for r in results if r[1] != "invalid"]
    killed = sum(r[1] in ("killed", "timeout") for r in valid)
    print(f"\nkill rate: {killed}/{len(valid)} = {killed / max(len(valid), 1):.1%} "
          f"({len(results) - len(valid)} invalid mutants left out)")
    for m, outcome in results:
        if outcome == "survived":
            print(f"SURVIVED {m.module}.py:{m.line}: {m.what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
