"""Reductions a server can ask of a client step: where the algorithm only needs a sum, each host returns one
partial sum for its clients and the driver combines one vector per host, instead of one per client.

    ups = call("train", messages, reduce=WeightedMean("weights", by="n"))
    global_model = ups.reduced["weights"]          # Σ_k n_k θ_k / Σ_k n_k over the participants

The reduced field is taken out of each client's upload; every other field arrives as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WeightedMean:
    """Σ_k w_k v_k / Σ_k w_k of upload field ``key``, with w_k the upload's field ``by`` (float64 sums). With
    ``group``, one such mean per value of the *message* field ``group`` (one FedAvg per cluster or latent group):
    the reduced field is then {value: mean} over the groups with a positive total weight."""

    key: str = "weights"
    by: str = "n"
    group: str | None = None


@dataclass(frozen=True)
class ClippedSum:
    """Σ_k clip(v_k - start, S) of upload field ``key``: user-level DP's sum (McMahan et al. 2018, Alg. 1), where
    each client's update from ``start`` (the model it was sent; a handle, resolved by the host) is clipped to norm
    ``clip`` in its host before it is added, so the driver never sees one unclipped (:mod:`rayfl.privacy` adds the
    noise to the total once). The loop asks for it in place of a :class:`WeightedMean` under ``dp_level=user``."""

    key: str = "weights"
    start: Any = None
    clip: float = 1.0


class Uploads(dict):
    """Client id -> upload, plus ``reduced``: field -> the combined value of each requested reduction."""

    def __init__(self, *args, reduced: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reduced = reduced or {}


Partial = dict  # field (or (field, group)) -> (Σ w_k v_k as float64, Σ w_k), one per host


def accumulate(reduce: WeightedMean | None, upload: dict, partial: Partial, message: dict | None = None) -> None:
    """Move one upload's reduced field into the host's running partial sum (in place); an upload without
    the field (a client that only evaluated) adds nothing. ``message``: what the client was sent (a grouped
    mean reads its group there)."""
    if reduce is None or reduce.key not in upload:
        return
    if isinstance(reduce, ClippedSum):
        _add_clipped(reduce, np.asarray(upload.pop(reduce.key)), partial)
        return
    vec = np.asarray(upload.pop(reduce.key))
    w = float(upload[reduce.by])
    slot = reduce.key if reduce.group is None else (reduce.key, message[reduce.group])
    total, weight = partial.get(slot, (None, 0.0))
    if w > 0:
        if total is None:
            total = np.multiply(vec, w, dtype=np.float64)  # w v_k in float64 too: no float32 rounding
        else:
            _add_scaled(total, vec, w)
        weight += w
    partial[slot] = (total, weight)


def _add_clipped(reduce: ClippedSum, vec: np.ndarray, partial: Partial) -> None:
    """The update vec - start scaled to norm ``clip`` when longer (DP-FedAvg's flat clipping), added in float64."""
    update = vec.astype(np.float64) - np.asarray(reduce.start, dtype=np.float64)
    norm = float(np.sqrt(np.dot(update, update)))
    if norm > reduce.clip:
        update *= reduce.clip / norm
    total, count = partial.get(reduce.key, (None, 0.0))
    partial[reduce.key] = (update if total is None else total + update, count + 1.0)


def _add_scaled(total: np.ndarray, vec: np.ndarray, w: float) -> None:
    """``total += w * vec`` in float64 in one pass: numpy would first write w * vec to a float64 temporary
    (at 1,000 clients this sum was a tenth of a client actor's time). For the usual integer weights the
    product of a float32 and w is exact in float64, so the sums are numpy's to the bit."""
    import torch

    src = torch.from_numpy(vec if vec.flags.writeable else vec.copy())  # torch wants writable memory
    torch.from_numpy(total).add_(src, alpha=w)


def combine(reduce: WeightedMean | None, partials: list[Partial]) -> dict:
    """The driver's side: add the hosts' partial sums in host order, divide once, back to float32."""
    if reduce is None:
        return {}
    if isinstance(reduce, ClippedSum):  # the clipped total as it is (None without uploads): noised by the loop
        parts = [part[reduce.key][0] for part in partials if part.get(reduce.key, (None,))[0] is not None]
        return {reduce.key: sum(parts[1:], parts[0].copy()) if parts else None}
    if reduce.group is not None:
        groups = sorted({slot[1] for part in partials for slot in part
                         if isinstance(slot, tuple) and slot[0] == reduce.key})
        means = {g: _mean(partials, (reduce.key, g)) for g in groups}
        return {reduce.key: {g: mean for g, mean in means.items() if mean is not None}}
    mean = _mean(partials, reduce.key)
    if mean is None:
        raise ValueError(f"WeightedMean({reduce.key!r}) needs at least one upload with positive {reduce.by!r}")
    return {reduce.key: mean}


def _mean(partials: list[Partial], slot) -> np.ndarray | None:
    """One slot's partial sums added in host order and divided once, back to float32; None without weight."""
    total, weight = None, 0.0
    for part in partials:
        t, w = part.get(slot, (None, 0.0))
        if t is not None:
            total = t.copy() if total is None else total + t
            weight += w
    return None if total is None or weight <= 0 else (total / weight).astype(np.float32)


def reduce_uploads(reduce: WeightedMean | None, uploads: dict, messages: dict | None = None) -> Uploads:
    """Uploads reduced as one host would (for fakes of ``call`` in tests and one-process tools); ``messages``:
    what each client was sent, for a grouped mean."""
    partial: Partial = {}
    uploads = {c: dict(u) for c, u in uploads.items()}
    for c, up in uploads.items():
        accumulate(reduce, up, partial, (messages or {}).get(c))
    return Uploads(uploads, reduced=combine(reduce, [partial]))
