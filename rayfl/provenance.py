"""Where a run came from, as MLflow tags: rayfl's version, the git commit of the code, the command, what ran.

The command line and the commit are captured by :func:`origin` in the process the user started (a Ray
worker sees neither: its argv is Ray's ``default_worker.py`` and its working directory Ray's session
directory); :func:`run_tags` adds what the config says and is called by the tracker when a run starts.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys


def version() -> str:
    """The installed package's version, else the source tree's ``__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rayfl")
    except PackageNotFoundError:
        from rayfl import __version__

        return __version__


def git_commit(path: str | None = None) -> str | None:
    """Commit of the git checkout holding ``path`` (default: the rayfl source), with ``-dirty`` when it
    has uncommitted changes; None when it is not a checkout or git is missing."""
    where = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user typed it (``rayfl run --algo ...``)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.basename(argv[0]) in ("rayfl", "cli.py", "__main__.py"):
        argv[0] = "rayfl"
    return shlex.join(argv)


def api_call(name: str, values: dict) -> str:
    """A Python API call written as the user would have typed it: ``rayfl.run(algo='fedfomo', ...)``."""
    return f"rayfl.{name}(" + ", ".join(f"{k}={v!r}" for k, v in values.items()) + ")"


def origin(command: str | None = None) -> dict[str, str]:
    """Tags known only to the submitting process: version, commit, command, working directory."""
    tags = {"rayfl.version": version(), "rayfl.command": command or command_line(),
            "rayfl.cwd": os.getcwd(), "mlflow.source.name": "rayfl", "mlflow.source.type": "LOCAL"}
    from rayfl.plugins import loaded_sources

    if loaded_sources():  # where a plugin's algorithm, dataset or model came from
        tags["rayfl.plugins"] = ", ".join(loaded_sources())
    commit = git_commit()
    if commit:
        tags["rayfl.git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


def describe(cfg) -> str:
    """One line saying what was run (the MLflow run description)."""
    knobs = ", ".join(f"{k}={v}" for k, v in sorted(cfg.params.items())
                      if not (isinstance(v, (list, tuple)) and not v))  # an empty grid: the single value is the run's
    split = cfg.partition + (f", {cfg.classes_per_client} classes/client" if cfg.partition == "pathological"
                             else f", alpha={cfg.alpha}" if cfg.partition == "dirichlet" else "")
    return (f"{cfg.algo}{f' ({knobs})' if knobs else ''} on {cfg.dataset} ({split}), {cfg.clients} clients, "
            f"{cfg.rounds} rounds, participation {cfg.participation:g}, seed {cfg.seed}")


def run_tags(cfg, origin_tags: dict | None = None) -> dict[str, str]:
    """Every tag a run starts with: the submitter's :func:`origin` plus the algorithm, dataset and
    description. Without an origin (a run started by other code) the version and source are still set."""
    tags = {"rayfl.version": version(), "mlflow.source.name": "rayfl", **(origin_tags or {})}
    tags.update({"rayfl.algo": cfg.algo, "rayfl.dataset": cfg.dataset, "rayfl.partition": cfg.partition,
                 "mlflow.note.content": describe(cfg)})
    return {k: str(v) for k, v in tags.items()}
