"""Each preset row carries the settings its table's paper states and, where the paper is silent, those of the
code its authors name: the values below are copied from those sources (cited per row), not from presets.py."""

from __future__ import annotations

import pytest

from rayfl.comparison.run import build_configs, row_settings

import tempfile

MNIST_ROOT = {"data_root": tempfile.gettempdir()}  # configs are only built and checked, no data is read

# (preset, row, knobs, config): Zhang et al. 2021 (FedFomo), Sec. 4 and A.6: lr 0.01 for every method on MNIST,
# E = 5, weight decay 1e-4; NVlabs/FedFomo federated/args.py: --bs_trn 50, --lamda 15, --K 5, --beta 1.0,
# --epsilon_1 0.42, --epsilon_2 1.6; the pFedMe code's optimizers take no weight decay.
FEDFOMO_TABLE1 = [
    ("perfedavg", {"inner_lr": 0.01, "outer_lr": 0.01, "tau": 0}, {"weight_decay": 0.0}),
    ("pfedme", {"personal_lr": 0.01, "lam": 15.0, "K": 5, "beta": 1.0, "R": 0}, {"weight_decay": 0.0, "lr": 0.01}),
    ("cfl", {"eps1": 0.42, "eps2": 1.6, "min_rounds": 0}, {"weight_decay": 1e-4}),
    ("fedavg", {}, {"weight_decay": 1e-4}),
]
COMMON_FEDFOMO = {"lr": 0.01, "local_epochs": 5, "batch_size": 50, "model": "mlp-784-100", "dataset": "mnist",
                  "partition": "pathological", "classes_per_client": 2}
# Divi et al. (PersFL), Table 7 (rounds) and the authors' scripts pFedMe/PerFed_MNIST.sh, pFedMe/pFedMe_MNIST.sh
# (--learning_rate, --beta, --personal_learning_rate, --lamda, --batch_size, --local_epochs 20,
# --num_global_iters 800).
PERSFL = {
    "persfl-ds1": [("perfedavg", {"inner_lr": 0.001, "outer_lr": 0.001, "tau": 20}, {"batch_size": 128, "rounds": 800}),
                   ("pfedme", {"personal_lr": 0.0025, "beta": 1.0, "lam": 15.0, "K": 5, "R": 20},
                    {"batch_size": 128, "lr": 0.02, "rounds": 800}),
                   ("fedavg", {}, {"rounds": 100}), ("persfl", {}, {"rounds": 100})],
    "persfl-ds2": [("perfedavg", {"inner_lr": 0.01, "outer_lr": 0.01, "tau": 20}, {"batch_size": 128, "rounds": 800}),
                   ("pfedme", {"personal_lr": 0.0075, "beta": 1.0, "lam": 15.0, "K": 5, "R": 20},
                    {"batch_size": 128, "lr": 0.01, "rounds": 800}),
                   ("fedavg", {}, {"rounds": 50}), ("fedper", {}, {"rounds": 50}), ("persfl", {}, {"rounds": 25})],
    "persfl-ds3": [("perfedavg", {"inner_lr": 0.01, "outer_lr": 0.01, "tau": 20}, {"batch_size": 128, "rounds": 800}),
                   ("pfedme", {"personal_lr": 0.05, "beta": 2.0, "lam": 30.0, "K": 5, "R": 20},
                    {"batch_size": 20, "lr": 0.01, "rounds": 800}),
                   ("fedavg", {}, {"rounds": 100}), ("persfl", {}, {"rounds": 100})],
}
# Sui et al. 2022 (FedeRiCo), Sec. 5: Adam, lr 0.01 for every method, FedEM with 4 components, CFL and FedEM from
# omarfoq/FedEM, whose aggregator.py ClusteredAggregator has tol_1=0.4, tol_2=1.6, `len(indices) > 2`, no round
# condition and AgglomerativeClustering(linkage="complete").
FEDERICO = [("cfl", {"eps1": 0.4, "eps2": 1.6, "min_split_size": 3, "min_rounds": 0, "linkage": "complete"},
             {"optimizer": "adam", "lr": 0.01}),
            ("fedem", {"M": 4}, {"optimizer": "adam", "lr": 0.01})]
CASES = ([(p, row, knobs, {**COMMON_FEDFOMO, **config}) for p in ("fedfomo-pathological", "fedfomo-pathological-100")
          for row, knobs, config in FEDFOMO_TABLE1]
         + [(p, row, knobs, config) for p, rows in PERSFL.items() for row, knobs, config in rows]
         + [("federico-label-groups", row, knobs, config) for row, knobs, config in FEDERICO])


@pytest.mark.parametrize("preset,row,knobs,config", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_a_preset_row_runs_with_the_cited_settings(preset, row, knobs, config):
    [(label, cfg)] = build_configs([row], [0], preset, **MNIST_ROOT)
    for key, value in knobs.items():
        assert cfg.params.get(key, value) == value and type(cfg.params.get(key, value)) is type(value), key
    from rayfl.algorithms import get_algorithm

    params = get_algorithm(cfg.algo).make_params(cfg.params)
    for key, value in knobs.items():
        assert getattr(params, key) == value, key
    for key, value in config.items():
        assert getattr(cfg, key) == value, key


def test_fedfomos_hundred_clients_sample_a_tenth_for_a_hundred_rounds():
    [(_, cfg)] = build_configs(["pfedme"], [0], "fedfomo-pathological-100", **MNIST_ROOT)
    assert (cfg.clients, cfg.participation, cfg.rounds) == (100, 0.1, 100)


def test_the_flags_still_override_a_rows_own_settings():
    [(_, cfg)] = build_configs(["pfedme"], [0], "persfl-ds1", rounds=7, batch_size=16, **MNIST_ROOT)
    assert (cfg.rounds, cfg.batch_size) == (7, 16)


def test_the_settings_column_names_what_a_row_sets_apart():
    planned = build_configs(["fedavg", "perfedavg", "cfl", "fedfomo:M=10"], [0], "fedfomo-pathological",
                            **MNIST_ROOT)
    settings = row_settings(planned)
    assert settings["fedavg"] == ""
    assert settings["perfedavg"] == "inner_lr=0.01 outer_lr=0.01 weight_decay=0"
    assert settings["cfl"] == "eps1=0.42 min_rounds=0"
    assert settings["fedfomo:M=10"] == "M=10"
