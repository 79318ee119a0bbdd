"""Runtimes: where the clients live. The loop and the algorithms see only this small interface.

``call(step, messages, reduce)`` runs a client step on many clients (in parallel under Ray) and returns
their uploads, with the requested reduction combined from one partial sum per host (:mod:`rayfl.reduce`);
``submit`` does the same without waiting (:class:`Pending`); ``put``/``get`` turn vectors into handles and
back. :class:`LocalRuntime` keeps every client in this process (tests, debugging);
``actors.runtime.RayRuntime`` keeps them in client actors.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from rayfl.reduce import Uploads, combine


class ClientsLost(RuntimeError):
    """Client actors died during a call. The runtime has already started their replacements (fresh clients,
    initial state); the loop restores every client from its last snapshot and replays the rounds since."""


class Pending:
    """A client call under way; ``result()`` waits for its uploads. A host runs its calls in the order they
    were submitted, so a call submitted after this one sees the clients as this one leaves them."""

    def __init__(self, wait: Callable[[], Uploads]):
        self.result = wait


class Runtime(Protocol):
    pipelined: bool  # whether a round's report may wait while the clients run the next round's first call
    def call(self, step: str, messages: dict[int, dict], reduce=None) -> Uploads: ...
    def submit(self, step: str, messages: dict[int, dict], reduce=None) -> Pending: ...
    def put(self, obj: Any) -> Any: ...
    def get(self, handles: list) -> list: ...
    def client_states(self) -> dict[int, bytes]: ...
    def load_client_states(self, states: dict[int, bytes]) -> None: ...
    def save_clients(self) -> Any: ...  # an in-memory snapshot of every client, taken without waiting (SaveChain)
    def restore_clients(self, saved: Any) -> None: ...
    def client_vectors(self) -> dict[int, np.ndarray]: ...
    def placement(self) -> list[dict]: ...
    def shutdown(self) -> None: ...


SAVE_FULL_EVERY = 16  # an in-memory snapshot of the clients: a full save and at most 15 partial ones after it


class SaveChain:
    """The clients' in-memory snapshots as a chain of saves, one part per host each: a full save, then saves
    of only the clients encoded anew since the save before (at 10,000 clients, 100 of them a round, not
    10,000), and every SAVE_FULL_EVERY-th save a full one again, so that a restore reads a bounded chain and
    old saves are freed. A snapshot is the chain as it was; restoring one makes it the chain again."""

    def __init__(self):
        self.links: tuple = ()

    def next_is_full(self) -> bool:
        return len(self.links) % SAVE_FULL_EVERY == 0

    def add(self, parts: list, full: bool) -> tuple:
        self.links = (parts,) if full else (*self.links, parts)
        return self.links

    def reset(self, links: tuple) -> None:
        self.links = tuple(links)

    @staticmethod
    def of_host(links: tuple, h: int) -> list:
        """Host ``h``'s parts of a chain, oldest first."""
        return [parts[h] for parts in links]


def assign_hosts(n_clients: int, n_hosts: int) -> list[list[int]]:
    """Client ids per host, spread evenly in contiguous blocks (sizes differ by at most one)."""
    n_hosts = max(1, min(n_hosts, n_clients))
    bounds = [round(h * n_clients / n_hosts) for h in range(n_hosts + 1)]
    return [list(range(bounds[h], bounds[h + 1])) for h in range(n_hosts)]


def hosts_for(cfg, slots: int | None = None) -> list[list[int]]:
    """The placement of a run: ``clients_per_actor`` clients per host when the user set it, else (auto) one
    host per client while there are ``slots`` for each, else ``slots`` hosts (one host without a cluster)."""
    if cfg.clients_per_actor != "auto":
        return assign_hosts(cfg.clients, -(-cfg.clients // cfg.clients_per_actor))
    return assign_hosts(cfg.clients, slots or 1)


def group_by_host(messages: dict[int, dict], host_of: dict[int, int]) -> dict[int, list]:
    """The per-host batches of one call: host index -> [(client id, message), ...]."""
    batches: dict[int, list] = {}
    for cid in sorted(messages):
        batches.setdefault(host_of[cid], []).append((cid, messages[cid]))
    return batches


def gather(batches: dict[int, list], results: list[tuple[list, dict]], reduce) -> Uploads:
    """Uploads by client id from each host's (uploads, partial sum), and the reduction combined in host order."""
    out = Uploads(reduced=combine(reduce, [partial for _, partial in results]))
    for items, (uploads, _) in zip(batches.values(), results):
        out.update(zip([cid for cid, _ in items], uploads))
    return out


def _frozen(obj: Any) -> Any:
    """A read-only copy, as Ray's object store gives back: catches in-place writes in tests too."""
    if isinstance(obj, np.ndarray):
        out = obj.copy()
        out.flags.writeable = False
        return out
    return obj


class LocalRuntime:
    """Every client in this process; same semantics as the Ray runtime, for tests and debugging. A call runs
    when it is submitted, so one process gains nothing from reporting a round late: not ``pipelined`` unless
    asked (tests of the pipelined loop)."""

    def __init__(self, prepared, n_hosts: int | None = None, device: str = "cpu", pipelined: bool = False):
        """``n_hosts``: how many hosts to spread the clients over (default: the config's placement, one
        host for ``auto``); ``device``: where the clients' data and models live."""
        self.pipelined = pipelined
        from rayfl.host import ClientHost

        cfg, fed = prepared.cfg, prepared.federation
        blocks = assign_hosts(cfg.clients, n_hosts) if n_hosts else hosts_for(cfg)
        self.host_of = {c: h for h, block in enumerate(blocks) for c in block}
        spec = prepared.host_spec()
        self.hosts = [ClientHost(spec, {c: fed.clients[c] for c in block}, device=device, share=_frozen)
                      for block in blocks]
        self.saves = SaveChain()

    def call(self, step, messages, reduce=None):
        batches = group_by_host(messages, self.host_of)
        return gather(batches, [self.hosts[h].run(step, items, reduce) for h, items in batches.items()], reduce)

    def submit(self, step, messages, reduce=None):
        out = self.call(step, messages, reduce)
        return Pending(lambda: out)

    def put(self, obj):
        return _frozen(obj)

    def get(self, handles):
        return list(handles)

    def client_states(self):
        return {cid: blob for h in self.hosts for cid, blob in h.state().items()}

    def load_client_states(self, states):
        for h, host in enumerate(self.hosts):
            host.load_state({c: s for c, s in states.items() if self.host_of[c] == h})

    def save_clients(self):
        full = self.saves.next_is_full()
        return self.saves.add([host.save(full) for host in self.hosts], full)

    def restore_clients(self, saved):
        for h, host in enumerate(self.hosts):
            host.load_state(*SaveChain.of_host(saved, h))
        self.saves.reset(saved)

    def client_vectors(self):
        return {cid: v for host in self.hosts for cid, v in host.vectors().items()}

    def placement(self):
        return [{"actor": h, "node_id": "local", **host.info()} for h, host in enumerate(self.hosts)]

    def shutdown(self):
        self.hosts = []
