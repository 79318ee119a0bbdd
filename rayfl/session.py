"""The Ray session and the run directories, for the ``rayfl`` command and the Python API alike.

Starting or attaching Ray (a private loopback instance with its own token, or a given cluster, probed first so
that a wrong ``--address`` is one line within seconds), shutting it down with the environment restored, the
checks on a tracking store made on a cluster (those made here are :mod:`rayfl.tracking.store`'s), and a run
directory's layout (``config.yaml`` beside
its checkpoints, what ``--resume`` reads back).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from contextlib import contextmanager
from typing import Callable

from rayfl import ray_compat
from rayfl.config import UserError, check_value, make_config, read_yaml, shown
from rayfl.progress import stderr_into
from rayfl.tracking.store import (CONNECT_TIMEOUT_S, check_tracking_store,  # noqa: F401 - re-exported
                                  tracking_server_problem, unreachable)

Progress = Callable[[dict], None]


# --------------------------------------------------------------------------------------------------
# Ray: a private instance or a given cluster, up for one command and down again
# --------------------------------------------------------------------------------------------------
class RayStartError(Exception):
    """Ray could not be started or reached for a reason that is not the user's: one line, exit 1."""


_SAVED_ENV: dict[str, str | None] = {}


# Objects up to this size travel inside a call's message instead of through the node's object store: an
# actor's partial sum of a 159k-parameter model (1.3 MB of float64) cost the raylet about 5 ms of CPU a
# round at 1,000 clients on 2 cores (benchmarks/README.md). Ray's default is 100 KB; a private instance only.
INLINE_BYTES = 4 << 20


def start_ray(address: str | None, emit: Progress) -> bool:
    """Connect unless this process already is; True when we started (and so must shut down) Ray."""
    import ray

    if ray.is_initialized():
        return False
    emit({"event": "cluster", "state": "starting", "address": address or os.environ.get("RAY_ADDRESS")})
    t0 = time.monotonic()
    init_ray(address)
    emit({"event": "cluster", "state": "ready", "seconds": time.monotonic() - t0,
          "resources": ray.cluster_resources(), "logs": _ray_logs_dir()})
    return True


def init_ray(address: str | None) -> None:
    """Connect to the given cluster, or start a private local instance (never someone else's).

    The private instance binds the loopback address only and requires a fresh random token, so no other
    machine, and no process without that token, can attach to it and run code. A given address is probed
    first (an unreachable one is one line within seconds, not Ray's endless retries)."""
    ray_compat.check_ray_version()
    address = address or os.environ.get("RAY_ADDRESS") or None
    private = address in (None, "local")
    if private:
        import secrets

        # Read by Ray when it is imported (and again after Config.initialize): loopback-only node IP
        # (Ray treats the node as a single-machine instance) and token authentication with our own token.
        _set_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                 RAY_AUTH_TOKEN_PATH=None)
    else:
        check_address(address)
        _set_env(RAY_gcs_server_port_wait_time_s=os.environ.get("RAY_gcs_server_port_wait_time_s", "1"))
    try:
        _reload_ray_env()
    except UserError:  # a Ray without the private names rayfl uses
        _restore_env()
        raise
    import ray

    kwargs = dict(address="local", include_dashboard=False,
                  **ray_compat.private_instance_options("127.0.0.1", INLINE_BYTES)) if private else dict(address=address)
    try:
        with _stderr_kept_aside() as kept:
            ray.init(logging_level="ERROR", configure_logging=True, **kwargs,
                     log_to_driver=False)  # workers' and raylets' output stays in Ray's log files)
    except Exception as e:  # noqa: BLE001 - whatever Ray raises, the user gets one line
        _restore_env()
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if private:
            raise RayStartError(f"a local Ray instance did not start ({type(e).__name__}: {detail}); "
                                f"Ray's own messages: {kept.name}") from None
        raise UserError(f"address={address!r}: could not connect to a Ray cluster there ({detail}; Ray's own "
                        f"messages: {kept.name})") from None


