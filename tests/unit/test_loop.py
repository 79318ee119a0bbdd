"""The shared round loop in one process (LocalRuntime): baselines learn, seeds reproduce, sampling
takes the asked fraction, and a resumed run continues exactly where the checkpoint left it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny
from rayfl.experiment import prepare
from rayfl.loop import Callback, Loop
from rayfl.runtime import LocalRuntime


def run(cfg, **kw):
    p = prepare(cfg)
    return Loop(p, LocalRuntime(p), **kw).run()


@pytest.mark.parametrize("algo", ["local", "fedavg", "fedavg-ft"])
def test_baselines_learn_above_chance(algo):
    loop = run(tiny(algo=algo, rounds=3, clients=4, samples_per_client=80, local_epochs=5))
    assert loop.final["test_acc_mean"] > 0.5  # 10 classes: chance is 0.1
    assert len(loop.history) == 3 + (algo == "fedavg-ft")


def test_fedavg_ft_fine_tunes_after_the_rounds():
    loop = run(tiny(algo="fedavg-ft", partition="pathological", classes_per_client=2, rounds=3, clients=4,
                    samples_per_client=80, params={"ft_epochs": 3}))
    stages = [h["stage"] for h in loop.history]
    assert stages == ["fedavg"] * 3 + ["finetune"]
    # On 2 classes per client, fine-tuning on the client's own classes must help its own test split.
    assert loop.history[-1]["test_acc_mean"] > loop.history[-2]["test_acc_mean"]


def test_same_seed_same_metrics_other_seed_differs():
    a = run(tiny(algo="fedavg", seed=3)).history
    b = run(tiny(algo="fedavg", seed=3)).history
    c = run(tiny(algo="fedavg", seed=4)).history
    keys = [k for k in a[0] if k.startswith(("test_", "val_", "train_"))]
    assert [[h[k] for k in keys] for h in a] == [[h[k] for k in keys] for h in b]
    assert [[h[k] for k in keys] for h in a] != [[h[k] for k in keys] for h in c]


def test_hosting_several_clients_per_host_changes_nothing():
    a = run(tiny(algo="fedavg", clients=4, clients_per_actor=1)).history
    b = run(tiny(algo="fedavg", clients=4, clients_per_actor=3)).history
    assert [h["test_acc_mean"] for h in a] == [h["test_acc_mean"] for h in b]


class Participants(Callback):
    def __init__(self):
        self.seen = []

    def on_round(self, loop, record):
        self.seen.append(record.participants)


def test_participation_samples_the_fraction():
    p = Participants()
    run(tiny(algo="fedavg", clients=10, rounds=4, participation=0.3, samples_per_client=30), callbacks=[p])
    assert all(len(s) == 3 and len(set(s)) == 3 for s in p.seen)
    assert len({tuple(s) for s in p.seen}) > 1  # resampled each round


def test_local_trains_every_client_whatever_the_participation():
    p = Participants()
    run(tiny(algo="local", clients=5, participation=0.2, samples_per_client=30), callbacks=[p])
    assert all(s == list(range(5)) for s in p.seen)


class Crash(Callback):
    def on_round(self, loop, record):
        if record.step == 1:
            raise RuntimeError("simulated crash")


def test_resume_from_checkpoint_matches_uninterrupted(tmp_path):
    cfg = tiny(algo="fedavg", rounds=4, checkpoint_every=1, participation=0.67)
    full = run(cfg).history
    with pytest.raises(RuntimeError):
        run(cfg, callbacks=[Crash()], checkpoint_dir=str(tmp_path))
    resumed = run(cfg, checkpoint_dir=str(tmp_path))
    assert resumed.start_step == 1  # the crash came before round 1 was checkpointed
    np.testing.assert_allclose([h["test_acc_mean"] for h in resumed.history],
                               [h["test_acc_mean"] for h in full])
    np.testing.assert_allclose([h["test_loss_mean"] for h in resumed.history],
                               [h["test_loss_mean"] for h in full], rtol=1e-6)


def test_round_events_say_which_rounds_evaluate_and_how_many_are_left_to():
    """eval_every=3 over 7 rounds: rounds 1, 4 and 7 (steps 0, 3, 6) evaluate every client; the last always."""
    from rayfl.loop import round_event

    events = []

    class Seen(Callback):
        def on_round(self, loop, record):
            events.append(round_event(loop, record))

    run(tiny(algo="fedavg", rounds=7, eval_every=3), callbacks=[Seen()])
    assert [e["evaluated"] for e in events] == [True, False, False, True, False, False, True]
    assert [e["evaluated_left"] for e in events] == [2, 2, 2, 1, 1, 1, 0]
    assert [("test_acc_mean" in e["metrics"]) for e in events] == [e["evaluated"] for e in events]
