"""Adoption at start-up: what a relaunched daemon finds in its host directory becomes state again.

Who calls it: :meth:`storage.daemon.Daemon.start`, once, on every daemon (it is collective).
The steps, as in :mod:`storage.recovery`: claim a slot; agree on every step's manifest; check
every chunk; rebuild the newest step that can be rebuilt before serving, mark the ones that
cannot as lost, and leave older rebuilds to the round engine; delete the files of steps that
never became protected; put the newest persisted step back if memory holds nothing as new.
What it owns: nothing after it returns. Lock: the host's ``lock`` is not needed yet (no other
thread runs); it is taken where the catalog changes all the same.
"""

from __future__ import annotations

import time
from typing import Any

from storage import recovery
from storage.catalog import StepState
from storage.errors import ConfigError
from storage.host import Host, Local
from storage.recovery import Erasures
from storage.repair import Repairer
from storage.tier import Tier

__all__ = ["adopt"]


def adopt(host: Host, repairer: Repairer, tier: Tier, hosts_by_rank: list[str]) -> None:
    """Claim a slot, agree on manifests, check chunks, rebuild what was lost (collective)."""
    h = host
    valid, bad = recovery.scan(h.dir)
    for name in bad:
        h.stats["checksum_failures"] += 1
        h.log(f"manifest {name} fails its checksum: taking it from a peer")
        (h.dir / "steps" / name).unlink()
    newest = valid[max(valid)] if valid else None
    claim = None
    layout = None
    if newest is not None:
        if h.name in newest["hosts"]:
            claim = newest["hosts"].index(h.name)
        layout = {
            "hosts": len(newest["hosts"]),
            "groups": newest["groups"],
            "chunk_bytes": newest["chunk_bytes"],
        }
    digests = {str(s): m["checksum"] for s, m in valid.items()}
    everyone = h.links.allgather_json(
        {"claim": claim, "layout": layout, "steps": digests}, "adoption"
    )
    layouts = [e["layout"] for e in everyone if e["layout"] is not None]
    if layouts:
        _check_layout(h, layouts)
    # slots: each claims the one its files name; the rest fill the holes in rank order
    slot_of_rank: list[int | None] = [e["claim"] for e in everyone]
    claimed = [s for s in slot_of_rank if s is not None]
    twice = sorted({s for s in claimed if claimed.count(s) > 1})
    if twice:
        raise ConfigError(f"two daemons hold the files of slot(s) {twice}")
    free = iter(s for s in range(h.nslots) if s not in claimed)
    final = [s if s is not None else next(free) for s in slot_of_rank]
    h.slot_of_rank = final
    h.rank_of = [final.index(s) for s in range(h.nslots)]
    h.slot = final[h.rank]
    h.hosts = [hosts_by_rank[h.rank_of[s]] for s in range(h.nslots)]
    # manifests: each step from the lowest rank holding a valid copy
    source: dict[str, int] = {}
    for r, e in enumerate(everyone):
        for step in e["steps"]:
            source.setdefault(step, r)
    share = {s: valid[int(s)] for s, r in source.items() if r == h.rank}
    manifests: dict[int, dict[str, Any]] = {}
    for part in h.links.allgather_json(share, "manifests"):
        manifests.update({int(s): m for s, m in part.items()})
    for step in sorted(manifests):
        h.catalog.steps[step] = recovery.rec_from_manifest(manifests[step], h.catalog)
    h.stats["adopted_steps"] = len(manifests)
    # every host checks its own chunks; the erasures of all are everyone's to plan
    t0 = time.monotonic()
    mine = {str(step): repairer.verify(rec).to_json() for step, rec in h.catalog.steps.items()}
    erasures: dict[int, dict[int, Erasures]] = {}
    for r, part in enumerate(h.links.allgather_json(mine, "erasures")):
        for step, e in part.items():
            er = Erasures.from_json(e)
            if er:
                erasures.setdefault(int(step), {})[final[r]] = er
    if erasures:
        h.health = "rebuilding"
        h.missing_slots = {
            final[r] for r, e in enumerate(everyone) if e["claim"] is None and manifests
        }
        h.degraded_stripes = repairer.degraded(list(erasures.items()))
        h.write_health()
    t1 = time.monotonic()
    # The newest step that can be rebuilt is rebuilt before serving (it is what a restarting
    # trainer reads); steps that cannot are marked lost now (cheap); older ones are rebuilt
    # in the background, one per round, the same queue on every daemon. The newest step's
    # parity is rebuilt before serving too: deferring it served 25% sooner (0.71 s against
    # 0.94 s for 1.5 GB, RS(3,1)), but a second loss in the group right after the relaunch
    # then lost the newest step (tried and measured).
    rebuilt_one = False
    for step in sorted(erasures, reverse=True):
        rec = h.catalog.steps[step]
        if rebuilt_one and not repairer.lost_slots(rec, erasures[step]):
            repairer.deferred.append((step, erasures[step]))
            continue
        repairer.repair(rec, erasures[step])
        rebuilt_one = rebuilt_one or rec.state == StepState.PROTECTED
    h.stats["startup_rebuild_seconds"] = time.monotonic() - t1
    if h.trace:
        h.log(
            f"adoption: verify {(t1 - t0) * 1e3:.1f}ms, repair "
            f"{(time.monotonic() - t1) * 1e3:.1f}ms"
        )
    # files of steps that never became protected (the job died mid-put) are not state
    keep = {
        s.buffer for r in h.catalog.steps.values() for s in r.shards.values() if s.slot == h.slot
    }
    keep |= {r.parity[h.slot] for r in h.catalog.steps.values() if h.slot in r.parity}
    removed = h.pool.sweep(keep)
    for name in list(h.pool.files):
        if name not in keep:
            h.pool.drop(name)
    for step, rec in h.catalog.steps.items():
        loc = h.local.setdefault(step, Local())
        loc.buffers = {r: s.buffer for r, s in rec.shards.items() if s.slot == h.slot}
        loc.parity = rec.parity.get(h.slot)
        loc.prepared = loc.stored = True
        if rec.state == StepState.PROTECTED:
            h.write_manifest(rec, loc)
        else:
            h.remove_manifest(step)
    tier.restore_newest()
    if repairer.deferred:
        h.degraded_stripes = repairer.degraded(repairer.deferred)
    else:
        h.health = "healthy"
        h.degraded_stripes = 0
        h.missing_slots = set()
    h.write_health()
    if manifests or removed:
        lost = [s for s, r in h.catalog.steps.items() if r.state == StepState.LOST]
        h.log(
            f"adopted {len(manifests)} step(s) as slot {h.slot}; rebuilt "
            f"{int(h.stats['rebuilt_chunks'])} chunk(s) here; lost steps {lost or 'none'}; "
            f"removed {len(removed)} file(s) of unfinished steps"
        )


def _check_layout(h: Host, layouts: list[dict[str, Any]]) -> None:
    first = layouts[0]
    if any(lay != first for lay in layouts):
        raise ConfigError("hosts hold files of different layouts; wipe the odd ones out")
    want = {
        "hosts": h.nslots,
        "groups": [{"slots": list(g.slots), "k": g.k, "m": g.m} for g in h.groups],
        "chunk_bytes": h.chunk_bytes,
    }
    if first == want:
        return
    if h.config.k is None and first["hosts"] == h.nslots and first["chunk_bytes"] == h.chunk_bytes:
        g0 = first["groups"][0]
        h.set_layout(g0["k"], g0["m"])
        return
    raise ConfigError(
        f"the files under {h.dir.parent} were written by {first['hosts']} hosts with "
        f"groups {[(g['k'], g['m']) for g in first['groups']]} and --chunk-bytes "
        f"{first['chunk_bytes']}; this job runs {h.nslots} hosts with "
        f"{[(g.k, g.m) for g in h.groups]} and --chunk-bytes {h.chunk_bytes}. "
        "Relaunch with the same arguments, or use a new --job (or root) to start afresh."
    )
