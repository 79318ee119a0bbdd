"""RayRuntime: the clients live in ClientActors; one actor call per host per step, gathered at once.

Client actors are restartable (Ray re-creates a dead one with the same arguments, on any node with room
for it): a call that meets a dead actor, a restarted one, or an object it owned, raises
:class:`~rayfl.runtime.ClientsLost`, and the loop restores every client from its last snapshot
(:meth:`save_clients`) and replays the rounds since.

What must outlive a node: a snapshot's client states are copied into this (the driver's) process once the
round they belong to is done (:meth:`keep_clients`), but those made on the driver's own node; the return value of an actor call lives in the object
store of the actor's node, and is gone with it. The actors' constructor arguments are passed by value, or
are the submitter's ``ray.put`` objects (the data, the initial model), held where the submitter runs.
A lost actor with no room left for it on the live nodes is not waited for when the cluster cannot grow: its
clients move to the surviving actors (:meth:`RayRuntime.rehost`), each lost host kept whole as a host of its
own inside one survivor (its partial sums unchanged, so the run's results are too), restored from the snapshot
and replayed like any other loss. With ``wait_for_room`` (an autoscaler that can add a node, or a
``capacity_wait`` the user set) it is waited for ``capacity_wait`` seconds, then the run ends with
:class:`~rayfl.recovery.NoCapacity`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import ray

from rayfl.actors.client import ClientActor
from rayfl.actors.handles import resolve
from rayfl.actors.resources import ActorResources
from rayfl.batch import pack
from rayfl.plugins import Sealed
from rayfl.recovery import NoCapacity
from rayfl.runtime import ClientsLost, Pending, SaveChain, assign_hosts, gather, group_by_host


def start_client_actors(prepared, x_ref, y_ref, resources: ActorResources, n_actors: int,
                        actor_options: list[dict] | None = None, key: str | None = None) -> tuple[list, list]:
    """Ask Ray for the client actors of a run, the clients spread evenly (:func:`assign_hosts`); returns at
    once with the handles and the refs of their shared constructor arguments, which the caller keeps for as
    long as the actors may restart (Ray re-creates a dead actor from them, but does not keep them itself).
    Each actor's own clients go by value: Ray keeps those with the actor, for its restarts.
    ``actor_options[i]``: extra ``.options`` for actor i (a Tune trial's placement-group bundle); ``key``: the
    run's (:meth:`ClientActor.setup`)."""
    cfg = prepared.cfg
    initial_ref = ray.put(prepared.initial)
    actors = [ClientActor.options(**resources.options(), max_restarts=cfg.max_restarts,
                                  **(actor_options[h] if actor_options else {})).remote(
                  sealed, x_ref, y_ref, initial_ref, key)
              for h, sealed in enumerate(client_blocks(prepared, n_actors))]
    return actors, [x_ref, y_ref, initial_ref]


def client_blocks(prepared, n_actors: int) -> list[Sealed]:
    """Each actor's share of a run: the run's HostSpec less its arrays, its clients' data, the plugins."""
    fed = prepared.federation
    spec = prepared.host_spec().without_arrays()
    return [Sealed((spec, {c: fed.clients[c] for c in block}, prepared.plugins))
            for block in assign_hosts(prepared.cfg.clients, n_actors)]


class RayRuntime:
    pipelined = True  # the clients run the next round's first call while the driver reports a round

    def __init__(self, prepared, actors: list, resources: ActorResources, wait_for_room: bool = True,
                 setups: list | None = None):
        """Over client actors from :func:`start_client_actors` (for the same ``prepared``); ``wait_for_room``:
        whether a lost actor with no room is waited for (capacity_wait) rather than its clients re-hosted;
        ``setups``: for actors kept from an earlier run (:mod:`rayfl.actors.pool`), each one's
        :meth:`ClientActor.setup` arguments, given again to one that Ray restarts (it comes back with the
        arguments of the run it was created for)."""
        blocks = assign_hosts(prepared.cfg.clients, len(actors))
        self.host_of = {c: h for h, block in enumerate(blocks) for c in block}
        self.client_data = prepared.federation.clients  # to build a lost host's clients again elsewhere
        self.resources = resources
        self.capacity_wait = prepared.cfg.capacity_wait
        self.wait_for_room = wait_for_room
        self.actors = list(actors)  # host index -> the actor that holds it (a survivor may hold several)
        self.keys: list[int | None] = [None] * len(self.actors)  # None: the actor's own host; h: adopted as h
        self.tokens: list[str | None] = [None] * len(self.actors)  # each actor's process, as last loaded
        self.nodes: list[str | None] = [None] * len(self.actors)  # where each actor was last seen
        self.setups = setups
        self.keep_actors = False
        self.saves = SaveChain()
        self.notify = lambda event: None  # the driver's queue to its submitter: a wait for room is shown

    # --- which process answered -------------------------------------------------------------------
    def _same(self, h: int, token: str) -> None:
        """An answer from actor ``h``'s process ``token``: ClientsLost when Ray has restarted the actor since
        its clients were last loaded (a fresh process holds initial clients, not the run's)."""
        if self.tokens[h] is None:
            self.tokens[h] = token
        elif self.tokens[h] != token:
            raise ClientsLost(f"client actor {h} was restarted (on node {self._node_text(h)})")

    def _node_text(self, h: int) -> str:
        return (self.nodes[h] or "unknown")[:12]

    def _values(self, hosts: list[int], answers: list[tuple]) -> list:
        for h, (token, _) in zip(hosts, answers):
            self._same(h, token)
        return [value for _, value in answers]

    # --- calls ------------------------------------------------------------------------------------
    def call(self, step, messages, reduce=None):
        return self.submit(step, messages, reduce).result()

    def submit(self, step, messages, reduce=None):
        batches = group_by_host(messages, self.host_of)
        refs = [self.actors[h].run.remote(step, pack(items), reduce, self.keys[h]) for h, items in batches.items()]

        def wait():
            with clients_lost():
                answers = ray.get(refs)
            return gather(batches, self._values(list(batches), answers), reduce)

        return Pending(wait)

    def put(self, obj):
        return ray.put(obj)

    def get(self, handles):
        with clients_lost():  # a handle whose owner (a client actor) died
            return resolve(list(handles))

    def client_states(self):
        with clients_lost():
            parts = self._values(list(range(len(self.actors))), ray.get([a.state.remote(host=k) for a, k in self._hosts()]))
        return {cid: blob for part in parts for cid, blob in part.items()}

    def load_client_states(self, states):
        with clients_lost():
            tokens = ray.get([a.load_state.remote({c: s for c, s in states.items() if self.host_of[c] == h}, host=k)
                              for h, (a, k) in enumerate(self._hosts())])
        self.tokens = list(tokens)  # the clients now are what was loaded, in these processes

    def client_vectors(self):
        with clients_lost():
            parts = self._values(list(range(len(self.actors))), ray.get([a.vectors.remote(host=k) for a, k in self._hosts()]))
        return {cid: v for part in parts for cid, v in part.items()}

    # --- snapshots --------------------------------------------------------------------------------
    def save_clients(self):
        """One call per actor, not waited for; :meth:`keep_clients` copies the results here once the round
        is done (until then they live on the actors' nodes)."""
        full = self.saves.next_is_full()
        return self.saves.add([a.save.remote(full, host=k) for a, k in self._hosts()], full)

    def keep_clients(self, saved) -> None:
        """Make a snapshot outlive any client node: every save of the chain still in the object store is
        fetched into this process, in place (the runtime's chain shares its lists, so later snapshots that
        extend it hold the copies too). ClientsLost when a save died with its actor, or came from a process
        Ray restarted: the snapshot is then not one to keep. A save made on this process's own node stays
        where it is (:class:`LocalSave`): a loss of that node takes the driver too, which then starts again from
        its on-disk checkpoint, so copying it would only cost the round a wait (on one machine, every save)."""
        here = ray.get_runtime_context().get_node_id()
        pending = []
        for parts in saved:
            for h, ref in enumerate(parts):
                if isinstance(ref, ray.ObjectRef):
                    if self.nodes[h] is not None and self.nodes[h] == here:
                        parts[h] = LocalSave(ref, self.tokens[h])
                    else:
                        pending.append((parts, h, ref))
        if not pending:
            return
        with clients_lost():
            answers = ray.get([ref for _, _, ref in pending])
        for (parts, h, _), (token, value) in zip(pending, answers):
            self._same(h, token)
            parts[h] = value

    def kept_state(self, part):
        """A part of a kept snapshot as a state (a :class:`LocalSave` fetched and checked)."""
        with clients_lost():
            return LocalSave.value(part)

    def restore_clients(self, saved):
        with clients_lost():  # a restarted actor that died again, or a snapshot that died with its actor
            self.await_actors()
            # kept snapshots only (keep_clients): the states go by value, from this process
            chains = [SaveChain.of_host(saved, h) for h in range(len(self.actors))]
            states = iter(LocalSave.values([part for chain in chains for part in chain]))
            tokens = ray.get([a.load_state.remote(*[next(states) for _ in chain], host=k)
                              for (a, k), chain in zip(self._hosts(), chains)])
        self.tokens = list(tokens)
        self.saves.reset(saved)

    def await_actors(self) -> None:
        """Wait while Ray restarts dead actors (a call meanwhile fails with ActorUnavailableError). An actor lost
        with its node and no room for it on the live nodes: re-hosted (:meth:`rehost`), unless ``wait_for_room``:
        then waited for at most ``capacity_wait`` seconds, for room that may never come (then NoCapacity, naming
        the lost node). Their clients are built after."""
        start = time.monotonic()
        deadline, told = start + self.capacity_wait, False
        pending = {h: a.__ray_ready__.remote() for h, a in enumerate(self.actors)}
        while pending:
            if not self.wait_for_room and time.monotonic() - start > ROOM_CHECK_AFTER:
                gone = self._gone(pending)
                if gone and self._no_room(gone):
                    self.rehost(gone)
                    for h in gone:
                        del pending[h]
                    continue
            if not told and self.wait_for_room and time.monotonic() - start > NOTICE_AFTER:  # say what it waits for
                self.notify({"event": "waiting_for_room", "what": self._lost_text(sorted(pending)),
                             "seconds": self.capacity_wait})
                told = True
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                                timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            for h, ref in list(pending.items()):
                if ref not in ready:
                    continue
                try:
                    ray.get(ref)
                    del pending[h]
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    pending[h] = self.actors[h].__ray_ready__.remote()
            if pending and time.monotonic() >= deadline:
                raise NoCapacity(self._no_room_text(sorted(pending)))
            if pending and ready:
                time.sleep(0.2)
        if self.setups:  # a kept actor that Ray restarted holds the run it was created for: this one again
            ray.get([self.actors[h].setup.remote(*self.setups[h]) for h in range(len(self.actors))
                     if self.keys[h] is None])
        for h, info in enumerate(ray.get([a.info.remote(host=k) for a, k in self._hosts()])):
            self.nodes[h] = info["node_id"]

    def _lost_text(self, hosts: list[int]) -> str:
        lost = dead_nodes({self.nodes[h] for h in hosts if self.nodes[h]})
        clients = sorted(c for c, h in self.host_of.items() if h in hosts)
        where = (f"lost with node {', '.join(lost)}" if lost else
                 f"last on node {', '.join(sorted({self._node_text(h) for h in hosts}))}")
        return (f"client actor(s) {', '.join(map(str, hosts))} (clients {_ranges(clients)}, "
                f"{self.resources.num_cpus:g} CPU and {self.resources.num_gpus:g} GPU each) {where}")

    def _no_room_text(self, hosts: list[int]) -> str:
        return f"{self._lost_text(hosts)}; no room for them came up within capacity_wait={self.capacity_wait:g}s"

    def _gone(self, pending) -> list[int]:
        """Those of the ``pending`` hosts whose actor's node has left the cluster (an actor whose process died
        on a live node gets that node's room back, and Ray restarts it there)."""
        lost = set(dead_nodes({self.nodes[h] for h in pending if self.nodes[h]}))
        return sorted(h for h in pending if self.nodes[h] in lost)

    def _no_room(self, hosts: list[int]) -> bool:
        """Whether the live nodes lack the free room for the actors of ``hosts`` (Ray would place them)."""
        from rayfl.actors.resources import capacity, live_nodes

        lost = {id(self.actors[h]) for h in hosts}
        return capacity(live_nodes(), self.resources.num_cpus, self.resources.num_gpus, driver=False) < len(lost)

    def _hosts(self) -> list[tuple]:
        """(actor, key) of every host, in host order: the key names an adopted host in its actor's calls."""
        return list(zip(self.actors, self.keys))

    def rehost(self, lost: list[int]) -> None:
        """Move the hosts ``lost`` (their actors being restarted with no room for them) into the surviving actors,
        each whole into the survivor with the fewest clients, at their initial state (restore_clients loads the
        snapshot next); the lost actors are ended, so that Ray stops trying to place them."""
        dead = {id(self.actors[h]): self.actors[h] for h in lost}
        alive = [h for h in range(len(self.actors)) if id(self.actors[h]) not in dead]
        if not alive:
            raise NoCapacity(self._lost_text(lost) + "; no client actor survived to take their clients")
        self.notify({"event": "rehost", "what": self._lost_text(lost)})
        for actor in dead.values():
            ray.kill(actor, no_restart=True)
        load: dict[int, list] = {}
        for h in alive:
            entry = load.setdefault(id(self.actors[h]), [self.actors[h], 0, h])
            entry[1] += sum(1 for c, hh in self.host_of.items() if hh == h)
        for h in [h for h in range(len(self.actors)) if id(self.actors[h]) in dead]:
            entry = min(load.values(), key=lambda e: (e[1], e[2]))
            block = {c: self.client_data[c] for c, hh in sorted(self.host_of.items()) if hh == h}
            self.tokens[h] = ray.get(entry[0].adopt.remote(h, Sealed(block)))
            self.actors[h], self.keys[h], self.nodes[h] = entry[0], h, self.nodes[entry[2]]
            entry[1] += len(block)

    # --- the rest ---------------------------------------------------------------------------------
    def placement(self):
        infos = ray.get([a.info.remote(host=k) for a, k in self._hosts()])
        for h, info in enumerate(infos):
            self.nodes[h] = info["node_id"]
            self._same(h, info["token"])
        return [{"actor": h, "num_cpus": self.resources.num_cpus, "num_gpus": self.resources.num_gpus,
                 **{k: v for k, v in info.items() if k != "token"}}
                for h, info in enumerate(infos)]

    def shutdown(self):
        """The client actors killed, unless ``keep_actors`` (their submitter keeps them for the next run)."""
        if not self.keep_actors:
            for a in {id(a): a for a in self.actors}.values():
                ray.kill(a)
        self.actors = []


def dead_nodes(node_ids) -> list[str]:
    """Those of ``node_ids`` that the cluster no longer counts alive (shown as Ray shows node ids)."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return sorted(n for n in node_ids if n not in alive)


def _ranges(ids: list[int]) -> str:
    """0, 1, 2, 5 as '0-2, 5'."""
    out, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ", ".join(out)


NOTICE_AFTER = 3.0  # seconds of waiting for a restarted actor before the submitter is told what it waits for
ROOM_CHECK_AFTER = 1.0  # seconds a restarted actor may take to be placed before the free room is looked at

class LocalSave:
    """A client actor's save left in the object store of the driver's node, with the token of the process it
    was asked of: restoring from it checks that the same process made it (not one Ray restarted meanwhile,
    whose clients were fresh)."""

    def __init__(self, ref, token: str | None):
        self.ref, self.token = ref, token

    @staticmethod
    def value(part):
        """A kept save's state: as it is, or fetched now from this node's object store and checked."""
        return LocalSave.values([part])[0]

    @staticmethod
    def values(parts: list) -> list:
        """:meth:`value` of each part, the ones left in the object store fetched together."""
        local = [i for i, part in enumerate(parts) if isinstance(part, LocalSave)]
        out = list(parts)
        for i, (token, value) in zip(local, ray.get([parts[i].ref for i in local])):
            if parts[i].token is not None and token != parts[i].token:
                raise ClientsLost("a snapshot's save came from a restarted client actor")
            out[i] = value
        return out


LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


@contextmanager
def clients_lost():
    """Ray's errors for a dead client actor (or an object it owned, read by the driver or another actor)
    as ClientsLost; every other error passes unchanged."""
    try:
        yield
    except ray.exceptions.RayError as e:
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
        if not isinstance(cause, LOST) and not isinstance(e, LOST):
            raise
        first = (str(cause).strip().splitlines() or [""])[0]
        raise ClientsLost(f"{type(cause).__name__}: {first}") from e
