"""Differential privacy: sample-level DP-SGD for any algorithm's local training, user-level DP for the
algorithms that average, and accounting that composes over everything a client ever released.

Sample level (``dp_level=sample``; Abadi et al. 2016, Algorithm 1). Inside a client step of an algorithm whose
ClientLogic declares ``private_training = True``, :func:`rayfl.training.train_epochs` takes the private path
(:func:`train_epochs` here): batches are Poisson samples of the training split (each sample in with probability
q = batch_size / n), every sample's gradient over all trained parameters is clipped to norm C (``dp_clip``),
Gaussian noise of standard deviation σ·C (``dp_noise`` = σ) is added to their sum, which is divided by the
expected batch size q·n (Opacus's DPOptimizer with Poisson sampling and mean reduction; the same clip factor
C / (‖g‖ + 1e-6) capped at 1). Each private training call is a release of its own: its batches and noise come
from a generator keyed by (seed, client, client step, label, count) (:meth:`Account.generator`), never from
the caller's, so that the releases the accountant composes are independent. The clipped sum comes from
per-sample norms computed from each layer's input and output gradient (:mod:`rayfl.clipping`), or, where a
model's layers do not allow it, from per-sample gradients formed by ``torch.func`` (``vmap(grad(...))`` over a
``functional_call`` of the model); flat models (:func:`rayfl.training.flatten`) and any optimizer (FlatSGD,
torch's, momentum, Adam) train on the privatized gradient unchanged. Each client keeps one accountant over every private step it has taken, in any
stage and round: Opacus's history of (noise multiplier, sample rate, steps) as plain data in
``client.state["dp_history"]``, so it is in every snapshot and checkpoint and a replayed client or a resumed run
reports the same ε. ε at δ (``dp_delta``) is read from Opacus's RDP accountant (``dp_accountant=rdp``, Mironov
2017) or its PRV accountant (``prv``, Gopi, Lee and Wutschitz 2021) at every evaluation. It covers each
client's *training* split; validation splits, which FedFomo's weights, PersFL's teacher and grid choice and
FedMoE's early stopping read, are not covered (as in Zhang et al. 2021, Sec. 4), nor are the simulation's own
measurements (train loss and evaluation metrics in MLflow).

User level (``dp_level=user``; DP-FedAvg, McMahan, Ramage, Talwar and Zhang, ICLR 2018, Algorithm 1). For a
server that declares ``averages`` (the attribute holding the handle of the model its clients start from), each
participant's update θ_k - θ is clipped to norm S (``dp_clip``) inside its client actor, which sums its clients'
clipped updates (:class:`rayfl.reduce.ClippedSum`); the driver adds Gaussian noise z·S (``dp_noise`` = z) to
the total once and divides by the fixed denominator q·K (the estimator f̃_f of Sec. 2 with w_k = 1), so no
update is ever seen unclipped by the driver. Users are Poisson-sampled at the participation rate q, and one
run-level accountant counts (z, q) once per averaging round; the guarantee is every user's.

An algorithm declares on its own class (a subclass does not inherit the promise, so one that trains or averages
differently must make its own): ``ClientLogic.private_training`` (True, or a string saying why not) and
``Server.averages`` (both declared in :mod:`rayfl.algorithms.base`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable


LEVELS = ("sample", "user")
ACCOUNTANTS = ("rdp", "prv")
HISTORY = "dp_history"  # client.state key: the accountant's history, [[noise multiplier, sample rate, steps], ...]
STEPS = "dp_steps"  # client.state key: how many client steps it has run under sample-level DP (a release's key)
CHUNK_ELEMENTS = 1 << 25  # per-sample gradients held at once (samples x parameters), at most: 128 MB of float32


@dataclass(frozen=True)
class DPSettings:
    """The run's privacy settings; None (``from_config``) when ``dp_noise`` is 0."""

    noise: float  # σ (sample level) or z (user level)
    clip: float  # C (per-sample gradient norm) or S (per-user update norm)
    delta: float
    level: str = "sample"
    accountant: str = "rdp"

    @classmethod
    def from_config(cls, cfg) -> "DPSettings | None":
        if not cfg.dp_noise > 0:
            return None
        return cls(cfg.dp_noise, cfg.dp_clip, cfg.dp_delta, cfg.dp_level, cfg.dp_accountant)


