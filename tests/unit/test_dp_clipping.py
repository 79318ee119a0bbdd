"""DP-SGD's clipped sum from per-sample norms (rayfl.clipping) against per-sample gradients formed one sample at a
time with plain autograd (an independent reference, not torch.func): the norms, the clipped-and-noised sum on the
same batch and noise as the materialized path, the per-layer fallback said once, and the models the hooks cannot
read going to the materialized path."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rayfl import clipping, privacy, training


class Scale(nn.Module):
    """A layer with no fast rule: x * w."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.w


class Mixed(nn.Module):
    """Embedding -> LayerNorm -> Linear on a sequence -> Scale -> Conv1d -> GroupNorm -> Linear."""

    def __init__(self, scale=True):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.sc = Scale(16) if scale else nn.Identity()
        self.conv = nn.Conv1d(16, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.out = nn.Linear(6 * 5, 3)

    def forward(self, x):
        h = self.sc(self.fc(self.ln(self.emb(x))))
        return self.out(torch.tanh(self.gn(self.conv(h.transpose(1, 2)))).flatten(1))


def reference(model, params, loss_fn, x, y, clip):
    """Per-sample gradients one sample at a time (autograd on a batch of one), their norms over all params, and
    Σ_i g_i min(1, C / (‖g_i‖ + 1e-6)) in float64."""
    per = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])
        per.append([g.double() for g in torch.autograd.grad(loss, params)])
    norms = torch.tensor([float(torch.sqrt(sum((g ** 2).sum() for g in gs))) for gs in per], dtype=torch.float64)
    factors = torch.clamp(clip / (norms + 1e-6), max=1.0)
    sums = [sum(f * gs[k] for f, gs in zip(factors, per)) for k in range(len(params))]
    return norms, sums


CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
               lambda g: (torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g))),
    "linear on a sequence": (lambda: nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Flatten(), nn.Linear(21, 3)),
                             lambda g: (torch.randn(9, 3, 4, generator=g), torch.randint(0, 3, (9,), generator=g))),
    "conv (LeNet-5)": (lambda: __import__("rayfl.models", fromlist=["x"]).build_model("lenet5", (1, 28, 28), 10),
                       lambda g: (torch.randn(6, 1, 28, 28, generator=g), torch.randint(0, 10, (6,), generator=g))),
    "conv, strided and dilated": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, dilation=3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(3 * 3 * 3, 2)),
        lambda g: (torch.randn(5, 2, 9, 9, generator=g), torch.randint(0, 2, (5,), generator=g))),
    "mixed": (lambda: Mixed(scale=False),
              lambda g: (torch.randint(0, 20, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("clip", [0.05, 1e9])  # every sample clipped; none clipped
def test_norms_and_clipped_sum_match_per_sample_autograd(case, clip):
    torch.manual_seed(0)
    make, batch = CASES[case]
    model = make()
    x, y = batch(torch.Generator().manual_seed(1))
    params = list(model.parameters())
    norms, sums = reference(model, params, F.cross_entropy, x, y, clip)
    fast = clipping.clipped_sum([(model, params, F.cross_entropy)], x, y, clip)
    assert fast is not None  # every layer here has a rule
    got_sums, _, got_norms = fast
    np.testing.assert_allclose(got_norms.double().numpy(), norms.numpy(), rtol=1e-4)
    for got, want in zip(got_sums, sums):
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["linear", "conv (LeNet-5)", "mixed"])
def test_the_noised_sum_equals_the_materialized_paths_on_the_same_batch_and_noise(case):
    torch.manual_seed(0)
    make, batch = CASES[case]
    model = make()
    x, y = batch(torch.Generator().manual_seed(2))
    parts = [(model, list(model.parameters()), F.cross_entropy)]
    fast, fast_loss = privacy.noisy_gradient(parts, x, y, 1.3, 0.5, 4.0, torch.Generator().manual_seed(3))
    slow, slow_loss = privacy.noisy_gradient(parts, x, y, 1.3, 0.5, 4.0, torch.Generator().manual_seed(3),
                                             materialize=True)
    assert fast_loss == pytest.approx(slow_loss, rel=1e-5)
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    other, _ = privacy.noisy_gradient(parts, x, y, 1.3, 0.5, 4.0, torch.Generator().manual_seed(4))
    assert not torch.allclose(other[0], fast[0])  # the noise is in it


def test_a_layer_without_a_rule_falls_back_for_itself_and_says_so_once():
    torch.manual_seed(0)
    model = Mixed(scale=True)
    x, y = torch.randint(0, 20, (7, 5)), torch.randint(0, 3, (7,))
    params = list(model.parameters())
    clipping._SAID.discard("layer:Scale")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = clipping.clipped_sum([(model, params, F.cross_entropy)], x, y, 0.1)
        clipping.clipped_sum([(model, params, F.cross_entropy)], x, y, 0.1)
    said = [str(w.message) for w in seen if "Scale" in str(w.message)]
    assert len(said) == 1 and "'sc'" in said[0] and "no per-sample norm rule" in said[0]
    assert first is not None  # the other layers keep their rules; the model is not sent to the materialized path
    norms, sums = reference(model, params, F.cross_entropy, x, y, 0.1)
    np.testing.assert_allclose(first[2].double().numpy(), norms.numpy(), rtol=1e-4)
    for got, want in zip(first[0], sums):
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-4, atol=1e-6)


def test_an_in_place_op_after_a_layer_keeps_its_output_gradient():
    """ReLU(inplace=True) overwrites the Linear's output: the hook hands on a copy, the norms stay right."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    params = list(model.parameters())
    norms, _ = reference(model, params, F.cross_entropy, x, y, 1.0)
    fast = clipping.clipped_sum([(model, params, F.cross_entropy)], x, y, 1.0)
    np.testing.assert_allclose(fast[2].double().numpy(), norms.numpy(), rtol=1e-4)


class Tied(nn.Module):
    """The embedding's weight used again outside its module's call (an output layer tied to it)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x):
        return F.linear(self.emb(x).mean(1), self.emb.weight)


