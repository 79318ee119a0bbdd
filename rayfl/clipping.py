"""DP-SGD's clipped gradient sum without per-sample gradients: per-sample gradient norms from each layer's input
activations and output gradients, then the clipped sum from the same two tensors (book-keeping).

For a layer whose output is o = W a + b, sample i's weight gradient is g_iᵀ a_i (g_i = ∂ℓ_i/∂o_i), so

- a linear layer on one vector per sample: ‖∇W ℓ_i‖² = ‖a_i‖²·‖g_i‖² (Goodfellow 2015, "Efficient per-example
  gradient computations"); on a sequence (a_i: T x d_in): ‖a_i a_iᵀ ∘ g_i g_iᵀ‖₁, the sum of the elementwise
  product of the two T x T Gram matrices (ghost clipping, Li, Tramèr, Liang and Hashimoto 2022, Sec. 4);
- a convolution is a linear layer on the unfolded input (L positions of C_in·k patches; Bu, Mao and Xu 2022,
  "Scalable and efficient training of large CNNs with DP", Sec. 3): Gram matrices of L x L (its per-sample
  gradients, where L² exceeds the weight's size, come from one convolution grouped by sample);
- an embedding (a_i: T token ids): Σ_{t,t'} [a_t = a_t'] g_t·g_t', the same Gram with the one-hot inputs;
- a bias, LayerNorm's and GroupNorm's affine parameters: their per-sample gradients are sums of g (times the
  normalized input) over positions, parameter-sized, computed directly.

Where a sequence is long (T² or L² above the weight's size) the layer's per-sample gradients cost less than
its Gram matrices and are formed for that layer alone (the mixed rule of Bu et al. 2022, Sec. 3.2). The clipped
sum Σ_i c_i ∇ℓ_i (c_i = min(1, C / (‖∇ℓ_i‖ + 1e-6))) is then Σ_i c_i g_iᵀ a_i, one matrix product a layer,
with no second backward pass (book-keeping, Bu, Wang, Zha and Karypis 2023, Sec. 3). One backward pass gives
every layer's output gradient; autograd skips the parameter gradients no one asked for, so a private step
costs about a plain one plus the norms.

A layer without a rule here (a custom module owning parameters) has its own per-sample gradients formed from
the same two tensors (``torch.func``: a vjp of the layer alone per sample), said once per layer type. A model
these hooks cannot read (a parameter shared between modules or used outside its module's call, a module
called twice in a forward pass, a fallback layer with several inputs or outputs) returns None: the caller
takes the materialized path. Every architecture is checked once, on its first batch, against autograd's summed
gradient and the per-sample norms of the materialized path, so a parameter used where no hook sees it, or a
layer that holds the samples elsewhere than in its first dimension, sends it to the materialized path rather
than under-counting a norm.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

_SAID: set[str] = set()  # fallbacks already announced in this process


def say_once(key: str, message: str) -> None:
    """A warning the first time ``key`` is seen in this process."""
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(f"rayfl: DP-SGD: {message}", RuntimeWarning, stacklevel=3)


def per_sample_losses(loss_fn: Callable, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ_i = loss_fn(out_i, y_i) on each sample as a batch of one ([B]): what the materialized path
    differentiates, whatever ``loss_fn``'s reduction. Cross-entropy and MSE directly, any other loss under vmap."""
    if loss_fn is F.cross_entropy and out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
        return F.cross_entropy(out, y, reduction="none")
    if loss_fn is F.mse_loss and out.shape == y.shape:
        return F.mse_loss(out, y, reduction="none").reshape(out.shape[0], -1).mean(1)
    from torch.func import vmap

    return vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)), randomness="different")(out, y)


# --------------------------------------------------------------------------------------------- rules

