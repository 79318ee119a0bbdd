"""A run's way back from lost client actors: in-memory snapshots of clients and driver, restored and replayed.

The loop takes a snapshot every ``snapshot_every`` rounds (and one before the first); two are kept, since the
newest may have been cut short by the very fault it is meant to undo. When client actors die
(:class:`~rayfl.runtime.ClientsLost`) every client and the driver go back to the newest snapshot that can be
restored and the rounds since are replayed, at most ``max_restarts`` times. When the clients cannot be hosted
again (:class:`NoCapacity`) the newest snapshot is written as the run's checkpoint, if it holds more than the
one on disk.
"""

from __future__ import annotations

from rayfl import checkpoint, snapshot
from rayfl.runtime import ClientsLost


class NoCapacity(RuntimeError):
    """Client actors were lost (their node left the cluster) and no room for them came up within
    ``capacity_wait`` seconds: the run ends, its newest snapshot written as its checkpoint (``checkpoint``:
    that file's directory and round, or None when there was none to write)."""

    checkpoint: tuple[str, int] | None = None


class Recovery:
    """The snapshots of one loop (a :class:`rayfl.loop.Loop`, which owns this object; not imported here: the loop
    imports this module) and the restarts it has survived."""

    def __init__(self, loop):
        self.loop = loop
        self.snapshots: list[dict] = []  # the last two, newest last
        self.restarts = 0  # client-actor faults survived

    def take(self, step: int, clients=None) -> dict:
        """Where to go back to after round ``step`` (-1: before setup), held in memory. The runtime keeps the
        clients' state without waiting (under Ray: driver-owned objects, which outlive a dead actor), or
        ``clients`` is what it returned when asked earlier in the round; the driver's state is copied as
        plain-data bytes, since servers update their arrays in place. History only grows, so its length is
        enough (a round's snapshot gets it, and the round's records, when the round is reported)."""
        loop = self.loop
        driver = loop.driver_state()
        clients = loop.runtime.save_clients() if clients is None else clients
        return {"step": step, "clients": clients, "driver": snapshot.dumps(driver),
                "history": len(loop.history), "last_eval": loop.last_eval, "setup_metrics": loop.setup_metrics,
                "setup_done": loop.setup_done}

    def keep(self, snap: dict) -> None:
        """Two are kept. The runtime first makes the clients' part outlive their hosts (under Ray: copied into
        this process)."""
        keep = getattr(self.loop.runtime, "keep_clients", None)
        if keep is not None:
            keep(snap["clients"])
        self.snapshots = [*self.snapshots[-1:], snap]

    def restore(self, snap: dict) -> int:
        """Put clients and driver back as they were at ``snap``; returns the index of the round to run next."""
        loop = self.loop
        loop.runtime.restore_clients(snap["clients"])  # first: if this fails, nothing else has changed
        loop.load_driver_state(snapshot.loads(snap["driver"]))
        del loop.history[snap["history"]:]
        loop.last_eval, loop.setup_metrics, loop.setup_done = snap["last_eval"], snap["setup_metrics"], snap["setup_done"]
        return snap["step"] + 1

    def recover(self, lost: ClientsLost, step: int) -> int:
        """Client actors died in round ``step`` (the runtime has restarted them): restore every client and the
        driver from the newest usable snapshot and return the round to replay from. At most max_restarts."""
        loop = self.loop
        self.restarts += 1
        if self.restarts > loop.cfg.max_restarts:
            raise ClientsLost(f"client actors died {self.restarts} times, more than max_restarts="
                              f"{loop.cfg.max_restarts}; last: {lost}") from lost
        for snap in reversed(self.snapshots):
            try:
                resume_at = self.restore(snap)
            except ClientsLost as again:  # this snapshot went down with its actor
                lost = again
                continue
            except NoCapacity as e:  # the clients cannot be hosted again: keep what the newest snapshot holds
                e.checkpoint = self.to_checkpoint(self.snapshots[-1])
                raise
            self.snapshots = [snap]
            event = {"step": step, "from_step": snap["step"], "restarts": self.restarts, "cause": str(lost)}
            for cb in loop.callbacks:
                cb.on_recover(loop, event)
            return resume_at
        raise ClientsLost(f"client actors died in round {step} and no snapshot could be restored: {lost}") from lost

    def to_checkpoint(self, snap: dict) -> tuple[str, int] | None:
        """The in-memory snapshot ``snap`` written as the run's checkpoint, with no client actor to ask: when
        the clients' hosts are gone for good. Not when the run keeps no checkpoints, the snapshot is from
        before the first round or its clients are not held here, or the checkpoint on disk is as new.
        Returns (directory, round) of the checkpoint left, or None."""
        loop = self.loop
        directory = loop.checkpoint_dir
        if not directory or snap["step"] < 0:
            return None
        on_disk = checkpoint.read(directory, loop.cfg) if checkpoint.exists(directory) else None
        if on_disk is not None and on_disk["step"] >= snap["step"]:
            return directory, on_disk["step"]
        clients: dict = {}
        kept_state = getattr(loop.runtime, "kept_state", lambda part: part)  # a save the runtime left in place
        for parts in snap["clients"]:  # a chain of saves, oldest first, one part per host
            for part in parts:
                try:
                    part = kept_state(part)
                except ClientsLost:
                    part = None
                if not isinstance(part, dict):
                    return (directory, on_disk["step"]) if on_disk is not None else None
                clients.update(part)
        driver = snapshot.loads(snap["driver"])
        checkpoint.write(directory, loop.cfg, snap["step"], {
            "server": driver["server"], "clients": clients, "rng": driver["rng"], "server_rng": driver["server_rng"],
            "history": loop.history[:snap["history"]], "last_eval": snap["last_eval"],
            "setup_metrics": snap["setup_metrics"], "dp_history": driver["dp_history"],
            "step_size_changes": loop.step_size_changes})
        return directory, snap["step"]
