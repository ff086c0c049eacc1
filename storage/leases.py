"""Leases: shard buffers that trainers hold views of, kept out of reuse until every view is gone.

Who calls it: the socket service (a ``get`` takes a lease, an ``unlease`` ends one, a closed
connection ends all of its), the persistent tier (it holds a buffer while writing it), and the
round engine (retention frees buffers through :meth:`Leases.free`). What it owns: the lease
counts and the buffers waiting for their last lease to end. Lock: the host's ``lock``, taken
here; callers may hold it already (it is re-entrant).

Counted per holder and buffer: one connection may get the same shard twice and drop one result,
and the other result's views must still never change.
"""

from __future__ import annotations

from storage.host import Host

__all__ = ["PERSIST", "Leases"]

PERSIST = -1  # the holder the persistent tier leases as (connections are ids > 0)


class Leases:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.held: dict[str, dict[int, int]] = {}  # buffer -> {holder: live leases}
        self.deferred: set[str] = set()  # freed by retention while leased: freed at the last end

    def take(self, name: str, holder: int) -> None:
        with self.host.lock:
            holders = self.held.setdefault(name, {})
            holders[holder] = holders.get(holder, 0) + 1
            self._count()

    def end(self, name: str, holder: int, every: bool = False) -> None:
        """One of ``holder``'s leases on ``name`` ends (``every``: all of them)."""
        with self.host.lock:
            holders = self.held.get(name)
            if holders is None or holder not in holders:
                return
            holders[holder] -= 1
            if every or not holders[holder]:
                del holders[holder]
            if not holders:
                del self.held[name]
                if name in self.deferred:
                    self.deferred.discard(name)
                    self.host.pool.release(name)
            self._count()

    def _count(self) -> None:
        """How many buffers readers hold, and how many of those retention freed (their memory
        stays out of the pool until the readers' views go): in ``info`` and /metrics."""
        self.host.stats["leased_buffers"] = len(self.held)
        self.host.stats["leased_freed_buffers"] = len(self.deferred)

    def end_all(self, holder: int) -> None:
        """``holder`` went away (a trainer's connection closed): its views went with it."""
        with self.host.lock:
            for name in [n for n, h in self.held.items() if holder in h]:
                self.end(name, holder, every=True)

    def free(self, name: str) -> None:
        """Give ``name`` back to the pool now, or when its last lease ends."""
        with self.host.lock:
            if self.held.get(name):
                self.deferred.add(name)  # a trainer still holds views of it
                self._count()
            else:
                self.host.pool.release(name)
