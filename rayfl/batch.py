"""A host's batch of (client id, message) pairs as it travels to the client actor that holds those clients.

Its own module because both ends use it: the runtimes pack a batch, the client actor unpacks it, and
:class:`rayfl.host.ClientHost` packs what it is given to resolve each distinct message's models once.
"""

from __future__ import annotations


def pack(items: list[tuple[int, dict]]) -> tuple[list[int], list[dict], list[int]]:
    """A host's batch as it travels: each distinct message object once, with the index of each client's. A
    message the server sends to every client (FedAvg's global model: ``dict.fromkeys``) is serialized, and its
    model handles resolved, once per host instead of once per client."""
    index: dict[int, int] = {}
    messages, which = [], []
    for _, msg in items:
        k = index.setdefault(id(msg), len(messages))
        if k == len(messages):
            messages.append(msg)
        which.append(k)
    return [cid for cid, _ in items], messages, which


def unpack(packed: tuple[list[int], list[dict], list[int]]) -> list[tuple[int, dict]]:
    cids, messages, which = packed
    return [(cid, messages[k]) for cid, k in zip(cids, which)]