# --------------------------------------------------------------------------------------------- checks

def check_config(cfg, algo) -> None:
    """Bad privacy values, and an algorithm (``algo``: the run's :class:`rayfl.algorithms.base.Algorithm`) the
    chosen level cannot cover: ValueError naming the value, which the config reports as a user error."""
    if not cfg.dp_noise >= 0:
        raise ValueError(f"dp_noise={cfg.dp_noise}: must be >= 0 (0: no differential privacy)")
    if not cfg.dp_clip > 0:
        raise ValueError(f"dp_clip={cfg.dp_clip}: must be > 0")
    if not 0 < cfg.dp_delta < 1:
        raise ValueError(f"dp_delta={cfg.dp_delta}: must be in (0, 1)")
    for name, allowed in (("dp_level", LEVELS), ("dp_accountant", ACCOUNTANTS)):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: unknown; allowed: {', '.join(allowed)}")
    if not cfg.dp_noise > 0:
        for name in ("dp_clip", "dp_delta", "dp_level", "dp_accountant"):  # a DP knob set for a run without DP
            if getattr(cfg, name) != getattr(type(cfg), name):  # the config class's default
                raise ValueError(f"{name}={getattr(cfg, name)!r}: differential privacy is off (dp_noise=0); give "
                                 f"dp_noise > 0 (--dp-noise) to turn it on, or leave {name} at its default")
        return
    if cfg.dp_level == "user":
        if not algo.capability("averages"):
            raise ValueError(f"algo={cfg.algo!r}: dp_level=user cannot cover it: its server does not average client "
                            "updates through the reduction (Server.averages), its uploads are individual models, "
                            "so there is no sum to clip and noise")
        return
    promise = algo.capability("private_training")
    if promise is not True:
        why = promise if isinstance(promise, str) else (
            "it does not declare that all its training goes through client.fit / training.train_epochs "
            "(ClientLogic.private_training)")
        raise ValueError(f"algo={cfg.algo!r}: dp_level=sample cannot cover it: {why}")


def check_model(cfg, model, name: str) -> None:
    """A network DP-SGD cannot train (sample level): ValueError naming the layer, once the run's model is built
    (before any actor starts)."""
    layer = unsupported_layer(model) if cfg.dp_noise > 0 and cfg.dp_level == "sample" else None
    if layer:
        raise ValueError(f"model={name!r}: dp_level=sample cannot train it: {layer}")


def unsupported_layer(model) -> str | None:
    """Why DP-SGD cannot train ``model`` (its first layer that mixes the samples of a batch), or None.

    BatchNorm normalizes each sample by its batch's statistics (and keeps running statistics of the data in
    buffers that travel with the model), so a sample's gradient depends on the other samples and clipping it
    bounds nothing; Opacus's ModuleValidator refuses it for the same reason and offers GroupNorm."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and (
                isinstance(module, nn.modules.batchnorm._BatchNorm) or module.track_running_stats):
            return (f"layer {name!r} ({type(module).__name__}) mixes the samples of a batch, so per-sample "
                    "gradients do not exist; use GroupNorm or LayerNorm (Opacus's ModuleValidator.fix does)")
    return None


# --------------------------------------------------------------------------------------------- accounting

def _accountant(kind: str, history: list):
    """Opacus's accountant of ``kind`` holding ``history``."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = RDPAccountant() if kind == "rdp" else PRVAccountant()
    acc.history = [(float(s), float(q), int(n)) for s, q, n in history]
    return acc


def spend(history: list, noise: float, rate: float, steps: int, kind: str = "rdp") -> None:
    """Record ``steps`` steps of the sampled Gaussian mechanism (noise multiplier, sample rate) in ``history``, in
    place, as Opacus's accountant records them (consecutive equal steps merged)."""
    if steps <= 0:
        return
    acc = _accountant(kind, history)
    for _ in range(steps):
        acc.step(noise_multiplier=noise, sample_rate=rate)
    history[:] = [[s, q, n] for s, q, n in acc.history]


