"""ClientHost: the Ray-free core of a client actor. It holds one or more clients and runs algorithm steps.

One host call carries the work of all its clients for a step, and every model handle that the step's
messages name is resolved in one batch: Ray call overhead is paid per actor, not per client. Where the
server asked for a reduction (FedAvg's weighted mean), the host returns one partial sum for its clients.
Its clients share one resident model and one spare (:class:`rayfl.client.Bench`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np
import torch

from rayfl import privacy, training
from rayfl.algorithms.base import ClientLogic, Message, Upload, capability
from rayfl.batch import pack
from rayfl.client import Bench, Client, TrainSettings, eval_pass, evaluate_together
from rayfl.data import ClientData, materialize
from rayfl.experiment import HostSpec
from rayfl.reduce import ClippedSum, Partial, accumulate
from rayfl.snapshot import dumps, loads


class ClientHost:
    def __init__(self, spec: HostSpec, client_data: dict, device: str = "cpu", share: Callable = lambda v: v,
                 resolve: Callable[[list], list] = lambda hs: list(hs)):
        """The clients ``client_data`` names (client id -> its splits of ``spec.x``/``spec.y``), built on
        ``device``; ``share`` makes an object-store handle of a vector, ``resolve`` reads handles."""
        cfg, x, y, holdout = spec.cfg, spec.x, spec.y, spec.holdout
        torch.set_num_threads(cfg.torch_threads)
        # numpy's BLAS too (FedFomo's distances, reductions): its default, one thread per core, spins against
        # the other actors' threads (a 159k-element dot took 23 ms instead of 0.9 ms on the 2-core box)
        from threadpoolctl import threadpool_limits

        self._blas_limit = threadpool_limits(cfg.torch_threads)
        self.device = device
        self.resolve = resolve
        self._holdout_cache: dict = {}  # transform -> the "global" split, shared by this host's clients
        self._layouts: dict = {}  # the inputs of the last group evaluated together (evaluate_together)
        self.logic = spec.algorithm.ClientLogic(spec.params)
        settings = TrainSettings.from_config(cfg, spec.task)
        self.bench = Bench(spec.model_spec.build, spec.initial, device)
        self.clients: dict[int, Client] = {}
        self._encoded: dict[int, bytes] = {}  # each client's last state() blob
        self._changed: set[int] = set()  # clients that ran a non-evaluation step since it was made
        self._unsaved: set[int] = set()  # clients encoded anew since the last save()
        for cid, cd in client_data.items():
            torch.manual_seed(cfg.seed)  # initial weights come from `initial`; this seeds anything else
            client = Client(cid, materialize(x, y, cd, device), None, None, settings, cfg.seed, device, share,
                            cd.group, bench=self.bench)
            if holdout is not None and len(holdout) and capability(self.logic, "uses_holdout"):
                client.splits["global"] = self._holdout(x, y, holdout, cd, device)
            self.logic.init_client(client)
            self.clients[cid] = client
        self.bench.release()
        self._warm_up(next(iter(self.clients.values())))
        if settings.dp is not None:  # Opacus's accountants take about a second to import: at start-up, not in round 1
            import opacus.accountants  # noqa: F401

            if settings.dp.level == "sample":  # the model's one check of its per-sample norms, likewise
                self._warm_up_private(next(iter(self.clients.values())))

    def _holdout(self, x, y, holdout: np.ndarray, cd, device: str) -> tuple:
        """The balanced global test set (Federation.holdout) as a "global" split, under the client's evaluation
        transform; materialized once per host and transform, for algorithms whose ClientLogic sets
        ``uses_holdout`` (FedMoE's global test accuracy, Listo Zec et al., 2020, §4)."""
        cache = self._holdout_cache
        key = repr(cd.transform.get("eval", {k: v for k, v in cd.transform.items() if k != "eval"}))
        if key not in cache:
            empty = holdout[:0]
            cache[key] = materialize(x, y, ClientData(empty, empty, holdout, None, cd.transform), device)["test"]
        return cache[key]

    @staticmethod
    def _warm_up(client: Client) -> None:
        """One throwaway training step, so torch's lazy first-use work (about a second per process)
        is paid at start-up and not counted in the first round's time."""
        model = client.new_model()
        x, y = client.splits["train"]
        s = client.settings
        opt = training.optimizer_for(model, s.optimizer, 0.0, s.momentum, s.weight_decay)
        training.train_epochs(model, x[:2], y[:2], 1, 2, opt, training.loss_fn_for(s.task),
                              torch.Generator().manual_seed(0))

    @staticmethod
    def _warm_up_private(client: Client) -> None:
        """One throwaway DP-SGD gradient of two samples, charged to no one: the architecture's check of its
        per-sample norms (rayfl.clipping) and torch.func's imports happen at start-up."""
        model = client.new_model()
        x, y = client.splits["train"]
        if x.shape[0]:
            privacy.noisy_gradient([(model, [p for p in model.parameters() if p.requires_grad],
                                     training.loss_fn_for(client.settings.task))], x[:2], y[:2], 0.0, 1.0, 1.0, None)

    def run(self, step: str, items: list[tuple[int, Message]], reduce=None) -> tuple[list[Upload], Partial]:
        """Run ``step_<step>`` for each (client id, message); one batched fetch of every named model.
        Returns the uploads and this host's partial sum of the requested reduction (empty without one)."""
        method = getattr(self.logic, f"step_{step}", None)
        if method is None:
            raise ValueError(f"{type(self.logic).__module__} has no client step {step!r}")
        _, distinct, which = pack(items)  # a message sent to many clients: its models resolved once
        models = self._resolve_models([msg.get("models", {}) for msg in distinct])
        resolved = [models[k] for k in which]
        if step != "evaluate":  # evaluation leaves a client as it was (ClientLogic.step_evaluate)
            self._changed.update(cid for cid, _ in items)
        if isinstance(reduce, ClippedSum):  # user-level DP: the model the updates are measured from, once
            reduce = dataclasses.replace(reduce, start=self.resolve([reduce.start])[0])
        uploads, partial = [], {}
        try:
            together = self._evaluate_together(items, resolved) if step == "evaluate" else {}
            for i, ((cid, msg), models) in enumerate(zip(items, resolved)):
                if i in together:
                    up = together[i]
                else:
                    self.bench.step += 1
                    t0 = time.perf_counter()
                    with privacy.training_of(self.clients[cid], step) if step != "evaluate" else nullcontext():
                        up = method(self.clients[cid], msg, models) or {}
                    up.setdefault("seconds", time.perf_counter() - t0)
                if step == "evaluate":  # ε so far beside the client's accuracy (sample-level DP)
                    eps = privacy.client_epsilon(self.clients[cid])
                    if eps is not None:
                        up["dp_epsilon"] = eps
                accumulate(reduce, up, partial, msg)
                uploads.append(up)
        finally:
            self.bench.end_call()
        return uploads, partial

    def _evaluate_together(self, items: list[tuple[int, Message]], resolved: list[dict]) -> dict[int, Upload]:
        """The default ``step_evaluate`` of the clients that are evaluated with the same weights
        (``ClientLogic.eval_weights``: FedAvg's global model) and have small splits, done together: item
        index -> its record, each client's ``seconds`` its share of the group's time. At 1,000 clients of a
        few samples a forward pass per client was half of a round."""
        if type(self.logic).step_evaluate is not ClientLogic.step_evaluate:
            return {}  # the logic evaluates in its own way
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, ((cid, msg), models) in enumerate(zip(items, resolved)):
            weights = self.logic.eval_weights(msg, models)
            if weights is not None:
                groups.setdefault(id(weights), (weights, []))[1].append(i)
        out: dict[int, dict] = {}
        for weights, members in groups.values():
            if len(members) < 2:
                continue  # alone, its own step is as quick
            self.bench.step += 1
            t0 = time.perf_counter()
            model = self.bench.model_of(weights)
            limit = eval_pass(model, self.clients[items[members[0]][0]].splits["val"][0])
            members = [i for i in members if self.clients[items[i][0]].small_eval(limit)]
            if len(members) < 2:
                continue
            records = evaluate_together(model, [self.clients[items[i][0]] for i in members], layouts=self._layouts)
            share = (time.perf_counter() - t0) / len(members)
            for i, rec in zip(members, records):
                out[i] = {**rec, "seconds": share}
        return out

    def _resolve_models(self, model_maps: list[dict]) -> list[dict]:
        handles, slots = [], []
        for i, mm in enumerate(model_maps):
            for name, h in mm.items():
                if isinstance(h, dict):
                    for key, hh in h.items():
                        slots.append((i, name, key)), handles.append(hh)
                elif isinstance(h, (list, tuple)):
                    for j, hh in enumerate(h):
                        slots.append((i, name, j)), handles.append(hh)
                else:
                    slots.append((i, name, None)), handles.append(h)
        values = self.resolve(handles) if handles else []
        # Empty lists/dicts stay present, so a step can index what its message named.
        out: list[dict] = [{name: {} if isinstance(h, dict) else [None] * len(h)
                            for name, h in mm.items() if isinstance(h, (dict, list, tuple))}
                           for mm in model_maps]
        for (i, name, key), v in zip(slots, values):
            if key is None:
                out[i][name] = v
            else:
                out[i][name][key] = v
        return out

    def vectors(self) -> dict[int, np.ndarray]:
        """The personal weights of every client that has them (FedAvg's clients have none)."""
        vectors = {cid: c.weights() for cid, c in self.clients.items()}
        return {cid: v for cid, v in vectors.items() if v is not None}

    def state(self) -> dict[int, bytes]:
        """Each client's weights, personal state, optimizer and RNGs as plain-data bytes (rayfl.snapshot): for
        checkpoints; loading them never runs code."""
        self._encode()
        return dict(self._encoded)

    def save(self, full: bool) -> dict[int, bytes]:
        """For in-memory snapshots (rayfl.runtime.SaveChain): every client's blob (``full``), or only those of
        the clients encoded anew since the previous save."""
        self._encode()
        out = dict(self._encoded) if full else {cid: self._encoded[cid] for cid in self._unsaved}
        self._unsaved = set()
        return out

    def _encode(self) -> None:
        """Encode again only the clients that ran a step other than evaluation since their last blob (at 1,000
        clients a round samples 100)."""
        fresh = self._changed | (self.clients.keys() - self._encoded.keys())
        for cid in fresh:
            c = self.clients[cid]
            self._encoded[cid] = dumps({"model": c.weights(), "buffers": c.buffers(), "state": c.state,
                                        "optimizer": c.optimizer.state_dict() if c.optimizer else None,
                                        "gen": c.gen.get_state(), "rng": c.rng.bit_generator.state})
        self._changed = set()
        self._unsaved |= fresh

    def load_state(self, *states: dict[int, bytes]) -> None:
        """Clients back as blobs say; several dicts are a chain of saves, a later blob replacing an earlier one."""
        self.bench.release()
        merged: dict[int, bytes] = {}
        for part in states:
            merged.update(part)
        self._changed -= merged.keys()  # each loaded client is now exactly its blob
        self._unsaved -= merged.keys()
        for cid, blob in merged.items():
            c = self.clients[cid]
            st = loads(blob, device=self.device)
            c.set_weights(st["model"])
            c.set_buffers(st.get("buffers"))  # buffers=local: its own BatchNorm statistics
            c.state = st["state"]
            if st["optimizer"] is not None and c.optimizer is not None:
                c.optimizer.load_state_dict(st["optimizer"])
            c.gen.set_state(st["gen"].cpu())
            c.rng.bit_generator.state = st["rng"]
            self._encoded[cid] = blob  # this client is now exactly what the blob says

    def info(self) -> dict:
        """Where this host runs and what it was given: for the placement record."""
        return {"clients": sorted(self.clients), "device": self.device, "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "torch_threads": torch.get_num_threads()}

