"""ClientActor: a long-lived Ray actor hosting one or more clients on its CPU slot or GPU slice.

Its constructor only keeps its arguments: the clients are built by the first call (torch imported, data
materialized, a warm-up step), so that ``__ray_ready__`` answers as soon as Ray has placed the actor and
started its process. Whoever waits for room on the cluster (``capacity_wait``) then waits for placement
only, not for the clients' start, which a fixed bound would cut short on a loaded machine.

An actor can also take over the clients of another actor lost with its node (:meth:`ClientActor.adopt`): they
stay a host of their own (the runtime's host index ``host`` in every call), so that the run's partial sums are
grouped as before and its results do not change.

Every answer carries the actor's ``token``, drawn anew in each process Ray starts for it (and at each
:meth:`ClientActor.setup`): a call that reached a restarted actor (its clients back at their initial state) is
told apart from one that reached the actor the runtime last loaded, even when no call failed in between.

A run's actors may serve the next run of the same shape in the same process (:mod:`rayfl.actors.pool`):
:meth:`ClientActor.setup` gives them the new run's arguments, and they build its clients anew, exactly as a
fresh process would. Each run has its own ``key``; a reused actor that Ray restarts comes back with the
arguments it was created with (another run's key), and the runtime sets it up again (:meth:`ClientActor.setup`
is a no-op for the run it already holds).
"""

from __future__ import annotations

import uuid

import ray


@ray.remote
class ClientActor:
    def __init__(self, sealed, x, y, initial, key: str | None = None):
        # sealed (rayfl.plugins.Sealed): (spec, client_data, plugins), pickled apart so that a plugin's module this
        # node lacks is one line from the first call, not an actor that dies while Ray reads its arguments and is
        # restarted to die again. spec: the run's HostSpec less its arrays, which come as x, y, initial (object-
        # store references, resolved by Ray). plugins: the run's registrations from outside the package
        # (rayfl.plugins.Plugins), registered in this process as they are read. key: the run these are of
        self._hold(key, sealed, x, y, initial)

    def _hold(self, key, sealed, x, y, initial) -> None:
        """A run's arguments kept, its clients not built yet (the first call builds them): no state of an
        earlier run survives, but for the process itself (imports, torch's lazy first-use work)."""
        self.token = uuid.uuid4().hex
        self.key = key
        self._args = (sealed, x, y, initial)
        self._host = None
        self._adopted: dict[int, object] = {}  # host index -> the ClientHost of clients taken over

    def idle(self) -> None:
        """Kept for a next run (:mod:`rayfl.actors.pool`): the finished run's clients, data and models let go."""
        self._hold(None, None, None, None, None)

    def setup(self, key: str, sealed, x, y, initial) -> str:
        """Serve the run ``key`` (arguments as the constructor's) from now on, its clients built by the next call;
        nothing changes when this actor already serves it. Its token."""
        if key != self.key:
            self._hold(key, sealed, x, y, initial)
        return self.token

    def _built(self, host: int | None = None):
        """The clients' host, built on the first call; ``host``: one adopted under that index."""
        if self._host is None:
            import torch

            from rayfl.actors.handles import Batcher

            sealed, x, y, initial = self._args
            spec, client_data, _plugins = sealed.open()  # UserError: a module missing
            # Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU(s); "cuda" is then the right one.
            self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
            self.batcher = Batcher()
            self.device = "cuda" if self.gpu_ids and torch.cuda.is_available() else "cpu"
            self._spec = spec.with_arrays(x, y, initial)
            self._host = self._new_host(client_data)
            self._args = None
        return self._host if host is None else self._adopted[host]

    def _new_host(self, client_data: dict):
        from rayfl.actors.handles import resolve
        from rayfl.host import ClientHost

        host = ClientHost(self._spec, client_data, device=self.device, share=self.batcher.share, resolve=resolve)
        self.batcher.flush()
        return host

    def adopt(self, host: int, sealed) -> str:
        """Take over the clients ``sealed`` holds (a lost actor's) as host ``host``, at their initial state: the
        runtime loads their snapshot next."""
        self._built()
        self._adopted[host] = self._new_host(sealed.open())
        return self.token

    def run(self, step: str, packed: tuple, reduce=None, host: int | None = None) -> tuple[str, tuple]:
        from rayfl.batch import unpack

        out = self._built(host).run(step, unpack(packed), reduce)
        self.batcher.flush()  # one object for every vector this call's clients shared
        return self.token, out

    def state(self, host: int | None = None) -> tuple[str, dict]:
        return self.token, self._built(host).state()

    def save(self, full: bool, host: int | None = None) -> tuple[str, dict]:
        return self.token, self._built(host).save(full)

    def load_state(self, *states: dict, host: int | None = None) -> str:
        self._built(host).load_state(*states)
        return self.token

    def vectors(self, host: int | None = None) -> tuple[str, dict]:
        return self.token, self._built(host).vectors()

    def info(self, host: int | None = None) -> dict:
        built = self._built(host)
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "gpu_ids": self.gpu_ids, "token": self.token, **built.info()}
