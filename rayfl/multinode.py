"""Files on a cluster of several machines: what every node must see lives in a folder they all share, and runs
log to a tracking server, not to a file that one machine holds.

A cluster's machines are told apart by their nodes' addresses (Ray nodes started on one machine share its
disk). The cluster configs (cluster/*.yaml) name the shared folder in every node's environment
(``RAYFL_SHARED_DIR``) and the head's MLflow server in ``MLFLOW_TRACKING_URI``.
"""

from __future__ import annotations

import os

from rayfl.user_input import UserError

SHARED_ENV = "RAYFL_SHARED_DIR"


def machines() -> int:
    """How many machines the connected cluster spans (1 when this process is not connected)."""
    import ray

    if not ray.is_initialized():
        return 1
    return len({n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}) or 1


def is_file_store(uri: str) -> bool:
    """A tracking store kept in files (sqlite, a ./mlruns folder) rather than served."""
    return not uri.startswith(("http://", "https://", "databricks", "uc"))


def check_store(uri: str, n: int | None = None) -> None:
    """A file store on a cluster of several machines: every driver would write to its own machine's copy (and
    its artifacts to its working directory); one line that names the head's server instead."""
    n = machines() if n is None else n
    if n > 1 and is_file_store(uri):
        raise UserError(f"tracking_uri={uri!r}: a file store that only one of this cluster's {n} machines sees; "
                        f"use the head's MLflow server (--tracking-uri http://<head address>:5000, or "
                        f"MLFLOW_TRACKING_URI on the nodes, as cluster/*.yaml set it)")


def shared_default(flag: str, given: str | None, sub: str, n: int | None = None) -> str | None:
    """``given`` when the user gave it; on a cluster of several machines, ``sub`` in the folder every node
    shares (``$RAYFL_SHARED_DIR``), or a one-line refusal naming ``flag``; None on one machine (the caller's
    own default)."""
    if given:
        return given
    n = machines() if n is None else n
    if n <= 1:
        return None
    shared = os.environ.get(SHARED_ENV, "").strip()
    if not shared:
        raise UserError(f"{flag.lstrip('-').replace('-', '_')}=None: this cluster spans {n} machines, whose trials "
                        f"would each keep their files on their own disk; give {flag} a folder every node shares "
                        f"(an NFS mount at the same path; {SHARED_ENV} is not set here)")
    return os.path.join(shared, sub)


def on_cluster(address: str | None) -> bool:
    """Whether the run goes to a cluster (an address given, or in RAY_ADDRESS) rather than a private instance."""
    address = address or os.environ.get("RAY_ADDRESS")
    return bool(address) and address != "local"


BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` leaves the cluster's config on the head


def can_grow(path: str = BOOTSTRAP_CONFIG) -> bool:
    """Whether an autoscaler may add nodes to the connected cluster: the launcher's config on this machine (the
    head, where a job's entrypoint runs) names a provider that launches machines (not ``local``: a fixed
    list) with room for more workers than are up. Where no such config is seen (a run submitted with
    ``--address`` from another machine), False."""
    import yaml

    file = os.path.expanduser(path)
    if not os.path.isfile(file):
        return False
    try:
        with open(file) as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(cfg, dict) or (cfg.get("provider") or {}).get("type") in (None, "local"):
        return False
    most = cfg.get("max_workers")
    if not isinstance(most, int):
        types = cfg.get("available_node_types") or {}
        most = sum(int(t.get("max_workers", 0) or 0) for t in types.values() if isinstance(t, dict))
    import ray

    workers = max(0, sum(1 for n in ray.nodes() if n.get("Alive")) - 1) if ray.is_initialized() else 0
    return workers < most
