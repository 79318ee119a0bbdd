"""What is checked of a tracking store before anything starts, by a run, a sweep, a comparison and a sync: a
SQLite file or store directory this machine could not open or write, a tracking server that does not answer
(or answers its health check with a server error), each within seconds and in one line.

Also where a run's store is (the tracking URI resolved), whether its server answers, and the experiment opened in
it. MLflow (1.3 s of start-up) is imported only inside the function that opens the store, and nothing of rayfl's
engine, so that the session and the outbox's sync can both use this module.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

from rayfl.user_input import UserError

CONNECT_TIMEOUT_S = 5.0  # a TCP connect to a host:port (a Ray address, a tracking server)
PROBE_TIMEOUT_S = 1.0  # a TCP connect to the tracking server: is it there at all
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def unreachable(host: str, port: int) -> str | None:
    """Why nothing accepts a TCP connection at host:port within CONNECT_TIMEOUT_S; None when something does."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__
    return None


def check_tracking_store(uri: str, experiment: str) -> None:
    """A SQLite file or store directory on this machine that MLflow could not open or write, or a tracking
    server that does not answer, refused before anything starts (the store itself is opened by the run's
    driver, in the background; MLflow would retry a silent server for minutes)."""
    if uri.startswith(("http://", "https://")):
        problem = tracking_server_problem(uri)
    elif uri.startswith("sqlite:////"):  # SQLite makes the file, not its directory
        path = uri[len("sqlite:///"):]
        folder = os.path.dirname(path)
        problem = ("it is a directory" if os.path.isdir(path) else
                   f"no directory {folder}" if not os.path.isdir(folder) else _unwritable(path, folder))
    elif uri.startswith("/") or uri.startswith("file:///"):  # a file store makes its directories
        path = uri.removeprefix("file://")
        folder = path
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        problem = f"{folder} is a file" if not os.path.isdir(folder) else _unwritable(path, folder)
    else:
        return
    if problem:
        raise UserError(f"tracking_uri={uri!r}: cannot open experiment {experiment!r} there ({problem})")


TRACKING_ANSWER_S = 5.0  # the longest a tracking server may take to answer the check's one request


def tracking_server_problem(uri: str, timeout: float = TRACKING_ANSWER_S) -> str | None:
    """Why the tracking server at an http(s) ``uri`` would not serve a run: nothing listens, it accepts but
    sends no answer within ``timeout`` seconds (MLflow would wait and retry for minutes), or it answers its
    health check (``GET <uri>/health``, MLflow's) with a server error (5xx). None when it answers otherwise
    (an authentication challenge is the client's business). No credentials are sent."""
    import http.client
    import ssl
    import urllib.parse

    url = urllib.parse.urlparse(uri)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    reason = unreachable(host, port)
    if reason:
        return f"no server answers at {host}:{port}: {reason}"
    if url.scheme == "https":  # a liveness check only: nothing secret is sent, the certificate is MLflow's concern
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl._create_unverified_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", url.path.rstrip("/") + "/health")
        status = conn.getresponse().status
    except TimeoutError:
        return f"the server at {host}:{port} accepted a connection but sent no answer in {timeout:g} s"
    except (OSError, http.client.HTTPException) as e:
        return f"the server at {host}:{port} did not answer as an HTTP server does ({type(e).__name__})"
    finally:
        conn.close()
    if status >= 500:
        return f"the server at {host}:{port} answered its health check with HTTP {status} (a server error)"
    return None


def _unwritable(path: str, folder: str) -> str | None:
    target = path if os.path.exists(path) else folder
    return None if os.access(target, os.W_OK) else f"{target} is not writable"


def resolve_tracking_uri(uri: str | None) -> str:
    """The flag, else MLFLOW_TRACKING_URI, else a local sqlite file; local paths made absolute
    so that actors whose working directory differs write to the same store."""
    if not uri and os.environ.get("MLFLOW_TRACKING_URI"):  # checked as the flag is, named as what it is
        from rayfl.config import check_tracking_uri
        from rayfl.user_input import UserError

        uri = os.environ["MLFLOW_TRACKING_URI"]
        try:
            check_tracking_uri(uri)
        except UserError as e:
            raise UserError(f"$MLFLOW_TRACKING_URI: {e}") from None
    uri = uri or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    elif ":" not in uri and uri not in ("databricks", "databricks-uc", "uc"):  # a plain path: a file store
        uri = os.path.abspath(os.path.expanduser(uri))
    return uri


def store_error(uri: str, experiment: str, e: Exception) -> str:
    """A tracking store that cannot be opened, in one line."""
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"tracking_uri={uri!r}: cannot open experiment {experiment!r} there ({type(e).__name__}: {detail[:200]})"


def ensure_experiment(uri: str, name: str) -> str:
    """Experiment id for ``name``, created if missing, with a sqlite store's artifacts beside its database."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name, artifact_location=artifact_root(uri))


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: ``mlruns`` beside the database file.
    MLflow's default, ``./mlruns``, is resolved against the working directory of whichever process creates
    the experiment, which on a cluster is a Ray worker's. None: the store's own default (a server's)."""
    if uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///"):])), "mlruns")
    return None


def server_address(uri: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) tracking URI, else None (a local store has no server to lose)."""
    if not uri.startswith(("http://", "https://")):
        return None
    url = urllib.parse.urlparse(uri)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return None
    return (url.hostname, port) if url.hostname else None


def answers(address: tuple[str, int] | None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at ``address`` (always, for a local store)."""
    if address is None:
        return True
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True