_EPSILON: dict = {}  # (history, delta, kind) -> ε: clients with the same history (equal sizes) share one value


def epsilon(history: list, delta: float, kind: str = "rdp") -> float:
    """ε at δ after every step in ``history`` (0 before any), from Opacus's accountant."""
    if not history:
        return 0.0
    key = (tuple(tuple(h) for h in history), delta, kind)
    if key not in _EPSILON:
        if len(_EPSILON) > 4096:
            _EPSILON.clear()
        _EPSILON[key] = _rdp_epsilon(history, delta) if kind == "rdp" else _prv_epsilon(history, delta)
    return _EPSILON[key]


def _prv_epsilon(history: list, delta: float) -> float:
    """Opacus's ``PRVAccountant.get_epsilon``; a ValueError where it has no finite answer (its numerical range
    ends at small noise multipliers: it returns inf, or NaN, where RDP still bounds ε)."""
    import warnings

    with warnings.catch_warnings():  # its overflows are the inf below, said once
        warnings.simplefilter("ignore", RuntimeWarning)
        eps = float(_accountant("prv", history).get_epsilon(delta))
    if not math.isfinite(eps):
        sigmas = ", ".join(sorted({f"{s:g}" for s, _, _ in history}))
        raise ValueError(f"dp_accountant='prv': Opacus's PRV accountant has no finite ε at noise multiplier "
                         f"{sigmas} (outside its numerical range); use dp_accountant=rdp (ε "
                         f"{_rdp_epsilon(history, delta):.4g} here) or a larger dp_noise")
    return eps


_RDP_STEP: dict = {}  # (noise multiplier, sample rate) -> Opacus's RDP of one step at its default orders


def _rdp_epsilon(history: list, delta: float) -> float:
    """Opacus's ``RDPAccountant.get_epsilon`` over ``history``, term for term: Σ compute_rdp(q, σ, steps) at its
    default orders, then its conversion to (ε, δ). compute_rdp is one step's RDP times the steps, so one step's
    is kept per (σ, q): the same floats, without recomputing at every evaluation what only the steps change
    (at a round's evaluation it took half a second an actor)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    orders = RDPAccountant.DEFAULT_ALPHAS
    terms = []
    for s, q, n in history:
        key = (float(s), float(q))
        if key not in _RDP_STEP:
            _RDP_STEP[key] = analysis.compute_rdp(q=key[1], noise_multiplier=key[0], steps=1, orders=orders)
        terms.append(_RDP_STEP[key] * int(n))
    eps, _ = analysis.get_privacy_spent(orders=orders, rdp=sum(terms), delta=delta)
    return float(eps)


def client_epsilon(client) -> float | None:
    """The client's ε at δ over all its private steps so far; None unless sample-level DP is on."""
    dp = client.settings.dp
    if dp is None or dp.level != "sample":
        return None
    return epsilon(client.state.get(HISTORY, []), dp.delta, dp.accountant)


# --------------------------------------------------------------------------------------------- the private path

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("rayfl_private_training", default=None)


@dataclass
class Account:
    """The privacy account of the client whose step is running: its settings, where its history lives, and
    what keys the step's releases (:meth:`generator`)."""

    dp: DPSettings
    client: Any
    step_name: str = ""  # the client step running (train, distill, specialist, ...)
    step: int = 0  # how many private client steps this client ran before this one
    label: tuple = ()  # what the caller says is being trained (:func:`release_key`: a model, a grid point)
    releases: dict = field(default_factory=dict)  # label -> releases under it so far in this step

    def spend(self, rate: float, steps: int) -> None:
        spend(self.client.state.setdefault(HISTORY, []), self.dp.noise, rate, steps, self.dp.accountant)

    def generator(self):
        """A generator of its own for the step's next release (its Poisson batches and its noise), keyed by
        (seed, client, step name, step, label, how many releases this step made under that label before): no
        two releases of a client share a batch or a noise draw, and a replayed step redraws its own."""
        k = self.releases.get(self.label, 0)
        self.releases[self.label] = k + 1
        return release_generator(getattr(self.client, "seed", 0), getattr(self.client, "cid", 0), self.step_name,
                                 self.step, self.label, k)


