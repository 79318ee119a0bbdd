"""Model handles under Ray: every vector a host shares in one call travels in ONE object-store object.

A client step wraps each vector it uploads with ``client.share``; instead of one ``ray.put`` per vector,
the host's batcher hands out a :class:`Part` (the batch's ObjectRef and a row) and puts the whole batch
once when the call ends. Readers fetch each distinct batch once and take their rows (zero-copy views).
Parts route like ObjectRefs: the driver passes them on without reading them.
"""

from __future__ import annotations

import ray


class Part:
    """Row ``index`` of the list of vectors stored under ``ref``."""

    __slots__ = ("ref", "index")

    def __init__(self, ref, index: int):
        self.ref, self.index = ref, index

    def __reduce__(self):
        return Part, (self.ref, self.index)


class Batcher:
    def __init__(self):
        self.pending: list = []
        self.parts: list[Part] = []

    def share(self, vec) -> Part:
        part = Part(None, len(self.pending))
        self.pending.append(vec)
        self.parts.append(part)
        return part

    def flush(self) -> None:
        """Put everything shared since the last flush as one object and point its parts at it."""
        if self.pending:
            ref = ray.put(self.pending)
            for part in self.parts:
                part.ref = ref
            self.pending, self.parts = [], []


def resolve(handles: list) -> list:
    """Values of ObjectRefs and Parts, each distinct object fetched once, in one ``ray.get``."""
    refs = list({(h.ref if isinstance(h, Part) else h): None for h in handles})
    values = dict(zip(refs, ray.get(refs))) if refs else {}
    return [values[h.ref][h.index] if isinstance(h, Part) else values[h] for h in handles]