def test_a_parameter_used_outside_its_module_goes_to_the_materialized_path():
    torch.manual_seed(0)
    model = Tied()
    x, y = torch.randint(0, 10, (6, 3)), torch.randint(0, 10, (6,))
    params = list(model.parameters())
    assert clipping.clipped_sum([(model, params, F.cross_entropy)], x, y, 0.1) is None  # the check caught it
    got, _ = privacy.noisy_gradient([(model, params, F.cross_entropy)], x, y, 0.0, 0.1, 1.0, None)
    _, want = reference(model, params, F.cross_entropy, x, y, 0.1)
    np.testing.assert_allclose(got[0].double().numpy(), want[0].numpy(), rtol=1e-4, atol=1e-7)


class TimeFirst(nn.Module):
    """A Linear applied to [T, B, d]: its hooks see T, not the samples, in the first dimension."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).sum(0)


def test_a_layer_holding_samples_elsewhere_than_first_goes_to_the_materialized_path():
    """Its summed gradient is right either way; its per-sample norms are not: the first batch's check against
    the materialized norms catches it."""
    torch.manual_seed(0)
    model = TimeFirst()
    parts = [(model, list(model.parameters()), F.cross_entropy)]
    assert clipping.clipped_sum(parts, torch.randn(6, 5, 4), torch.randint(0, 3, (6,)), 0.1) is None  # 5 != 6
    x, y = torch.randn(6, 6, 4), torch.randint(0, 3, (6,))  # as many steps as samples: only the norms tell
    assert clipping.clipped_sum(parts, x, y, 0.1) is not None  # without the reference the hooks are believed
    clipping._CHECKED.clear()
    model.__dict__.pop("_rayfl_checked", None)
    got, _ = privacy.noisy_gradient(parts, x, y, 0.0, 0.1, 1.0, None)  # checked against the materialized norms
    assert model.__dict__["_rayfl_checked"] is False
    _, want = reference(model, list(model.parameters()), F.cross_entropy, x, y, 0.1)
    np.testing.assert_allclose(got[0].double().numpy(), want[0].numpy(), rtol=1e-4, atol=1e-7)


def test_a_loss_of_its_own_is_differentiated_per_sample_like_the_materialized_path():
    """A loss that is not cross-entropy (a sum, not a mean) is evaluated per sample as a batch of one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    loss_fn = lambda out, t: (out ** 2).sum() + F.cross_entropy(out, t, reduction="sum")  # noqa: E731
    params = list(model.parameters())
    norms, sums = reference(model, params, loss_fn, x, y, 0.3)
    fast = clipping.clipped_sum([(model, params, loss_fn)], x, y, 0.3)
    np.testing.assert_allclose(fast[2].double().numpy(), norms.numpy(), rtol=1e-4)
    np.testing.assert_allclose(fast[0][0].double().numpy(), sums[0].numpy(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["flat_sgd", "momentum", "adam"])
def test_flat_models_and_every_optimizer_train_on_the_fast_path(optimizer):
    """σ = 0, C huge: the private path is SGD on the Poisson batches' summed gradient over q·n, whichever
    optimizer reads it; the fast path and the materialized one move the model the same way."""
    from types import SimpleNamespace

    x, y = torch.randn(40, 5, generator=torch.Generator().manual_seed(0)), torch.randint(0, 3, (40,))
    moved = []
    for materialize in (False, True):
        torch.manual_seed(0)
        model = training.flatten(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))
        opt = (training.FlatSGD(model, 0.1) if optimizer == "flat_sgd" else
               training.make_optimizer(model.parameters(), "adam" if optimizer == "adam" else "sgd", 0.05, 0.9))
        noisy = privacy.noisy_gradient
        privacy.noisy_gradient = lambda *a, m=materialize, **k: noisy(*a, **k, materialize=m)
        try:
            privacy.train_epochs(model, x, y, 2, 16, opt, F.cross_entropy, torch.Generator().manual_seed(5),
                                 privacy.Account(privacy.DPSettings(0.7, 1.0, 1e-5), SimpleNamespace(state={})))
        finally:
            privacy.noisy_gradient = noisy
        moved.append(training.to_vector(model))
    np.testing.assert_allclose(moved[0], moved[1], rtol=1e-4, atol=1e-6)
