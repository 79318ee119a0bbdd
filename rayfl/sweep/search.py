"""What Tune searches: a space's keys as Tune's distributions, the search algorithm, and the metrics a sweep may
select on. Its own module because a new sweep (:mod:`~rayfl.sweep.command`) and a resumed one
(:mod:`~rayfl.sweep.resume`) both build them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rayfl.config import UserError

if TYPE_CHECKING:
    from rayfl.sweep.space import Plan


STATS = ("mean", "weighted_mean", "std", "worst", "bottom10_mean")  # rayfl.metrics.summarize


def selectable_metrics(task: str) -> list[str]:
    """The per-round metrics a sweep may optimize: validation summaries (and the training loss)."""
    kinds = ("loss",) if task == "regression" else ("acc", "loss")
    return [f"val_{k}_{s}" for k in kinds for s in STATS] + ["train_loss"]


def _search_space(plan: Plan, search: str) -> dict:
    from ray import tune

    space: dict[str, Any] = {}
    for key, values in plan.space.grid.items():
        space[key] = tune.grid_search(values) if search == "grid" else tune.choice(values)
    for key, (kind, args) in plan.space.random.items():
        if kind == "choice":
            space[key] = tune.choice(list(args))
        elif kind == "randint":
            space[key] = tune.randint(int(args[0]), int(args[1]) + 1)
        elif kind == "quniform":
            space[key] = tune.quniform(*args)
        elif kind == "uniform":
            space[key] = tune.uniform(*args)
        elif kind == "loguniform":
            space[key] = tune.loguniform(*args)
        else:  # load_space admits no other kind; never a name looked up on ray.tune
            raise UserError(f"random.{key}: unknown distribution {kind!r}; known: choice, randint, quniform, "
                            f"uniform, loguniform")
    return space


def _search_alg(search: str, seed: int, max_concurrent: int, metric: str, mode: str):
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise UserError("--search optuna: optuna is not installed (`pip install 'rayfl[optuna]'`; it then "
                            "runs offline). Without it: --search grid or --search random") from None
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=seed), max_concurrent=max_concurrent)
    return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)
