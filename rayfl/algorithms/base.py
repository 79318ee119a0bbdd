"""The algorithm contract: what an algorithm writes, and nothing that the platform already does.

An algorithm is one module in ``rayfl/algorithms/`` that defines three things and registers them:

``Params``
    A dataclass of the algorithm's own knobs (ε, M, β, λ, T, ...), with defaults from its paper. Its
    ``check(n_clients)`` method raises ``ValueError("name=value: what is allowed")`` for bad values. The
    same names are what ``rayfl run --param KEY=VALUE`` and ``tune_spaces/<algo>.yaml`` set. An optional
    ``check_config(cfg)`` checks what needs the rest of the config (e.g. ``val_frac > 0``), and an optional
    ``check_run(info, model)`` what needs the federation built (:class:`RunInfo`: sizes, groups) or the run's
    network (an instance of it, e.g. to count its layers); all run before any actor starts.

``Server`` (driver side, subclass of :class:`Server`)
    Holds the driver-side state (a global model, FedFomo's P, stored uploads) and writes one round
    top to bottom in :meth:`Server.run_round`. It talks to clients only through ``call(step, messages)``,
    which runs the named client step on many clients in parallel and returns their uploads. Where the
    server only needs a sum, ``call(step, messages, reduce=WeightedMean("weights", by="n"))`` gives it
    ``uploads.reduced["weights"]`` without moving every client's vector (:mod:`rayfl.reduce`); with
    ``group="node"`` it is one mean per value of each message's ``"node"`` field (one FedAvg per cluster: CFL,
    the oracle). Models travel as *handles* (a Ray ObjectRef under Ray, the array itself in one process):
    ``self.put`` makes one, ``self.get`` reads some; routing a handle from one client to another never pulls it
    into the driver.

``ClientLogic`` (client side, subclass of :class:`ClientLogic`)
    Methods named ``step_<name>(client, msg, models)`` run on one :class:`~rayfl.client.Client` (its data,
    model and personal state live in the client, which lives in a long-lived actor). ``models`` is
    ``msg["models"]`` with every handle resolved to a flat float32 numpy vector (a dict name -> vector,
    a list of vectors, or a dict key -> vector; an empty list or dict stays present, empty). A step returns a small dict, its *upload* (:class:`Upload`; what it is sent: :class:`Message`); a vector meant
    to stay in the object store is wrapped with ``client.share(vec)``, which the driver sees as a handle.
    ``step_evaluate`` (default: evaluate ``client.model``) reports the personalized model's metrics; a
    logic whose clients are evaluated with weights the message names (FedAvg's global model) says which in
    ``eval_weights`` and keeps the default ``step_evaluate``: a host then evaluates all its clients that
    share those weights together, in one forward pass where their splits are small.
    ``client.model`` is the client's personal model, made on first use; a step that trains a working copy
    that is not the client's own (FedAvg) uses ``client.scratch(vec)`` and so keeps no personal weights; a
    client whose own part is small (MOCHA's head on the shared body) keeps that part in ``client.state`` and
    trains a scratch copy, so that its snapshots (every round, for fault replay) hold only that part.

Capabilities: optional class attributes of a ``Server`` or ``ClientLogic`` that tell the platform what it may do
around the algorithm (``private_training``, ``local_buffers``, ``uses_holdout``, ``averages``, ``growing_state``,
``client_ids``). Each is declared below, with its default and a docstring, on the class it belongs to, and the
platform reads it only through :func:`capability` (or :meth:`Algorithm.capability`). A *promise* (``averages``,
``private_training``, ``local_buffers``) counts only where the class itself makes it: a subclass that trains or
averages differently does not inherit it.

The shared loop (:mod:`rayfl.loop`) owns everything else: participant sampling, dispatch, evaluation,
the summary across clients, logging, checkpoints and timing. Stages (PersFL's distillation, FedMoE's
fine-tuning and gate) are listed by :meth:`Server.stages`; each stage is a number of rounds in the same run,
and a stage that names the knobs it reads (``Stage.depends_on``) is shared by runs that differ only in
later stages' knobs (:mod:`rayfl.stage_cache`).

Registering: ``ALGORITHMS = [Algorithm("name", Params, Server, ClientLogic, "one-line summary", work="...")]``
at the bottom of the module (``work``: what a client's local work per round is where the paper makes it differ
from FedAvg's, so that a comparison's table says so on its row), and the module's name in :data:`rayfl.algorithms.MODULES`.
An algorithm of one's own is the same ``Algorithm`` in a file of one's own: ``rayfl run --plugin FILE``,
``rayfl.register_algorithm(...)`` or an entry point in the group ``rayfl.algorithms`` (:mod:`rayfl.plugins`).
What the platform needs to know of an algorithm beyond its code it reads from the ``Algorithm`` (``implies``,
``compare_before``, ``plots``), never from its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypedDict

import numpy as np

from rayfl.user_input import check_count, to_kind

class Message(TypedDict, total=False):
    """Driver -> client: what one client step is sent. The platform reads the keys declared here; beside them an
    algorithm puts its own small plain values (numbers, strings, lists: FedeRiCo's ``K``, LG-FedAvg's
    ``fedavg``), which only its own ClientLogic reads."""

    models: dict[str, Any]
    """Name -> a handle, a list of handles or a dict key -> handle: the host resolves every one (once for a
    message sent to many clients) and hands the step the vectors, as its ``models`` argument."""

    node: Any
    """The group a grouped reduction sums the client's upload into (``WeightedMean(group="node")``: one FedAvg per
    cluster), where the server asks for one."""


class Upload(TypedDict, total=False):
    """Client -> driver: what one client step returns, small values and handles made with ``client.share``. The
    platform reads or writes the keys declared here; an evaluation (``step_evaluate``) returns, for each split
    it measured, ``<split>_loss``, ``<split>_acc`` and ``n_<split>`` (:meth:`rayfl.client.Client.evaluate`),
    which the loop summarises across clients (:func:`rayfl.metrics.round_summary`)."""

    weights: Any
    """A trained model's flat vector: the field FedAvg-like servers reduce (``WeightedMean("weights")``); the
    reduction takes it out of the upload inside the host."""

    n: int
    """The client's training-set size: the weight of its upload in a ``WeightedMean(by="n")``."""

    train_loss: float
    """The local training loss (``client.fit``), which servers average across uploads."""

    seconds: float
    """Written by the host: how long the step took on this client."""

    dp_epsilon: float
    """Written by the host at evaluation under sample-level DP: the client's ε so far."""


