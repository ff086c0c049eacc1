"""One daemon's state at a glance, typed: the :class:`~storage.protocol.Snapshot` behind the
``info`` request, ``ecsnap status`` and ``/metrics``.

Who calls it: the socket service (``info``) and the metrics collector at each scrape, on their
own threads. What it owns: nothing. Lock: the host's ``lock`` while it reads; the persistent
tier's listing (disk I/O) is taken before the lock, never under it.
"""

from __future__ import annotations

from storage.catalog import StepState
from storage.host import Host
from storage.protocol import Snapshot
from storage.tier import Tier

__all__ = ["snapshot"]


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
            in_flight=sorted(s for s, r in h.catalog.steps.items() if r.state.in_flight),
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