def release_generator(seed: int, cid: int, step_name: str, step: int, label: tuple, k: int):
    """The torch generator of one private release, from its key alone (a hash of it: labels may hold floats)."""
    import torch

    key = repr((int(seed), int(cid), str(step_name), int(step), tuple(label), int(k))).encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    return torch.Generator().manual_seed(value)


@contextlib.contextmanager
def training_of(client, step_name: str = ""):
    """While one client step (``step_name``) runs: training (``training.train_epochs``) takes the private path
    and charges this client's account when sample-level DP is on; otherwise nothing changes.

    Each private training call is its own release with its own generator (:meth:`Account.generator`), not the
    caller's: the accountant composes releases as independent Gaussian mechanisms on independent Poisson
    samples (Mironov 2017, Prop. 1; Abadi et al. 2016, Sec. 3.1), which two students trained from one generator
    state (the same batches, the same noise) would not be."""
    dp = client.settings.dp
    if dp is None or dp.level != "sample":
        yield
        return
    from rayfl import training

    step = int(client.state.get(STEPS, 0))
    client.state[STEPS] = step + 1
    account = Account(dp, client, step_name, step)
    token = _ACTIVE.set(account)
    private = training.PRIVATE_TRAINER.set(
        lambda model, x, y, epochs, batch_size, optimizer, loss_fn, gen:
        train_epochs(model, x, y, epochs, batch_size, optimizer, loss_fn, account.generator(), account))
    try:
        yield
    finally:
        training.PRIVATE_TRAINER.reset(private)
        _ACTIVE.reset(token)


@contextlib.contextmanager
def release_key(*label):
    """Releases made inside are keyed by ``label`` as well (a PersFL grid point): the same label in the same
    client step draws the same batches and noise whether the other labels are trained or not (a grid point
    run alone equals that point inside the grid). Nothing changes outside a private step."""
    account = active()
    if account is None:
        yield
        return
    saved, account.label = account.label, tuple(label)
    try:
        yield
    finally:
        account.label = saved


def active() -> Account | None:
    """The running client step's account, when its training must be private."""
    return _ACTIVE.get()


# --------------------------------------------------------------------------------------------- for an algorithm
# An algorithm whose step trains through client.fit / training.train_epochs needs nothing of this module. One
# whose step computes gradients of its own (FedeRiCo's weighted gradients for its neighbours' models) asks
# whether the step is private, and takes its gradients from here as one release; one that trains several models
# in a step keys their releases apart (release_key).
FOR_ALGORITHMS = ("private_step", "private_gradients", "release_key")  # all an algorithm module may call here

def private_step() -> bool:
    """Whether the running client step is under sample-level DP: its data may be read only through a release
    of this module (:func:`private_gradients`), and what it reads outside one (a validation split) is not
    covered."""
    return _ACTIVE.get() is not None


def private_gradients(parts: list[tuple], x, y, batch_size: int) -> list[list]:
    """One DP-SGD release (Abadi et al. 2016, Algorithm 1) of the gradients of several models' mean losses on
    (x, y), the running client's training data: a Poisson sample at rate batch_size / n, every sample's
    gradients for all the models clipped together to norm C, Gaussian noise σ·C on each sum, divided by the
    expected batch size; the client's account charged once. ``parts``: [(model, params, loss_fn), ...];
    returns, per part, the privatized gradient of each of its params."""
    account = _ACTIVE.get()
    if account is None:
        raise RuntimeError("private_gradients: called outside a private client step (see private_step)")
    n = x.shape[0]
    rate, _ = batch_plan(n, batch_size)
    gen = account.generator()  # the release's own batch and noise
    idx = poisson_batch(n, rate, gen, x.device)
    sums, _ = noisy_gradient(parts, x[idx], y[idx], account.dp.noise, account.dp.clip, rate * n, gen)
    account.spend(rate, 1)
    out, k = [], 0
    for _, params, _ in parts:
        out.append(list(sums[k:k + len(params)]))
        k += len(params)
    return out