def shutdown_ray() -> None:
    """Ray down, and the environment as it was before :func:`init_ray` (tests run many commands in one process)."""
    import ray

    ray.shutdown()
    _restore_env()


# --------------------------------------------------------------------------------------------------
# A private instance the Python API started, kept for the next call in this process
# --------------------------------------------------------------------------------------------------
class _Kept:
    """The private Ray instance an API call started and left up (its job id: a Ray that the user shut down and
    started again is not it), and the actors kept with it (:class:`rayfl.actors.pool.ActorPool`)."""

    job: str | None = None
    pool = None
    at_exit = False


def _job_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


def keep_ray() -> None:
    """Leave the private instance this process started up for the next API call; down at the latest when the
    interpreter exits (or at :func:`shutdown`)."""
    import atexit

    _Kept.job = _job_id()
    if not _Kept.at_exit:  # registered after ray.init's own handler, so it runs first
        atexit.register(shutdown)
        _Kept.at_exit = True


def kept_ray() -> bool:
    """Whether this process is connected to a private instance an API call started and kept."""
    if _Kept.job is None or "ray" not in sys.modules:
        return False
    if _job_id() == _Kept.job:
        return True
    _forget()  # the user shut it down (and perhaps started another, theirs)
    return False


def kept_actors():
    """The actors kept with the kept instance (created empty on first use)."""
    if _Kept.pool is None:
        from rayfl.actors.pool import ActorPool

        _Kept.pool = ActorPool()
    return _Kept.pool


def release_actors() -> None:
    """Kill the actors kept from the last run (their CPUs and GPUs are free again for other work)."""
    if _Kept.pool is not None:
        _Kept.pool.close()


def _forget() -> None:
    _Kept.job, _Kept.pool = None, None
    _restore_env()


def shutdown() -> None:
    """End what the Python API keeps between calls in this process: the actors of the last run and the private
    Ray instance it started (a Ray the user started, or a cluster, is left as it is). The next call starts
    them again. Called at the interpreter's exit too."""
    if kept_ray():
        release_actors()
        shutdown_ray()
    _Kept.job, _Kept.pool = None, None


def _set_env(**values: str | None) -> None:
    for key, value in values.items():
        _SAVED_ENV.setdefault(key, os.environ.get(key))
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _restore_env() -> None:
    for key, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SAVED_ENV.clear()
    try:
        _reload_ray_env()
    except UserError:  # reported where the environment was first changed (init_ray)
        pass


def _reload_ray_env() -> None:
    """Ray reads RAY_AUTH_* and the single-machine switch when it is imported; an already imported Ray is
    told again (as Ray's own tests do between instances)."""
    if "ray" not in sys.modules:
        return
    ray_compat.reload_env()


@contextmanager
def _stderr_kept_aside():
    """File descriptor 2 into a temporary file while Ray starts: Ray's C++ retries print many lines. On
    success they are passed on unchanged; on failure the caller prints one line naming the file (``.name``)."""
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="rayfl-ray-start-", suffix=".log", delete=False) as f, stderr_into(f):
        yield f
    with open(f.name, "rb") as kept:
        text = kept.read()
    os.unlink(f.name)
    if text:
        os.write(2, text)


def _ray_logs_dir() -> str | None:
    """Where Ray writes its workers' and raylets' logs (kept out of the console)."""
    return ray_compat.node_logs_dir()


