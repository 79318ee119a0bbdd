"""Runtimes: where the clients live. The loop and the algorithms see only this small interface.

``call(step, messages)`` runs a client step on many clients (in parallel under Ray) and returns their
uploads; ``put``/``get`` turn vectors into handles and back. :class:`LocalRuntime` keeps every client
in this process (tests, debugging); ``actors.runtime.RayRuntime`` keeps them in client actors.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from rayfl.host import ClientHost


class Runtime(Protocol):
    def call(self, step: str, messages: dict[int, dict]) -> dict[int, dict]: ...
    def put(self, obj: Any) -> Any: ...
    def get(self, handles: list) -> list: ...
    def client_states(self) -> dict[int, bytes]: ...
    def load_client_states(self, states: dict[int, bytes]) -> None: ...
    def client_vectors(self) -> dict[int, np.ndarray]: ...
    def placement(self) -> list[dict]: ...
    def shutdown(self) -> None: ...


def assign_hosts(n_clients: int, clients_per_host: int) -> list[list[int]]:
    """Client ids per host, in contiguous blocks: host h holds clients [h*k, (h+1)*k)."""
    return [list(range(s, min(s + clients_per_host, n_clients))) for s in range(0, n_clients, clients_per_host)]


def group_by_host(messages: dict[int, dict], host_of: dict[int, int]) -> dict[int, list]:
    """The per-host batches of one call: host index -> [(client id, message), ...]."""
    batches: dict[int, list] = {}
    for cid in sorted(messages):
        batches.setdefault(host_of[cid], []).append((cid, messages[cid]))
    return batches


def _frozen(obj: Any) -> Any:
    """A read-only copy, as Ray's object store gives back: catches in-place writes in tests too."""
    if isinstance(obj, np.ndarray):
        out = obj.copy()
        out.flags.writeable = False
        return out
    return obj


class LocalRuntime:
    """Every client in this process; same semantics as the Ray runtime, for tests and debugging."""

    def __init__(self, prepared, clients_per_host: int | None = None):
        cfg, fed = prepared.cfg, prepared.federation
        blocks = assign_hosts(cfg.clients, clients_per_host or cfg.clients_per_actor)
        self.host_of = {c: h for h, block in enumerate(blocks) for c in block}
        self.hosts = [ClientHost(cfg, prepared.algorithm, prepared.model_spec, prepared.info.task,
                                 prepared.dataset.x, prepared.dataset.y, {c: fed.clients[c] for c in block},
                                 prepared.initial, share=_frozen, holdout=fed.holdout)
                      for block in blocks]

    def call(self, step, messages):
        out: dict[int, dict] = {}
        for h, items in group_by_host(messages, self.host_of).items():
            out.update(zip([cid for cid, _ in items], self.hosts[h].run(step, items)))
        return out

    def put(self, obj):
        return _frozen(obj)

    def get(self, handles):
        return list(handles)

    def client_states(self):
        return {cid: blob for h in self.hosts for cid, blob in h.state().items()}

    def load_client_states(self, states):
        for h, host in enumerate(self.hosts):
            host.load_state({c: s for c, s in states.items() if self.host_of[c] == h})

    def client_vectors(self):
        return {cid: c.vector() for h in self.hosts for cid, c in h.clients.items()}

    def placement(self):
        return [{"actor": h, "node_id": "local", **host.info()} for h, host in enumerate(self.hosts)]

    def shutdown(self):
        self.hosts = []
