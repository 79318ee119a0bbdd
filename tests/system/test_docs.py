"""The tutorials under docs/ run: their fenced code blocks are executed, in order, in an empty directory.

How a block is treated, by its info string (the text after the opening fence):
- ``LANG file=NAME`` (``python file=my_fedprox.py``, ``yaml file=space.yaml``): written to NAME, not run;
  the prose says "save this as NAME";
- ``python``: run as a script with this interpreter;
- ``bash``: run with bash, the venv's ``rayfl`` first on PATH;
- ``text``: shown only (a command that needs a real cluster, output); it is not run.
Any other info string fails the test, so no block is skipped by accident. Each block must exit 0. The
blocks use tiny settings (a few clients, 3 rounds), so the page runs in about a minute on two idle cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
BLOCK_TIMEOUT = 240


def blocks(path: Path) -> list[tuple[str, str | None, str]]:
    """(language, file name or None, code) of every fenced block, in order."""
    out = []
    for info, code in FENCE.findall(path.read_text()):
        words = info.split()
        if not words:
            raise AssertionError(f"{path.name}: a fenced block without a language:\n{code[:200]}")
        files = [w[len("file="):] for w in words[1:] if w.startswith("file=")]
        out.append((words[0], files[0] if files else None, code))
    return out


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RAYFL_PLUGINS")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"  # the reader's default, kept in the temp dir
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


@pytest.mark.parametrize("page", ["your_algorithm.md"])
def test_tutorial_blocks_run(page, tmp_path):
    found = blocks(DOCS / page)
    assert any(f for _, f, _ in found) and any(lang == "bash" for lang, f, _ in found if f is None), found
    env = _env(tmp_path)
    for i, (lang, name, code) in enumerate(found):
        if name is not None:
            assert "/" not in name and name not in (".", ".."), name
            (tmp_path / name).write_text(code)
            continue
        if lang == "text":
            continue
        if lang == "python":
            cmd = [sys.executable, "-c", code]
        elif lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        else:
            raise AssertionError(f"{page}: block {i + 1}: unknown info string {lang!r} (see this test's docstring)")
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        assert done.returncode == 0, (f"{page}: block {i + 1} ({lang}) failed ({done.returncode}):\n{code}\n"
                                      f"--- output ---\n{(done.stdout + done.stderr)[-5000:]}")


def test_tutorial_cites_fedprox_and_is_linked():
    text = (DOCS / "your_algorithm.md").read_text()
    assert "Li" in text and "MLSys 2020" in text and "Eq. 2" in text
    assert "docs/your_algorithm.md" in (REPO / "README.md").read_text()