# --------------------------------------------------------------------------------------------------
# Where Ray is: a given address, checked before anything is loaded
# --------------------------------------------------------------------------------------------------
def check_address(address: str | None) -> None:
    """A Ray address must be HOST:PORT, ray://HOST:PORT or auto, and something must listen there (checked
    before the data is loaded, and again when Ray starts)."""
    if address is not None and not isinstance(address, str):
        raise UserError(f"address={shown(address)}: must be a string: HOST:PORT, ray://HOST:PORT or auto")
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address in (None, "local", "auto"):
        return
    target = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = target.rpartition(":")
    if (not sep or not host or "/" in target or not port.isdigit() or not 0 < int(port) < 65536
            or len(address) > 300 or not address.isprintable() or " " in address):
        raise UserError(f"address={shown(address)}: expected HOST:PORT, ray://HOST:PORT or auto")
    reason = unreachable(host.strip("[]"), int(port)) or not_grpc(host.strip("[]"), int(port))
    if reason:
        raise UserError(f"address={shown(address)}: no Ray cluster answers there ({reason})")


# An HTTP/2 client's connection preface and an empty SETTINGS frame (RFC 9113, 3.4 and 6.5): a gRPC server, as
# Ray's GCS and its client server are, answers with a SETTINGS frame of its own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
GRPC_ANSWER_S = 3.0


def not_grpc(host: str, port: int) -> str | None:
    """Why what listens at host:port is not a gRPC server (a web server, a database, a silent socket: Ray
    would retry it for about 40 s before giving up); None when it answers an HTTP/2 hello as gRPC does."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.settimeout(GRPC_ANSWER_S)
            sock.sendall(_HTTP2_HELLO)
            answer = b""
            while len(answer) < 9:
                chunk = sock.recv(9 - len(answer))
                if not chunk:
                    break
                answer += chunk
    except socket.timeout:
        return f"something listens there but sent nothing in {GRPC_ANSWER_S:g} s; a Ray cluster speaks gRPC"
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__
    if len(answer) == 9 and answer[3] == 4 and answer[5:9] == bytes(4):  # a SETTINGS frame on stream 0
        return None
    return "something listens there but does not speak gRPC, as a Ray cluster does"


# --------------------------------------------------------------------------------------------------
# The tracking store
# --------------------------------------------------------------------------------------------------
def check_threads_here(threads: int, address: str | None) -> None:
    """On a private local instance (no ``address``) every actor's torch threads share this machine's cores:
    more threads per actor than it has CPUs only spin against each other."""
    if address or os.environ.get("RAY_ADDRESS"):
        return
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise UserError(f"torch_threads={threads}: must be at most this machine's {cpus} CPUs "
                        f"(a private local Ray instance)")


CLUSTER_PROBE_S = 10.0  # the longest a check made on the cluster may take before the run goes on without it


def check_tracking_on_cluster(uri: str, experiment: str) -> None:
    """On a cluster the run's driver opens the tracking store from one of its nodes: a tracking server is
    probed from there (a task that takes no CPU), before any actor starts. A local store's path is the
    cluster's, not necessarily this machine's: its driver reports it. A cluster too busy to run the probe
    within ``CLUSTER_PROBE_S`` leaves the question to the driver."""
    if not uri.startswith(("http://", "https://")):
        return
    import ray

    probe = ray.remote(num_cpus=0, max_retries=0)(_tracking_problem).remote(uri, experiment)
    done, _ = ray.wait([probe], timeout=CLUSTER_PROBE_S)
    if not done:
        ray.cancel(probe, force=True)
        return
    problem = ray.get(probe)
    if problem:
        raise UserError(problem)


def _tracking_problem(uri: str, experiment: str) -> str | None:
    try:
        check_tracking_store(uri, experiment)
    except UserError as e:
        return str(e)
    return None


def open_experiment(uri: str, experiment: str) -> str:
    """The experiment's id in the tracking store; a store that cannot be opened is one line."""
    from rayfl.tracking import ensure_experiment, store_error

    try:
        return ensure_experiment(uri, experiment)
    except Exception as e:  # noqa: BLE001 - MLflow's errors for a bad store vary (sqlite, http, paths)
        raise UserError(store_error(uri, experiment, e)) from None


