"""The platform names no algorithm: what it needs of one (knobs a sweep ties together, a stage a comparison
shows both ways, the captions of its matrices) the algorithm declares on its ``Algorithm``, so a user's own
algorithm gets everything a built-in one does. Outside ``rayfl/algorithms/`` (and the table of papers'
presets, whose rows are the papers' algorithms) no string literal and no identifier is an algorithm's name.
Comments and docstrings may name algorithms: they explain, they do not decide."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXEMPT = {os.path.join("rayfl", "algorithms"), os.path.join("rayfl", "comparison", "presets.py")}
# Platform words that happen to be an algorithm's name too: "local" is Ray's address of a private instance
# (``ray.init(address="local")``) and the comparison's in-process runtime (``runtime="local"``, ``--local``);
# the algorithm "local" (each client alone) is the one name this check cannot watch.
PLATFORM_WORDS = {"local"}


def platform_files() -> list[str]:
    """Every Python file of the platform (``rayfl.actors`` is the top-level ``actors/`` folder: read once, a
    link to it under rayfl/ skipped)."""
    out = []
    for top in ("rayfl", "actors"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(folder, ROOT)
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and os.path.join(rel, d) not in EXEMPT
                             and not os.path.islink(os.path.join(folder, d)))
            out += [os.path.join(rel, f) for f in sorted(files) if f.endswith(".py") and os.path.join(rel, f) not in EXEMPT]
    return out


def string_values(token: str) -> list[str]:
    """The text a string token holds: a plain literal's value, an f-string's literal parts."""
    node = ast.parse(token.strip(), mode="eval").body
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    return [v.value for v in ast.walk(node) if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def named(source: str, names: set[str], words: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, text) of each string literal or identifier in ``source`` that is one of ``names``: a literal whose
    whole value is the name, or a row label made from it (``"name:KEY=VALUE"``, ``"name-suffix"``); an identifier
    with the name's dashes as underscores. ``words``: names that are platform words too, not looked for. Comments and docstrings (a string that is a statement by itself) are skipped."""
    idents = {n.replace("-", "_") for n in names - set(words)}
    literal = re.compile(r"\s*(" + "|".join(re.escape(n) for n in sorted(names - set(words), key=len, reverse=True))
                         + r")([:-]|\s*\Z)") if names - set(words) else None
    hits = []
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL)]
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string in idents:
            hits.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING:
            before = tokens[i - 1].type if i else tokenize.NEWLINE
            after = tokens[i + 1].type if i + 1 < len(tokens) else tokenize.NEWLINE
            statement = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
            if before in statement and after in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue  # a docstring
            for value in string_values(tok.string):
                if literal is not None and literal.match(value):
                    hits.append((tok.start[0], value))
    return hits


def registered_names() -> set[str]:
    from rayfl.algorithms import algorithm_names

    return set(algorithm_names())


def test_the_check_finds_names():
    """The scanner itself: a name as a literal, an f-string part, a row label and an identifier is found; the same
    name in a comment, a docstring or inside a longer word is not."""
    source = ('"""fedx is documented here."""\n'
              'def f(fedx_y):  # fedx in a comment\n'
              '    """fedx in a docstring."""\n'
              '    a = "fedx"\n'
              '    b = f"{a}" + f"fedx"\n'
              '    c = "fedx:M=3"\n'
              '    d = fed_x\n'
              '    e = "fedxy", "a fedx b", "local"\n'
              '    g = "fedx-no-final-update", local\n')
    assert named(source, {"fedx", "fed-x", "local"}, {"local"}) == [
        (4, "fedx"), (5, "fedx"), (6, "fedx:M=3"), (7, "fed_x"), (9, "fedx-no-final-update")]


@pytest.mark.parametrize("path", platform_files())
def test_platform_module_names_no_algorithm(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        hits = named(f.read(), registered_names(), PLATFORM_WORDS)
    assert not hits, (f"{path} names algorithms: " + "; ".join(f"line {line}: {text!r}" for line, text in hits)
                      + " (declare what the platform needs on the Algorithm instead)")


def test_every_platform_module_is_read():
    files = platform_files()
    assert os.path.join("rayfl", "sweep", "space.py") in files
    assert sum(f.endswith(os.path.join("actors", "launch.py")) for f in files) == 1  # the engine's actors, once
    assert not any(f.startswith(os.path.join("rayfl", "algorithms")) for f in files)
    assert os.path.join("rayfl", "comparison", "presets.py") not in files
