"""The round engine: the daemons' lock-step loop, and the only writer of the catalog.

Who calls it: :meth:`storage.daemon.Daemon.run`, on the daemon's main thread, which is the only
thread that drives MPI. Each round every daemon

1. allgathers the events its host queued since the last round (staged shards, prepared, stored,
   deletes, fetches, repairs, persisted ranks);
2. applies them in slot order: catalog events to :class:`~storage.catalog.Catalog` (so every
   daemon holds the same catalog and takes the same decisions without a leader), fetches and
   repairs to their modules' queues, persisted ranks to the tier;
3. does the round's local work, the same on every daemon: prepare ready steps and run the
   exchange of encoding ones (:mod:`storage.exchange`), repairs (:mod:`storage.repair`),
   fetches (:mod:`storage.fetch`), the manifests of newly protected steps, and the files of
   steps that retention or a delete dropped.

What it owns: the loop's pacing. Lock: the host's ``lock`` while it changes the catalog and the
host's records, never across MPI calls.
"""

from __future__ import annotations

import time
from typing import Any

from storage.catalog import StepState
from storage.exchange import Exchange
from storage.fetch import Fetcher
from storage.host import Host, Local
from storage.leases import Leases
from storage.repair import Repairer
from storage.tier import Tier

__all__ = ["Rounds"]


class Rounds:
    def __init__(
        self,
        host: Host,
        exchange: Exchange,
        repairer: Repairer,
        fetcher: Fetcher,
        tier: Tier,
        leases: Leases,
    ) -> None:
        self.host = host
        self.exchange = exchange
        self.repairer = repairer
        self.fetcher = fetcher
        self.tier = tier
        self.leases = leases

    def run(self) -> int:
        """Rounds until a daemon is asked to stop (then every daemon returns 0 together)."""
        h = self.host
        idle = 0.0005
        while True:
            with h.lock:
                events, h.events = h.events, []
            everyone = h.links.allgather_json(
                {"ev": events, "stop": h.stopping},
                "round",
                timeout=h.config.peer_timeout,
                busy=bool(events) or self.has_work(),
            )
            busy = any(p["ev"] for p in everyone)
            with h.cond:
                h.rounds += 1
                for r, payload in enumerate(everyone):
                    slot = h.slot_of_rank[r]
                    for event in payload["ev"]:
                        self._apply(slot, event)
                h.cond.notify_all()
            self.advance()
            if any(p["stop"] for p in everyone):
                return 0
            if busy or self.has_work():
                idle = 0.0005
            else:
                # Peers join a round within ``idle``; a trainer's request starts one at once here.
                h.wake.wait(idle)
                h.wake.clear()
                idle = min(idle * 2, 0.02)

    def _apply(self, slot: int, event: dict[str, Any]) -> None:
        """One event of ``slot``'s daemon (the round thread, holding the lock)."""
        h = self.host
        kind = event.get("e")
        if kind == "fetch":
            self.fetcher.requests.append(event)
            return
        if kind == "repair":
            self.repairer.requests.append(event)
            return
        if kind in ("persisted", "persist_failed"):
            self.tier.on_event(event)
            return
        old = None
        if kind == "staged":
            rec = h.catalog.steps.get(int(event["step"]))
            if rec is not None and rec.state == StepState.STAGING:
                old = rec.shards.get(int(event["shard"]["rank"]))
            elif rec is not None and rec.state == StepState.LOST:
                self.forget(rec.step)  # put afresh: the lost one's files go
        h.catalog.apply(slot, event)
        if old is not None and old.slot == h.slot:
            self._drop_shard(int(event["step"]), old.rank, old.buffer)
        if kind == "staged" and slot == h.slot:
            step, shard = int(event["step"]), event["shard"]
            loc = h.local.setdefault(step, Local())
            loc.buffers[int(shard["rank"])] = str(shard["buffer"])
            loc.t.setdefault("staged", time.monotonic())

    def has_work(self) -> bool:
        h = self.host
        with h.lock:
            return (
                bool(h.events)
                or bool(self.repairer.deferred)
                or any(
                    r.state in (StepState.READY, StepState.ENCODING)
                    for r in h.catalog.steps.values()
                )
            )

    def advance(self) -> None:
        """The round's local work, the same on every daemon (the round thread)."""
        h = self.host
        for rec in sorted(h.catalog.steps.values(), key=lambda r: r.step):
            loc = h.local.setdefault(rec.step, Local())
            if rec.state == StepState.READY and not loc.prepared:
                self.exchange.prepare(rec, loc)
            elif rec.state == StepState.ENCODING and not loc.stored:
                self.exchange.run(rec, loc)
        self.repairer.serve()
        self.fetcher.serve()
        with h.cond:
            for rec in list(h.catalog.steps.values()):
                loc = h.local[rec.step]
                if rec.state == StepState.PROTECTED and not loc.manifest:
                    h.phase("committing")
                    h.write_manifest(rec, loc)
                    self.tier.persist(rec)
                    h.stats["steps_protected"] += 1
                    now = time.monotonic()
                    for rank in loc.buffers:
                        t_alloc = h.t_alloc.pop((rec.step, rank), None)
                        if t_alloc is not None:
                            h.latency.protect.observe(now - t_alloc)
                    loc.t["protected"] = time.monotonic()
                    if h.trace:
                        t0 = loc.t.get("staged", loc.t.get("ready", 0.0))
                        phases = " ".join(f"{k}=+{(v - t0) * 1e3:.1f}ms" for k, v in loc.t.items())
                        h.log(f"step {rec.step}: {phases}")
                if rec.state == StepState.FAILED:
                    self.forget(rec.step)
            for step in [s for s in h.local if s not in h.catalog.steps]:
                self.forget(step)  # deleted, or evicted by retention
            h.cond.notify_all()
        self.tier.settle()

    def _drop_shard(self, step: int, rank: int, buffer: str) -> None:
        """A rank put this unfinished step again: its earlier shard's buffer goes back."""
        h = self.host
        loc = h.local.get(step)
        if loc is not None and loc.buffers.get(rank) == buffer:
            del loc.buffers[rank]
        h.pool.release(buffer)

    def forget(self, step: int) -> None:
        """Give this host's files of ``step`` back to the pool (the round thread, under the
        lock); a failed step leaves the catalog, its error kept for late waiters."""
        h = self.host
        h.announced.discard(step)
        for key in [key for key in h.t_alloc if key[0] == step]:
            del h.t_alloc[key]
        loc = h.local.pop(step, None)
        if loc is not None:
            for name in loc.buffers.values():
                self.leases.free(name)
            h.pool.release(loc.parity)
        h.catalog.drop_failed(step)
        h.remove_manifest(step)