# --------------------------------------------------------------------------------------------------
# Run directories: config.yaml beside the checkpoints
# --------------------------------------------------------------------------------------------------
def make_run_dir(cfg, run_name: str, uri: str) -> str:
    """<out_dir>/<run_name> with the resolved config in config.yaml: absolute paths and the tracking URI
    actually used, so ``--resume`` works from any working directory."""
    import yaml

    run_dir = os.path.abspath(os.path.join(os.path.expanduser(cfg.out_dir), run_name))
    record = {**dataclasses.asdict(cfg), "run_name": run_name, "tracking_uri": uri,
              "out_dir": os.path.abspath(os.path.expanduser(cfg.out_dir))}
    if cfg.data_root is not None:
        record["data_root"] = os.path.abspath(os.path.expanduser(cfg.data_root))
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(record, f, sort_keys=False)
        from rayfl.plugins import write_record

        write_record(run_dir, cfg.algo)  # which plugins were loaded, for --resume
    except OSError as e:
        raise UserError(f"out_dir={cfg.out_dir!r}: cannot write the run directory {run_dir} "
                        f"({e.strerror or e})") from None
    return run_dir


def load_run_dir(run_dir: str, step_sizes: dict | None = None):
    """The Config saved in a run directory, for --resume: it must be a rayfl run directory with a checkpoint.
    ``step_sizes`` (``{"lr": 0.05, "params": {"personal_lr": 0.005}}``) changes those of its step sizes, and
    nothing else (rayfl.resume.with_step_sizes)."""
    check_value("--resume", run_dir)
    saved = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(saved):
        raise UserError(f"--resume {run_dir!r}: no config.yaml there (not a rayfl run directory)")
    from rayfl.resume import check_recorded_plugins

    check_recorded_plugins(run_dir)  # the plugins it recorded are given again (never imported from it)
    from rayfl.loop import Loop  # (torch: after what is refused without it)

    try:
        cfg = make_config(None, read_yaml(saved))
    except UserError as e:
        raise UserError(f"--resume {run_dir!r}: its config.yaml: {e}") from None
    if not Loop.has_checkpoint(run_dir):
        raise UserError(f"--resume {run_dir!r}: no checkpoint there to go on from (the run saved none: "
                        f"--checkpoint-every N); start it again without --resume")
    Loop.read_checkpoint(run_dir, cfg)  # another version's, another config's, or not plain data: refused now
    if step_sizes:
        from rayfl.resume import with_step_sizes

        cfg = with_step_sizes(run_dir, cfg, step_sizes)
    return cfg