Call = Callable[..., "dict[int, Upload]"]  # call(step, messages, reduce=None)


@dataclass(frozen=True)
class Stage:
    """A named block of rounds; ``sample=False`` means every client takes part in each of its rounds.

    ``depends_on`` names the algorithm knobs the stage reads (``()``: none, e.g. a FedAvg stage 1);
    ``None`` means all of them. Runs whose config and knobs agree up to a stage share its result
    (:mod:`rayfl.stage_cache`), so a stage must not read a knob it does not name here."""

    name: str
    rounds: int
    sample: bool = True
    depends_on: tuple | None = None


@dataclass
class RunInfo:
    """What a server may know about the run, fixed before the first round."""

    n_clients: int
    rounds: int
    participation: float
    seed: int
    n_train: list[int]  # training-set size per client, index = client id
    task: str = "classification"
    groups: list[int] | None = None  # latent group per client, where the partition has them
    n_params: int = 0
    holdout_counts: list[int] | None = None  # per class, the held-out balanced set no client holds (classification)
    model: str = ""  # the name of the run's model


@dataclass
class NoParams:
    """For algorithms without knobs of their own."""

    def check(self, n_clients: int) -> None:  # noqa: D401 - nothing to check
        return None


class Server:
    """Driver side of an algorithm. Ray-free; ``put``/``get`` are given by the runtime."""

    def __init__(self, params: Any, info: RunInfo, put: Callable[[Any], Any], get: Callable[[list], list],
                 rng: np.random.Generator, initial: np.ndarray):
        self.params = params
        self.info = info
        self.put = put
        self.get = get
        self.rng = rng
        self.initial = put(initial)  # the common initial model, as a handle

    def stages(self) -> list[Stage]:
        return [Stage("train", self.info.rounds)]

    def setup(self, call: Call) -> dict:
        """Once before the first round (user-centric FL's gradient statistics). Returns metrics."""
        return {}

    def run_round(self, stage: Stage, rnd: int, participants: list[int], call: Call) -> dict:
        raise NotImplementedError  # each algorithm writes its round

    def eval_messages(self, stage: Stage, rnd: int, cids: list[int]) -> dict[int, Message]:
        """What each client needs to evaluate its personalized model (FedAvg sends the global model)."""
        return {c: {} for c in cids}

    def artifacts(self) -> dict[str, Any]:
        """Driver-side state worth keeping at the end: name -> numpy array / dict / DataFrame."""
        return {}

    def round_artifacts(self, rnd: int) -> dict[str, Any]:
        """Driver-side state worth keeping every round (FedFomo's P): name -> numpy array."""
        return {}

    def warnings(self) -> list[str]:
        """Caveats the round just run found about the run's own settings, one line each (pFedMe's inner solve
        that does not settle): the loop shows each on the console and in the MLflow run, once."""
        return []

    def final_model(self) -> Any:
        """Handle of the model to save as the run's final global model, or None."""
        return None

    averages: str | None = None
    """A promise: the attribute holding the handle of the model its clients start from, where each round averages
    their updates through a ``WeightedMean``; user-level DP clips and noises that average (:mod:`rayfl.privacy`)."""

    growing_state: tuple[str, ...] = ()
    """Keys of ``state_dict()`` whose arrays change shape over a run (CFL's tree): a checkpoint's are checked by
    dtype and number of dimensions only (:mod:`rayfl.resume`)."""

    client_ids: tuple[str, ...] = ()
    """Keys of ``state_dict()`` holding client ids (lists of integers): a checkpoint naming a client the run does
    not have is refused before it is loaded (:mod:`rayfl.resume`)."""

    def state_dict(self) -> dict:
        """Driver state for checkpoints, as plain arrays: resolve handles with ``self.get`` first."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


class ClientLogic:
    """Client side of an algorithm: ``step_<name>`` methods on one client. Ray-free."""

    private_training: bool | str | None = None
    """A promise: True where all its training is ``client.fit`` / ``training.train_epochs``, so that sample-level
    DP-SGD covers it (:mod:`rayfl.privacy`); a string says why not."""

    local_buffers: bool = False
    """A promise: its clients may keep their own BatchNorm statistics (config ``buffers=local``; every vector a
    client loads gets its own running statistics written in: FedBN, Li et al. 2021)."""

    uses_holdout: bool = False
    """Its clients read the balanced held-out set no client holds, as ``client.splits["global"]`` (FedMoE's global
    test accuracy, Listo Zec et al. 2020, Sec. 4; FedAvg-with-shared-data's G)."""

    def __init__(self, params: Any):
        self.params = params

    def init_client(self, client) -> None:
        """Once per client, after its data and initial model are in place."""
        return None

    def step_evaluate(self, client, msg: Message, models: dict) -> Upload:
        """The loop's evaluation of this client's personalized model. It must leave the client as it was
        (weights, state, RNGs): the host re-encodes for snapshots only the clients that ran other steps."""
        weights = self.eval_weights(msg, models)
        return client.evaluate(client.model if weights is None else client.model_of(weights))

    def eval_weights(self, msg: Message, models: dict) -> Any:
        """The vector the default ``step_evaluate`` evaluates instead of the client's own model, the same
        for every client given the same message (FedAvg: the global model); None: the client's own."""
        return None


PROMISES = frozenset({"averages", "private_training", "local_buffers"})  # not inherited: the class's own word
CAPABILITIES = {"averages": Server, "growing_state": Server, "client_ids": Server,
                "private_training": ClientLogic, "local_buffers": ClientLogic, "uses_holdout": ClientLogic}


def declared(cls: type, name: str) -> Any:
    """What ``cls`` itself declares (not what it inherits), or None."""
    return vars(cls).get(name)


def capability(owner: Any, name: str) -> Any:
    """Capability ``name`` of a Server or ClientLogic (class or instance): its own declaration for a promise
    (:data:`PROMISES`), else what it declares or inherits; the base class's default where it says nothing."""
    base = CAPABILITIES[name]  # KeyError: not a capability, a typo the platform must not read as "no"
    cls = owner if isinstance(owner, type) else type(owner)
    default = getattr(base, name)
    if name in PROMISES:
        return vars(cls).get(name, default)
    return getattr(cls, name, default)


@dataclass(frozen=True)
class Matrix:
    """How a client-by-client matrix that a server keeps (``artifacts`` / ``round_artifacts``) is drawn: what it
    holds (the figure's title), its axes, whether its values are signed (a diverging colour map centred at 0;
    None: when some value is negative) and what a missing (NaN) cell means (a legend entry; None: none)."""

    title: str
    xlabel: str = "client j"
    ylabel: str = "client i"
    diverging: bool | None = None
    missing: str | None = None


@dataclass(frozen=True)
class Algorithm:
    name: str
    Params: type
    Server: type
    ClientLogic: type
    summary: str = ""
    # a client's local work per round where its paper makes it differ from FedAvg's (the run's local epochs
    # of SGD on its training split); "" means the same. Shown on the algorithm's row of a comparison.
    work: str = ""
    # knob -> knob values a sweep sets along with it: a knob that only acts when others are so (a single value
    # that a non-empty grid over it would override) is swept with them set, unless the user set them.
    implies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)
    # a last stage that a comparison shows both ways: stage name -> the label suffix of a second row, the run as
    # of its last evaluated round before that stage (``ALGO-SUFFIX``, with the row's own ``:KEY=VALUE`` after).
    compare_before: Mapping[str, str] = field(default_factory=dict, hash=False)
    # artifact name -> how its client-by-client matrix is drawn (an artifact not named here: a plain caption)
    plots: Mapping[str, Matrix] = field(default_factory=dict, hash=False)

    def make_params(self, values: Mapping[str, Any] | None = None):
        """Build and check Params from user values; unknown keys and bad values raise ValueError."""
        values = dict(values or {})
        fields = {f.name: f for f in dataclasses.fields(self.Params)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            allowed = ", ".join(sorted(fields)) or "none"
            key = unknown[0]
            raise ValueError(f"{key}={values[key]!r}: unknown parameter for algorithm {self.name!r}; "
                             f"allowed: {allowed}")
        converted = {k: _coerce(v, fields[k], self.name) for k, v in values.items()}
        return self.Params(**converted)

    def capability(self, name: str) -> Any:
        """Capability ``name`` of its Server or ClientLogic, whichever declares it (:func:`capability`)."""
        return capability(getattr(self, CAPABILITIES[name].__name__), name)

    def param_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.Params)]


def _bounded(value: Any, name: str) -> Any:
    """An integer knob bounded as the config's counts are (:func:`rayfl.user_input.check_count`)."""
    if type(value) is int:
        check_count(value, name)
    return value


def _coerce(value: Any, field: dataclasses.Field, algo: str) -> Any:
    """Turn a CLI/YAML value into the field's declared type (the type is read from its default); no
    silent coercion (2.5 for an integer knob, NaN, infinity, a boolean for a number: ValueError)."""
    default = field.default if field.default is not dataclasses.MISSING else None
    if default is None:
        return value
    try:
        if isinstance(default, tuple):
            if value in (None, ""):
                return ()  # `-p lam_grid=` on the command line: an empty grid
            items = [v for v in value.split(",") if v.strip()] if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise ValueError("must be a list")
            kind = type(default[0]) if default else float
            return tuple(_bounded(to_kind(v, kind), field.name) for v in items)
        return _bounded(to_kind(value, type(default)), field.name)
    except ValueError as e:
        raise ValueError(f"{field.name}={value!r} for algorithm {algo!r}: {e}") from None