def poisson_batch(n: int, rate: float, gen, device) -> Any:
    """Indices of a Poisson sample of n items: each in with probability ``rate``, independently (the sampling
    Opacus's accountants assume; a batch may be empty)."""
    import torch

    return (torch.rand(n, generator=gen) < rate).nonzero().squeeze(1).to(device)


def batch_plan(n: int, batch_size: int) -> tuple[float, int]:
    """(sample rate q, steps per epoch): q = batch_size / n, as many steps per epoch as plain training takes."""
    return min(1.0, batch_size / n), -(-n // batch_size)


def trained_params(model, optimizer) -> list:
    """The parameters ``optimizer`` updates (FlatSGD: every trainable parameter of the flat model)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return [p for p in model.parameters() if p.requires_grad]
    return [p for g in groups for p in g["params"] if p.requires_grad]


def per_sample_grads(parts: list[tuple], x, y) -> tuple[list, Any]:
    """Per-sample gradients of several models' losses on the same samples (``torch.func``): ``parts`` is
    [(model, params, loss_fn), ...]; returns the gradients (one [B, *shape] tensor per parameter, the models'
    parameters in order) and the per-sample losses ([B, len(parts)])."""
    import torch
    from torch.func import functional_call, grad, vmap

    names = []
    for model, params, _ in parts:
        by_id = {id(p): name for name, p in model.named_parameters()}
        names.append([by_id[id(p)] for p in params])

    def loss_one(primals, xi, yi):
        xb, yb = xi.unsqueeze(0), yi.unsqueeze(0)
        losses = torch.stack([fn(functional_call(model, dict(zip(keys, ps)), (xb,)), yb)
                              for (model, _, fn), keys, ps in zip(parts, names, primals)])
        return losses.sum(), losses.detach()

    primals = tuple(tuple(p.detach() for p in params) for _, params, _ in parts)
    grads, losses = vmap(grad(loss_one, has_aux=True), in_dims=(None, 0, 0), randomness="different")(primals, x, y)
    return [g for per_model in grads for g in per_model], losses


def clip_and_add(per_sample: list, clip: float, sums: list) -> Any:
    """Add Σ_i g_i · min(1, C / (‖g_i‖ + 1e-6)) to ``sums`` in place, ‖g_i‖ the norm of sample i's gradient over
    every tensor of ``per_sample`` together (Abadi et al. 2016, Alg. 1 "clip gradient"; Opacus's flat clipping);
    returns the per-sample norms."""
    import torch

    norms = torch.stack([g.reshape(g.shape[0], -1).norm(2, dim=1) for g in per_sample], dim=1).norm(2, dim=1)
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    for g, total in zip(per_sample, sums):
        total.add_(torch.einsum("i,i...->...", factor, g))
    return norms


def materialized_sum(parts: list[tuple], x, y, clip: float) -> tuple[list, float, Any]:
    """Σ_i g_i · min(1, C / (‖g_i‖ + 1e-6)) from the per-sample gradients themselves (``torch.func``), in chunks
    of samples so that a large model or batch keeps CHUNK_ELEMENTS at most; the batch's summed loss and the
    per-sample norms."""
    import torch

    params = [p for _, ps, _ in parts for p in ps]
    sums = [torch.zeros_like(p) for p in params]
    size = sum(p.numel() for p in params)
    chunk = max(1, CHUNK_ELEMENTS // max(size, 1))
    loss, norms = 0.0, []
    for start in range(0, x.shape[0], chunk):
        grads, losses = per_sample_grads(parts, x[start:start + chunk], y[start:start + chunk])
        norms.append(clip_and_add(grads, clip, sums))
        loss += float(losses.sum())
    return sums, loss, torch.cat(norms) if norms else torch.zeros(0)


_NOISE: dict = {}  # count -> the CPU buffer the last draws of that many went into


def gaussian_noise(count: int, gen, device) -> Any:
    """``count`` standard normal draws from ``gen`` (on the CPU, moved to ``device``), one call for a whole
    gradient, into a buffer kept for the next step (a fresh 600 kB tensor a step costs page faults): the draws
    are most of what DP adds to a small model's step. Valid until the next call for as many draws."""
    import torch

    buf = _NOISE.get(count)
    if buf is None:
        _NOISE.clear()  # one size at a time (a run's model); a new size replaces it
        buf = _NOISE[count] = torch.empty(count)
    return buf.normal_(generator=gen).to(device)


def noisy_gradient(parts: list[tuple], x, y, noise: float, clip: float, expected: float, gen,
                   materialize: bool = False, out: list | None = None) -> tuple[list, float]:
    """One DP-SGD gradient on a batch: every sample's gradient over every part's parameters clipped to C, summed,
    plus N(0, σ²C²) per coordinate, over the expected batch size. Returns (a gradient per parameter, the batch's
    summed loss). The clipped sum comes from per-sample norms without per-sample gradients
    (:mod:`rayfl.clipping`) where the model's layers allow, else (or with ``materialize``) from the per-sample
    gradients; the noise is the same draw either way. ``out``: a tensor per parameter to write the gradient into
    (returned), else new ones."""
    import torch

    from rayfl import clipping

    fast = None
    if x.shape[0] and not materialize:
        fast = clipping.clipped_sum(parts, x, y, clip, 1.0 / expected,  # already over the expected batch size
                                    reference=lambda *batch: materialized_sum(*batch, clip)[2], out=out)
    if fast is not None:
        sums, loss, _ = fast
    else:
        sums, loss = [torch.zeros_like(p) for _, ps, _ in parts for p in ps], 0.0
        if x.shape[0]:
            sums, loss, _ = materialized_sum(parts, x, y, clip)
        for total in sums:
            total.div_(expected)
        if out is not None:
            for o, total in zip(out, sums):
                o.copy_(total)
            sums = list(out)
    z = gaussian_noise(sum(t.numel() for t in sums), gen, sums[0].device) if noise > 0 and sums else None
    offset = 0
    for total in sums if z is not None else ():  # + N(0, σ²C²) per coordinate, over the expected batch size
        total.add_(z[offset:offset + total.numel()].view_as(total), alpha=noise * clip / expected)
        offset += total.numel()
    return sums, loss


def set_grads(params: list, grads: list) -> None:
    """The privatized gradient where the optimizer reads it (FlatSGD's flat buffer, through each ``.grad`` view)."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g
        elif p.grad is not g:
            p.grad.copy_(g)


def train_epochs(model, x, y, epochs: int, batch_size: int, optimizer, loss_fn: Callable, gen, account: Account,
                 ) -> float:
    """DP-SGD over (x, y): ``rayfl.training.train_epochs`` when the running step's training must be private.
    Steps per epoch as plain training takes; the account is charged (σ, q) for each. Returns the mean loss per
    sample seen in the last epoch."""
    import torch

    from rayfl import training

    layer = unsupported_layer(model)
    if layer:
        raise ValueError(f"dp_level=sample cannot train this model: {layer}")
    training.set_mode(model, training=True)
    dp, n = account.dp, x.shape[0]
    rate, steps = batch_plan(n, batch_size)
    params = trained_params(model, optimizer)
    parts = [(model, params, loss_fn)]
    # every step writes the whole gradient into the same tensors (FlatSGD's flat buffer through its views)
    grads = [p.grad if p.grad is not None and p.grad.shape == p.shape else torch.zeros_like(p) for p in params]
    loss, seen = float("nan"), 0
    for _ in range(epochs):
        loss, seen = 0.0, 0
        for _ in range(steps):
            idx = poisson_batch(n, rate, gen, x.device)
            grads, batch_loss = noisy_gradient(parts, x[idx], y[idx], dp.noise, dp.clip, rate * n, gen, out=grads)
            set_grads(params, grads)
            optimizer.step()
            loss, seen = loss + batch_loss, seen + int(idx.numel())
    account.spend(rate, steps * epochs)
    return loss / seen if seen else float("nan")


# --------------------------------------------------------------------------------------------- user level

def user_level_average(total, start, dp: DPSettings, rate: float, n_clients: int, rng) -> Any:
    """θ + (Σ_k clip(Δ_k, S) + N(0, z²S²)) / (q·K): DP-FedAvg's round (McMahan et al. 2018, Alg. 1, estimator
    f̃_f with w_k = 1 and its fixed denominator q·W = q·K, which needs no count of the participants)."""
    import numpy as np

    start = np.asarray(start, dtype=np.float64)
    total = np.zeros_like(start) if total is None else total
    noisy = total + rng.normal(0.0, dp.noise * dp.clip, size=start.shape)
    return (start + noisy / (rate * n_clients)).astype(np.float32)


# --------------------------------------------------------------------------------------------- tracking

def run_tags(cfg) -> dict[str, str]:
    """MLflow tags of a private run (none for another): σ, C, δ, level, accountant."""
    dp = DPSettings.from_config(cfg)
    if dp is None:
        return {}
    return {"rayfl.dp": "on", "rayfl.dp.noise": str(dp.noise), "rayfl.dp.clip": str(dp.clip),
            "rayfl.dp.delta": str(dp.delta), "rayfl.dp.level": dp.level, "rayfl.dp.accountant": dp.accountant}


def final_epsilon(cfg, final: dict | None) -> float | None:
    """The ε a private run reached (the largest over clients), when it is known and finite."""
    if DPSettings.from_config(cfg) is None:
        return None
    eps = (final or {}).get("dp_epsilon_max")
    return float(eps) if eps is not None and math.isfinite(eps) else None


def final_tags(cfg, final: dict | None) -> dict[str, str]:
    """The tag a private run gets at its end: ``rayfl.dp.epsilon``, the final ε (the largest over clients)."""
    eps = final_epsilon(cfg, final)
    return {} if eps is None else {"rayfl.dp.epsilon": f"{eps:.6g}"}


def run_name(name: str | None, cfg) -> str | None:
    """The MLflow run name, marked private at its start (``DP σ=1 fedavg-...``), where a narrow column of the
    runs table still shows it."""
    dp = DPSettings.from_config(cfg)
    if dp is None or name is None:
        return name
    return f"{mark(dp)} {name}"


def mark(dp: DPSettings) -> str:
    """The short mark of a private run: ``DP σ=1`` (sample level) or ``DP-user z=1``."""
    return f"DP σ={dp.noise:g}" if dp.level == "sample" else f"DP-user z={dp.noise:g}"


def headline(cfg) -> str:
    """What the run's privacy is, for its first console lines: ``DP-SGD σ=1, C=1, δ=1e-05 (sample level)``;
    empty for a run without it."""
    dp = DPSettings.from_config(cfg)
    if dp is None:
        return ""
    accountant = f"{dp.accountant.upper()} accountant"
    if dp.level == "sample":
        return f"DP-SGD σ={dp.noise:g}, C={dp.clip:g}, δ={dp.delta:g} (sample level, {accountant})"
    return f"DP-FedAvg z={dp.noise:g}, S={dp.clip:g}, δ={dp.delta:g} (user level, {accountant})"


def plot_title(cfg, final: dict | None) -> str:
    """What a private run's plot titles add: `` · DP σ=1, ε=3.2 at δ=1e-05`` (empty without DP), in no-break
    spaces, so that a wrapped title keeps it on one line."""
    dp = DPSettings.from_config(cfg)
    if dp is None:
        return ""
    eps = final_epsilon(cfg, final)
    text = mark(dp) + (f", ε={eps:.3g} at δ={dp.delta:g}" if eps is not None else "")
    return " · " + text.replace(" ", "\u00a0")


def describe(cfg, final: dict | None = None) -> str:
    """What a run's description adds about privacy (empty for a run without it), with the final ε if known."""
    dp = DPSettings.from_config(cfg)
    if dp is None:
        return ""
    what = (f"DP-SGD per sample (σ={dp.noise:g}, C={dp.clip:g})" if dp.level == "sample"
            else f"user-level DP-FedAvg (z={dp.noise:g}, S={dp.clip:g})")
    eps = final_epsilon(cfg, final)
    reached = f", ε={eps:.3g}" if eps is not None else ""
    return f"; {what}, {dp.accountant.upper()} accountant{reached} at δ={dp.delta:g}"