# --------------------------------------------------------------------------------------------------
# One command's session: what run, tune and compare all do around their experiments
# --------------------------------------------------------------------------------------------------
class Session:
    """What a run, a sweep and a comparison do around their experiments, done one way: check the tracking store
    before anything starts, connect to Ray (a private local instance unless this process is connected or an
    address is given; shut down when the session ends only if it was started here, unless ``keep``), make run
    directories, open the experiment and a parent run, and deliver what a parent's outbox kept. A context
    manager::

        with Session(address, TrackingSpec.of(cfg), emit) as session:
            session.check_store()
            session.start_ray()
            ...

    ``keep`` (the Python API's runs): a private instance started here stays up for the next call in this
    process (:func:`keep_ray`), and so do the run's actors (:attr:`pool`); a given cluster is disconnected as
    without it.
    """

    def __init__(self, address: str | None, tracking, emit: Progress = lambda event: None, keep: bool = False):
        check_address(address)
        self.address, self.tracking, self.emit = address, tracking, emit
        self.keep = keep
        self.started = False
        self.kept = False  # connected to the instance an earlier API call kept
        self._experiment_id: str | None = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ray down (and the environment as it was) if this session started it, unless it is kept."""
        if self.started:
            self.started = False
            if self.keep and not self.on_cluster:
                keep_ray()
            else:
                shutdown_ray()

    @property
    def on_cluster(self) -> bool:
        """A given cluster (``address`` or $RAY_ADDRESS), not a private instance on this machine."""
        return bool(self.address or os.environ.get("RAY_ADDRESS"))

    # --- checks, before anything starts ---------------------------------------------------------------
    def check_here(self, threads: int) -> None:
        """Torch threads per actor that this machine's cores hold (a private instance only)."""
        check_threads_here(threads, self.address)

    def check_store(self) -> None:
        """The tracking store opens from here: refused in one line now, not after MLflow's minutes of retries."""
        check_tracking_store(self.tracking.uri, self.tracking.experiment)

    def check_store_shared(self) -> None:
        """Runs on several machines log to one store: a tracking server, not a file one machine holds."""
        from rayfl.multinode import check_store

        check_store(self.tracking.uri)

    def check_store_on_cluster(self) -> None:
        """A tracking server as the cluster's nodes see it (once connected)."""
        check_tracking_on_cluster(self.tracking.uri, self.tracking.experiment)

    # --- Ray ---------------------------------------------------------------------------------------------
    def start_ray(self) -> None:
        """Connected (started here unless this process already is). Actors kept from an earlier run are
        killed unless this session may use them (:attr:`pool`); the kept instance is shut down when a cluster is
        asked for."""
        if kept_ray():
            if self.on_cluster:  # the local instance kept from an earlier call is not the cluster asked for
                shutdown()
            else:
                self.kept = True
                if not self.keep:
                    release_actors()
        self.started = start_ray(self.address, self.emit) or self.started

    @property
    def pool(self):
        """Where a run's actors stay for the next run (:class:`rayfl.actors.pool.ActorPool`): on a private
        instance that this process keeps, else None (the actors end with the run)."""
        if self.keep and not self.on_cluster and (self.kept or self.started):
            return kept_actors()
        return None

    def connect_early(self) -> None:
        """On a cluster, connect before planning: how many machines it spans decides where files go."""
        from rayfl.multinode import on_cluster

        if on_cluster(self.address):
            self.start_ray()

    # --- tracking ------------------------------------------------------------------------------------------
    def experiment_id(self) -> str:
        """The experiment's id in the store (created if missing); a store that cannot be opened is one line."""
        if self._experiment_id is None:
            self._experiment_id = open_experiment(self.tracking.uri, self.tracking.experiment)
        return self._experiment_id

    def open_parent(self, name: str, tags: dict, params: dict | None = None):
        """A new MLflow parent run (:class:`rayfl.tracking.ParentRun`) in the experiment, sampling this machine's
        system metrics every ``system_metrics_interval`` seconds until it ends."""
        from rayfl.tracking import ParentRun

        run = ParentRun.create(self.tracking.uri, self.experiment_id(), name, tags, params)
        run.sample_system(self.tracking.system_metrics_interval)
        return run

    def reopen_parent(self, run_id: str):
        from rayfl.tracking import ParentRun

        run = ParentRun.reopen(self.tracking.uri, run_id)
        run.sample_system(self.tracking.system_metrics_interval)
        return run

    def run_dir(self, cfg, run_name: str) -> str:
        """A run directory (:func:`make_run_dir`) recording the tracking URI used."""
        return make_run_dir(cfg, run_name, self.tracking.uri)

    def answers(self) -> bool:
        """Whether the tracking store answers now (a local store always does)."""
        from rayfl.tracking import answers, server_address

        return answers(server_address(self.tracking.uri), timeout=3.0)

    def deliver(self, folder: str) -> None:
        """What ``folder``'s outbox kept, sent now if the store answers (else it stays for ``rayfl sync``)."""
        import shutil

        from rayfl.tracking import outbox_dir, sync_run

        if self.answers():
            try:
                sync_run(folder)
                shutil.rmtree(outbox_dir(folder))
            except Exception:  # noqa: BLE001 - gone meanwhile: what it did not get stays for rayfl sync
                pass

    def unsent_line(self, root: str, what: str) -> str | None:
        """The line saying which runs under ``root`` kept records their store did not get, and how to send them."""
        from rayfl.tracking import kept_line

        return kept_line(root, self.tracking.uri, what)