def _gram_norm2(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σ_{t,t'} (a_t·a_t')(g_t·g_t') per sample, a: [B, T, p], g: [B, T, q] (= ‖g_iᵀ a_i‖²_F)."""
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def _matrix_rule(a: torch.Tensor, g: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, Callable]:
    """Weight of a layer whose per-sample gradient is g_iᵀ a_i (a: [B, T, p], g: [B, T, q]): its per-sample norms²
    and a function of the clip factors writing Σ_i c_i g_iᵀ a_i into a tensor of the weight's shape."""
    B, T, p = a.shape
    q = g.shape[2]
    if T == 1:
        norm2 = a.reshape(B, p).pow(2).sum(1) * g.reshape(B, q).pow(2).sum(1)
    elif T * T <= p * q:
        norm2 = _gram_norm2(a, g)
    else:  # the Gram matrices would cost more than the layer's per-sample gradients: form those (Bu et al. 2022)
        per = torch.bmm(g.transpose(1, 2), a)  # [B, q, p]
        norm2 = per.pow(2).sum((1, 2))
        return norm2, lambda c, out: torch.mv(per.reshape(B, -1).t(), c, out=out.view(-1))

    def clipped(c: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.mm((g * c.view(B, 1, 1)).reshape(B * T, q).t(), a.reshape(B * T, p), out=out.view(q, p))

    return norm2, clipped


def _sum_rule(per: torch.Tensor) -> tuple[torch.Tensor, Callable]:
    """A parameter whose per-sample gradients ``per`` ([B, *shape]) are parameter-sized sums: norms² and sum."""
    flat = per.reshape(per.shape[0], -1)
    return flat.pow(2).sum(1), lambda c, out: torch.mv(flat.t(), c, out=out.view(-1))


def _linear(m: nn.Linear, a, g) -> dict:
    B = a.shape[0]
    a, g = a.reshape(B, -1, m.in_features), g.reshape(B, -1, m.out_features)
    out = {"weight": lambda: _matrix_rule(a, g, m.weight.shape)}
    if m.bias is not None:
        out["bias"] = lambda: _sum_rule(g.reshape(B, m.out_features) if g.shape[1] == 1 else g.sum(1))
    return out


def _conv_per_sample(m, a, g, kernel, dilation, padding, stride) -> torch.Tensor:
    """A 2-d convolution's per-sample weight gradients [B, C_out, C_in, kh, kw] as one convolution grouped by
    sample: the input's samples as channels, the output gradients as kernels, stride and dilation swapped
    (Rochette, Manoel and Tramel 2019, "Efficient per-example gradient computations in CNNs", Sec. 3)."""
    B, c_in = a.shape[:2]
    c_out = g.shape[1]
    out = F.conv2d(a.transpose(0, 1), g.reshape(B * c_out, 1, *g.shape[2:]), padding=padding, stride=dilation,
                   dilation=stride, groups=B)  # [C_in, B·C_out, >= kh, >= kw]
    out = out[:, :, :kernel[0], :kernel[1]]
    return out.reshape(c_in, B, c_out, *kernel).permute(1, 2, 0, 3, 4)


def _conv(m: nn.Conv2d | nn.Conv1d, a, g) -> dict:
    B = a.shape[0]
    if isinstance(m, nn.Conv1d):  # a conv1d is a conv2d of height 1
        a, g = a.unsqueeze(2), g.unsqueeze(2)
        kernel, dilation, padding, stride = (1, *m.kernel_size), (1, *m.dilation), (0, *m.padding), (1, *m.stride)
    else:
        kernel, dilation, padding, stride = m.kernel_size, m.dilation, m.padding, m.stride
    positions = g.shape[2] * g.shape[3]

    def weight():
        if positions * positions <= m.weight.numel():  # L² Gram entries fewer than a per-sample gradient's
            cols = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)  # [B, C_in·k, L]
            return _matrix_rule(cols.transpose(1, 2), g.reshape(B, m.out_channels, -1).transpose(1, 2),
                                m.weight.shape)
        per = _conv_per_sample(m, a, g, kernel, dilation, padding, stride)
        return _sum_rule(per.reshape(B, *m.weight.shape))

    out = {"weight": weight}
    if m.bias is not None:
        out["bias"] = lambda: _sum_rule(g.sum((2, 3)))
    return out


def _embedding(m: nn.Embedding, a, g) -> dict:
    B = a.shape[0]
    ids, g = a.reshape(B, -1), g.reshape(B, -1, m.embedding_dim)
    if m.padding_idx is not None:  # the padding row gets no gradient
        g = g * (ids != m.padding_idx).unsqueeze(2).to(g.dtype)

    def rule():
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(g.dtype)  # one-hot Gram: [a_t = a_t']
        norm2 = (same * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

        def clipped(c, out):
            return out.zero_().index_add_(0, ids.reshape(-1), (g * c.view(B, 1, 1)).reshape(-1, m.embedding_dim))

        return norm2, clipped

    return {"weight": rule}


def _layer_norm(m: nn.LayerNorm, a, g) -> dict:
    dims = tuple(range(1, a.dim() - len(m.normalized_shape)))  # positions, summed over
    out = {}
    if m.weight is not None:
        xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
        out["weight"] = lambda: _sum_rule((g * xhat).sum(dims) if dims else g * xhat)
    if m.bias is not None:
        out["bias"] = lambda: _sum_rule(g.sum(dims) if dims else g)
    return out


def _group_norm(m: nn.GroupNorm, a, g) -> dict:
    B = a.shape[0]
    out = {}
    if m.weight is not None:
        xhat = F.group_norm(a, m.num_groups, eps=m.eps)
        out["weight"] = lambda: _sum_rule((g * xhat).reshape(B, m.num_channels, -1).sum(2))
    if m.bias is not None:
        out["bias"] = lambda: _sum_rule(g.reshape(B, m.num_channels, -1).sum(2))
    return out


def rule_for(m: nn.Module) -> Callable | None:
    """The fast rule of a layer type (its parameters' norms and clipped sums from input and output gradient)."""
    if type(m) is nn.Linear:
        return _linear
    if type(m) in (nn.Conv1d, nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros" \
            and not isinstance(m.padding, str):
        return _conv
    if type(m) is nn.Embedding and not m.scale_grad_by_freq:
        return _embedding
    if type(m) is nn.LayerNorm:
        return _layer_norm
    if type(m) is nn.GroupNorm:
        return _group_norm
    return None


def _fallback(m: nn.Module, names: list[str], a, g) -> dict:
    """Any other layer: its per-sample gradients (of its own parameters only) from its input and output gradient,
    a vjp of the layer alone per sample (``torch.func``)."""
    from torch.func import functional_call, vjp, vmap

    primals = {name: getattr(m, name).detach() for name in names}

    def one(ai, gi):
        _, back = vjp(lambda ps: functional_call(m, ps, (ai.unsqueeze(0),)), primals)
        return back(gi.unsqueeze(0))[0]

    per = vmap(one, randomness="different")(a, g)
    return {name: (lambda name=name: _sum_rule(per[name])) for name in names}


# --------------------------------------------------------------------------------------------- the step

class _Unit:
    """A module that owns trained parameters, and what its forward call left: its input and its output."""

    __slots__ = ("module", "name", "names", "params", "rule", "input", "output", "calls", "version", "protect")

    def __init__(self, module, name, names, params, rule):
        self.module, self.name, self.names, self.params, self.rule = module, name, names, params, rule
        self.input = self.output = None
        self.calls = self.version = 0
        self.protect = False  # an in-place op modifies its output: the hook hands on a copy


def units_of(model: nn.Module, trained: set[int]) -> list[_Unit] | str:
    """The modules owning the trained parameters, or why hooks cannot read this model."""
    units, owner = [], {}
    for name, m in model.named_modules(remove_duplicate=False):
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) in trained]
        if not own:
            continue
        for _, p in own:
            if id(p) in owner and owner[id(p)] is not m:
                return f"a parameter is shared by {owner[id(p)]} and {name or 'the model'}"
            owner[id(p)] = m
        if any(u.module is m for u in units):
            continue
        units.append(_Unit(m, name or type(m).__name__, [n for n, _ in own], [p for _, p in own], rule_for(m)))
    return units


def clipped_sum(parts: list[tuple], x, y, clip: float, scale: float = 1.0, reference: Callable | None = None,
                out: list | None = None) -> tuple[list, float, torch.Tensor] | None:
    """Σ_i c_i ∇ℓ_i for every parameter of ``parts`` ([(model, params, loss_fn), ...], their losses summed per
    sample, every sample's gradient over all of them clipped together to C; times ``scale``), the summed loss and
    the per-sample norms; None where a model's layers cannot be read this way (the caller materializes).
    ``reference(parts, x, y)``: the per-sample norms from the per-sample gradients, which the first batch of an
    architecture is checked against too (a layer that mixes samples, or holds them elsewhere than in its first
    dimension, would keep the summed gradient right and the norms wrong). ``out``: a tensor per parameter to
    write the sums into (its gradient buffers: a fresh 600 kB tensor a step costs page faults)."""
    trained = {id(p) for _, params, _ in parts for p in params}
    all_units, hooks, capturing, check = [], [], [True], []
    for model, _, _ in parts:
        units = model.__dict__.get("_rayfl_units")
        if units is None or units[0] != trained:
            found = units_of(model, trained)
            if isinstance(found, str):
                say_once(f"model:{type(model).__name__}:{found}",
                         f"{type(model).__name__}: {found}; its per-sample gradients are materialized")
                return None
            units = (trained, found)
            model.__dict__["_rayfl_units"] = units
            model.__dict__.pop("_rayfl_checked", None)  # another set of trained parameters: look it up again
        verdict = model.__dict__.get("_rayfl_checked")
        if verdict is None:
            verdict = _CHECKED.get(_architecture(model, trained))
            if verdict is not None:
                model.__dict__["_rayfl_checked"] = verdict
        if verdict is False:
            return None
        if verdict is None:
            check.append(model)
        all_units.extend(units[1])
    for u in all_units:
        u.input, u.output, u.calls = None, None, 0
        if u.rule is None:
            say_once(f"layer:{type(u.module).__name__}",
                     f"layer {u.name!r} ({type(u.module).__name__}) has no per-sample norm rule; its own per-sample "
                     "gradients are formed from its input and output gradient")

        def hook(module, args, output, u=u):
            if not capturing[0]:
                return None
            u.calls += 1
            u.input = args[0] if len(args) == 1 and torch.is_tensor(args[0]) else None
            if not torch.is_tensor(output):
                u.output = None
                return None
            u.output, u.version = output, output._version
            return output + 0 if u.protect and output.requires_grad else None

        hooks.append(u.module.register_forward_hook(hook))
    try:
        total, loss = 0.0, 0.0
        for model, _, loss_fn in parts:
            losses = per_sample_losses(loss_fn, model(x), y)
            total = total + losses.sum()
            loss += float(losses.detach().sum())
    finally:
        capturing[0] = False
        for h in hooks:
            h.remove()
    fired = [u for u in all_units if u.calls]
    modified = [u for u in fired if u.output is not None and u.output._version != u.version]
    if modified:  # an in-place op (ReLU(inplace=True)) changed a layer's output: hand on copies, run again
        for u in modified:
            u.protect = True
        return clipped_sum(parts, x, y, clip, scale, reference, out)
    for u in fired:
        if u.calls > 1 or u.output is None or u.input is None or not u.output.requires_grad \
                or u.input.shape[0] != x.shape[0] or u.output.shape[0] != x.shape[0]:
            why = ("is called more than once in a forward pass" if u.calls > 1 else
                   "has several inputs or outputs" if u.output is None or u.input is None else
                   "does not hold the samples in its first dimension")
            say_once(f"unit:{type(u.module).__name__}:{why}", f"layer {u.name!r} ({type(u.module).__name__}) {why}; "
                     "the model's per-sample gradients are materialized")
            return None
    unfired = [p for u in all_units if not u.calls for p in u.params]
    check_params = [p for model in check for p in _trained_in(model, trained) if not any(p is q for q in unfired)]
    wanted = [u.output for u in fired] + unfired + check_params
    grads = torch.autograd.grad(total, wanted, allow_unused=True) if wanted and torch.is_tensor(total) \
        and total.requires_grad else [None] * len(wanted)
    outs, rest = grads[:len(fired)], grads[len(fired):]
    if any(gr is not None and bool(gr.ne(0).any()) for gr in rest[:len(unfired)]):
        say_once("unfired", "a parameter is used outside its module's call; the model's per-sample gradients are "
                            "materialized")
        return None
    rules = {}
    for u, g in zip(fired, outs):
        if g is None:
            continue
        made = u.rule(u.module, u.input.detach(), g) if u.rule else _fallback(u.module, u.names, u.input.detach(), g)
        for name, p in zip(u.names, u.params):
            if name in made:
                rules[id(p)] = made[name]()
    B = x.shape[0]
    norm2 = torch.zeros(B, dtype=parts[0][1][0].dtype if parts[0][1] else torch.float32, device=x.device)
    for n2, _ in rules.values():
        norm2 = norm2 + n2
    norms = norm2.sqrt()
    params = [p for _, ps, _ in parts for p in ps]
    if check:  # once per architecture: the rules' unclipped sum is autograd's summed gradient
        ones = torch.ones(B, dtype=norms.dtype, device=norms.device)
        truth = dict(zip(map(id, check_params), rest[len(unfired):]))
        expected = None
        if reference is not None:
            try:
                expected = reference(parts, x, y).double().to(norms.device)
            except Exception:  # noqa: BLE001 - a model torch.func cannot run: the summed gradient's check alone
                expected = None
        for model in check:
            ok = True
            for p in _trained_in(model, trained):
                if id(p) not in truth:
                    continue  # unfired, and its gradient is zero (checked above)
                mine = torch.zeros_like(p)
                if id(p) in rules:
                    rules[id(p)][1](ones, mine)
                ref = truth[id(p)] if truth[id(p)] is not None else torch.zeros_like(p)
                ok = ok and torch.allclose(mine, ref, rtol=1e-3, atol=1e-5 * (1 + float(ref.abs().max())))
            if ok and expected is not None:
                ok = bool(torch.allclose(norms.double(), expected, rtol=1e-3, atol=1e-6))
            _CHECKED[_architecture(model, trained)] = model.__dict__["_rayfl_checked"] = ok
            if not ok:
                say_once(f"check:{type(model).__name__}", f"{type(model).__name__}: its summed gradient or its "
                         "per-sample norms are not what its layers' hooks see (a parameter used outside its module's "
                         "call, samples not in a layer's first dimension?); its per-sample gradients are materialized")
                return None
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    if scale != 1.0:
        factor = factor * scale
    out = out if out is not None else [torch.empty_like(p) for p in params]
    for p, o in zip(params, out):  # each rule writes into its parameter's tensor (a view of it: not returned)
        rules[id(p)][1](factor, o) if id(p) in rules else o.zero_()
    sums = list(out)
    return sums, loss, norms


def _trained_in(model: nn.Module, trained: set[int]) -> list:
    seen, out = set(), []
    for p in model.parameters():
        if id(p) in trained and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


_CHECKED: dict[tuple, bool] = {}  # architecture -> whether its hooks' gradients matched autograd's


def _architecture(model: nn.Module, trained: set[int]) -> tuple:
    """What the check's verdict holds for: the model's type, its parameters' names and shapes, which are trained."""
    return (type(model), tuple((n, tuple(p.shape), id(p) in trained) for n, p in model.named_parameters()))
