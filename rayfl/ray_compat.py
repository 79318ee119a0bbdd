"""Every use of Ray's private internals, in one place, behind a check of the installed Ray's version.

rayfl needs five things Ray has no public API for: ``ray.init``'s underscore arguments (a private instance's
node address and its inline-object limit), re-reading Ray's environment switches after they change (token
authentication and the single-machine switch, read when Ray is imported: Ray's own tests do the same between
instances), the log directory of the node this process is connected to, and what each node has free. Private names move between
Ray releases, so a Ray outside ``SUPPORTED`` (or one that lacks a name used here) is one line before
anything starts, never an AttributeError halfway through a run.
"""

from __future__ import annotations

import os
import re

from rayfl.config import UserError

# Token authentication (RAY_AUTH_MODE, ray._raylet.AuthenticationTokenLoader) arrived in Ray 2.52; the suite
# runs on the version pinned in constraints.txt. A new major may move any private name used below.
SUPPORTED = ">=2.52,<3"
_LOWEST, _BELOW = (2, 52), (3,)
CONSTRAINTS_HINT = "pip install 'ray[default,tune]>=2.52,<3' (the tested versions: constraints.txt)"


def installed_ray_version() -> str | None:
    """The installed Ray's version, read from its metadata (Ray itself is not imported); None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def _unsupported(version: str | None, detail: str) -> UserError:
    return UserError(f"ray=={version}: rayfl supports ray{SUPPORTED} ({detail}); {CONSTRAINTS_HINT}")


def check_ray_version(version: str | None = None) -> None:
    """A Ray release outside ``SUPPORTED`` (or no Ray at all) is one line naming the range; a pre-release of a
    supported version passes only if it is not the first of a new major."""
    version = installed_ray_version() if version is None else version
    if version is None:
        raise UserError(f"ray: not installed; rayfl supports ray{SUPPORTED}: {CONSTRAINTS_HINT}")
    release = _release(version)
    if not release:
        raise _unsupported(version, "not a version number")
    if release < _LOWEST:
        raise _unsupported(version, "this one is older: it has no token authentication")
    if release[:1] >= _BELOW:
        raise _unsupported(version, "a new major may have moved the private names rayfl uses")


def private_instance_options(node_ip: str, inline_bytes: int) -> dict:
    """``ray.init`` keywords for a private local instance: its node address, and the largest object that travels
    inside a call's message instead of through the object store (``max_direct_call_object_size``)."""
    return dict(_node_ip_address=node_ip, _system_config={"max_direct_call_object_size": inline_bytes})


def reload_env() -> None:
    """Tell an already imported Ray again what RAY_AUTH_* and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER say now (Ray
    reads them when it is imported, and caches the token)."""
    try:
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config

        for owner, name in ((Config, "initialize"), (AuthenticationTokenLoader, "instance"),
                            (AuthenticationTokenLoader, "reset_cache"), (ray_constants, "ENABLE_RAY_CLUSTER")):
            getattr(owner, name)  # each name looked up before anything changes
    except (ImportError, AttributeError) as e:
        raise _unsupported(installed_ray_version(), f"this one lacks a private name rayfl uses: {e}") from None
    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1").lower() not in (
        "0", "false")
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def resources_per_node(free: bool) -> dict[str, dict]:
    """Each node's resources by node id, free now (``free``) or in all; Ray's public API sums them over the
    cluster."""
    try:
        from ray._private.state import available_resources_per_node, total_resources_per_node
    except ImportError as e:
        raise _unsupported(installed_ray_version(), f"this one lacks a private name rayfl uses: {e}") from None
    return available_resources_per_node() if free else total_resources_per_node()


def node_logs_dir() -> str | None:
    """The log directory of the Ray node this process is connected to (where its workers and raylets write);
    None when it is not reachable from here (a remote cluster keeps them on its head node)."""
    try:
        from ray._private import worker

        return worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - not connected, connected through a client, or a Ray that moved the name
        return None
