"""One daemon's state at a glance, typed: the :class:`~storage.protocol.Snapshot` behind the
``info`` request, ``ecsnap status`` and ``/metrics``.

Who calls it: the socket service (``info``) and the metrics collector at each scrape, on their
own threads. What it owns: nothing. Lock: the host's ``lock`` while it reads; the persistent
tier's listing (disk I/O) is taken before the lock, never under it.
"""

from __future__ import annotations

import time
from typing import Any

from storage.catalog import StepState
from storage.host import Host
from storage.protocol import Snapshot, Staged
from storage.tier import Tier

__all__ = ["in_flight", "snapshot"]


def in_flight(h: Host) -> list[dict[str, Any]]:
    """Every step in flight on this host (under the host's lock), oldest first: ``{"step",
    "state", "age_s", "waiting_on"}``. Besides the steps in a lane (staging, ready, encoding),
    the shards allocated or staged here that no round has taken yet: a round that does not
    complete (a peer stopped) leaves them there, and this says so."""
    now = time.monotonic()
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for step, rec in sorted(h.catalog.steps.items()):
        if not rec.state.in_flight:
            continue
        seen.add(step)
        if rec.state == StepState.STAGING:
            of = rec.world_size or "?"
            waiting = f"ranks: {rec.staged} of {of} staged (the rest have not put it)"
        elif rec.state == StepState.READY:
            done = rec.prepared + rec.prep_failed
            waiting = f"hosts: {done} of {h.nslots} ready to encode"
        else:
            waiting = f"hosts: {rec.stored_count} of {h.nslots} stored their parity"
        out.append(_flight(step, str(rec.state), now - h.first_seen.get(step, now), waiting))
    # staged: taken from the events by the last round, or queued since (a round that does not
    # complete leaves them queued)
    staged = h.staged_waiting | {ev.step for ev in h.events if isinstance(ev, Staged)}
    here = {s for s, _ in h.pending} | staged | h.wanted
    since = now - h.last_round
    for step in sorted(here - seen):
        state = "staged here" if step in staged else "allocated here"
        waiting = f"a round of the storage job (the last completed {since:.1f} s ago)"
        if since > 2.0:
            waiting += ": a peer daemon is not joining (stopped, wedged or gone?)"
        out.append(_flight(step, state, now - h.first_seen.get(step, now), waiting))
    return sorted(out, key=lambda f: -f["age_s"])


def _flight(step: int, state: str, age: float, waiting: str) -> dict[str, Any]:
    return {"step": step, "state": state, "age_s": round(age, 3), "waiting_on": waiting}


def snapshot(
    host: Host, tier: Tier, metrics_port: int | None, accept_errors: dict[str, int] | None = None
) -> Snapshot:
    h = host
    persisted = tier.steps()  # I/O: before the lock
    with h.lock:
        data = parity = tables = 0
        for r in h.catalog.steps.values():
            if not r.state.held:  # pinned steps hold memory too
                continue
            mine = [s for s in r.shards.values() if s.slot == h.slot]
            data += sum(s.nbytes for s in mine)
            tables += sum(s.table[1] for s in mine)
            layout, pos = h.my_layout(r)
            parity += len(layout.parity_stripes[pos]) * r.chunk_bytes
        sent, received, gathered = h.counters()
        return Snapshot(
            job=h.config.job,
            host=h.name,
            slot=h.slot,
            hosts=list(h.hosts),
            k=h.group.k,
            m=h.group.m,
            health=h.health,
            latest=h.catalog.latest(),
            data_bytes=data,
            parity_bytes=parity,
            pool_bytes=h.pool.used,
            memory_budget=h.config.memory_budget,
            memory_limit=h.memory_limit,
            sent_bytes=sent,
            received_bytes=received,
            gathered_bytes=gathered,
            rounds=h.rounds,
            metadata_bytes=sum(h.manifest_bytes.values()) + tables,
            stats={
                **h.stats,
                **h.pool.counters(),
                "pinned_steps": sum(r.state == StepState.PINNED for r in h.catalog.steps.values()),
            },
            protected=h.catalog.protected(),
            in_flight=in_flight(h),
            pinned=sorted(s for s, r in h.catalog.steps.items() if r.state == StepState.PINNED),
            lost={str(s): r.lost for s, r in h.catalog.steps.items() if r.state == StepState.LOST},
            errors=dict(h.errors),
            last_error=h.last_error,
            degraded_stripes=h.degraded_stripes,
            hosts_up=h.nslots,
            hosts_missing=len(h.missing_slots),
            metrics_port=metrics_port,
            persist_dir=str(tier.root) if tier.root else None,
            persisted=persisted,
            unreachable=list(h.unreachable),
            cpu=h.cpu.totals(),
            accept_errors=dict(accept_errors or {}),
            reason=h.failure,
        )
