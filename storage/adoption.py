"""Adoption at start-up: what a relaunched daemon finds in its host directory becomes state again.

Who calls it: :meth:`storage.daemon.Daemon.start`, once, on every daemon (it is collective).
The steps, as in :mod:`storage.recovery`:

1. claim a slot (job-wide: each daemon's claim, layout and the steps it holds a manifest of);
   make the group's communicator;
2. agree on the steps: one a group holds no manifest of, while some of its hosts survived, was
   never acknowledged (the job died as it was protected): it is dropped everywhere; one whose
   group lost every host is lost;
3. within each group, agree on every step's manifest (a host without a valid copy takes its
   group's) and check every chunk; the erasures are the group's to plan;
4. steps a group cannot rebuild are lost, job-wide; the newest step a group can rebuild is
   rebuilt before serving, older ones are left to the round engine, one per round;
5. delete the files of steps that never became protected, and put the newest persisted step
   back if memory holds nothing as new.

The job-wide gathers here grow with the job; they run once, at start-up, never per step.
What it owns: nothing after it returns. Lock: no other thread runs yet; the catalog is changed
under the host's ``lock`` all the same.
"""

from __future__ import annotations

import time
from typing import Any

from storage import recovery
from storage.catalog import StepRec, StepState
from storage.errors import CapacityError, ConfigError
from storage.host import Host, Local
from storage.recovery import Erasures
from storage.repair import Repairer, allowance, moved_bytes
from storage.tier import Tier

__all__ = ["adopt"]


def adopt(host: Host, repairer: Repairer, tier: Tier, hosts_by_rank: list[str]) -> None:
    """Claim a slot, agree on manifests, check chunks, rebuild what was lost (collective)."""
    h = host
    t0 = time.monotonic()
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
    # what the job agreed on per step travels along, for a group that lost every host
    # (a pinned step is its group's own: no other group holds it, so the job does not agree on it)
    summary = {
        str(s): [m["world_size"], m["data_bytes"], m["parity_bytes"]]
        for s, m in valid.items()
        if not m.get("pinned")
    }
    everyone = h.links.allgather_json(
        {"claim": claim, "layout": layout, "steps": summary}, "adoption"
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
    h.join_group()
    g = h.group
    by_slot = {final[r]: e for r, e in enumerate(everyone)}
    known: dict[int, list[int]] = {}
    for e in everyone:
        known.update({int(s): v for s, v in e["steps"].items()})
    if known:
        h.missing_slots = {s for s, e in by_slot.items() if e["claim"] is None}
    adopted, lost_groups = _agree(h, by_slot, known)
    if known:
        h.log(
            f"adoption: {len(valid)} manifest(s) here; slot {h.slot} of {h.nslots} "
            + ("(its files')" if claim is not None else "(a fresh host: the slot nobody held)")
            + f"; {len(adopted)} step(s) agreed, {len(known) - len(adopted)} dropped as "
            f"unfinished ({(time.monotonic() - t0) * 1e3:.0f} ms)"
        )
    else:
        h.log(f"adoption: nothing to adopt (a new job); slot {h.slot} of {h.nslots}")
    # the group's manifests: each step from its first host holding a valid copy
    mine = {
        str(s): valid[s]
        for s in adopted
        if s in valid and min(sl for sl in g.slots if str(s) in by_slot[sl]["steps"]) == h.slot
    }
    # Bases: a step the group's adopted steps refer to may be held here as pinned, or still as
    # protected (a crash came between the commit that retired it and the next round, when its
    # manifest says pinned), or by some hosts of the group only: any valid manifest of a step
    # not adopted may be one.
    agreed = set(adopted)
    pinned_here = {str(s): m for s, m in valid.items() if m.get("pinned") or s not in agreed}
    manifests: dict[int, dict[str, Any]] = {}
    pinned: dict[int, dict[str, Any]] = {}
    for part, pins in h.gl.allgather_json([mine, pinned_here], "manifests"):
        manifests.update({int(s): m for s, m in part.items()})
        for st, m in pins.items():
            pinned.setdefault(int(st), m)
    # pinned steps stay while an adopted step of the group refers to them (and those, in turn)
    wanted = {b for s in adopted if s in manifests for b in _bases(manifests[s])}
    while True:
        more = {b for s in wanted if s in pinned for b in _bases(pinned[s])} - wanted
        if not more:
            break
        wanted |= more
    manifests.update({s: m for s, m in pinned.items() if s in wanted})
    with h.lock:
        for step in adopted:
            if step in manifests:
                h.catalog.steps[step] = recovery.rec_from_manifest(manifests[step], h.catalog)
            else:  # this group lost every host: nothing of it can be rebuilt
                world, data, parity = known[step]
                h.catalog.steps[step] = StepRec(
                    step, world, StepState.PROTECTED, data_bytes=data, parity_bytes=parity
                )
        for step in sorted(wanted & set(pinned)):
            if step not in h.catalog.steps:
                rec = recovery.rec_from_manifest(pinned[step], h.catalog)
                rec.state = StepState.PINNED
                h.catalog.steps[step] = rec
    h.stats["adopted_steps"] = len(adopted)
    # every host checks its own chunks; the erasures of the group are the group's to plan
    t1 = time.monotonic()
    counts = (h.stats["missing_chunks"], h.stats["checksum_failures"])
    checked = {
        str(step): repairer.verify(rec).to_json()
        for step, rec in h.catalog.steps.items()
        if step in manifests
    }
    if checked:
        chunks = sum(
            len(h.catalog.steps[int(st)].blobs[h.slot].chunks)
            + len(h.my_layout(h.catalog.steps[int(st)])[0].parity_stripes[h.group.position(h.slot)])
            for st in checked
        )
        held = sum(
            shard.nbytes
            for st in checked
            for shard in h.catalog.steps[int(st)].shards.values()
            if shard.slot == h.slot
        )
        h.log(
            f"adoption: checked {chunks} chunk(s) of {len(checked)} step(s) here "
            f"({held / 1e6:.1f} MB of shards) in {(time.monotonic() - t1) * 1e3:.0f} ms: "
            f"{int(h.stats['missing_chunks'] - counts[0])} missing, "
            f"{int(h.stats['checksum_failures'] - counts[1])} corrupted"
        )
    erasures: dict[int, dict[int, Erasures]] = {}
    for pos, part in enumerate(h.gl.allgather_json(checked, "erasures")):
        for step, e in part.items():
            er = Erasures.from_json(e)
            if er:
                erasures.setdefault(int(step), {})[g.slots[pos]] = er
    # lost: beyond repair in some group, or in a group that lost every host
    lost_here: dict[str, Any] = {}
    for step, by_slot in erasures.items():
        slots = repairer.lost_slots(h.catalog.steps[step], by_slot)
        if slots:
            rec = h.catalog.steps[step]
            lost_here[str(step)] = recovery.lost_parts(rec, {s: by_slot[s] for s in slots}, h.hosts)
    for step in lost_groups.get(g.index, []):
        lost_here[str(step)] = ([h.hosts[s] for s in g.slots], [])
    # a step whose base is lost (or whose pinned manifest no host of the group kept) goes with it
    missing = {b for b in wanted if b not in h.catalog.steps}
    for b in sorted(missing | {int(st) for st in lost_here}):
        hosts = lost_here[str(b)][0] if str(b) in lost_here else [h.hosts[s] for s in g.slots]
        with h.lock:
            later = h.catalog.lose_referrers(b, hosts)
        for rec, refs in later:
            lost_here[str(rec.step)] = (hosts, refs)
    lost: dict[int, tuple[list[str], list[int]]] = {}
    for part in h.links.allgather_json(lost_here if g.position(h.slot) == 0 else {}, "lost"):
        for step, (hosts, ranks) in part.items():
            old = lost.get(int(step), ([], []))
            lost[int(step)] = (sorted({*old[0], *hosts}), sorted({*old[1], *ranks}))
    with h.lock:
        for step, (hosts, ranks) in lost.items():
            if step not in h.catalog.steps:  # another group's pinned step: never held here
                continue
            rec = h.catalog.steps[step]
            rec.state = StepState.LOST
            rec.lost = {"lost_hosts": hosts, "ranks": ranks}
            h.stats["lost_steps"] += 1
            h.log(
                f"step {step} cannot be rebuilt: more than m chunks of a stripe lost on {hosts} "
                f"(ranks {ranks or 'of that group'})"
            )
    # The commit that protected the newest adopted step retired what retention drops; a crash
    # before every host had removed those steps' manifests leaves them here: retired again now
    # (pinned where the group still refers to them), the same decision on every daemon.
    with h.lock:
        retired = h.catalog.apply_retention()
    if retired:
        h.log(f"adoption: step(s) {retired} retired again (their commit's retention)")
    erasures = {s: e for s, e in erasures.items() if s in h.catalog.steps}
    if erasures:
        h.health = "rebuilding"
        h.degraded_stripes = repairer.degraded(list(erasures.items()))
        h.write_health()
    t2 = time.monotonic()
    # The newest step that can be rebuilt is rebuilt before serving (it is what a restarting
    # trainer reads); older ones are rebuilt in the background, one per round, the same queue on
    # every daemon of the group. The newest step's parity is rebuilt before serving too:
    # deferring it served 25% sooner (0.71 s against 0.94 s for 1.5 GB, RS(3,1)), but a second
    # loss in the group right after the relaunch then lost the newest step (tried and measured).
    todo = sorted((s for s in erasures if s not in lost), reverse=True)
    # The job waits for the slowest group's rebuild at its next collective: that wait is given
    # the time the largest rebuild may take at a slow floor rate, beside the peer timeout (a
    # rebuild longer than the peer timeout ended the job, and the next launch rebuilt again).
    moved = moved_bytes(h.catalog.steps[todo[0]], h.group.k, erasures[todo[0]]) if todo else 0
    most = h.links.max_of(moved, "adoption (rebuild sizes)")
    rebuild_wait = h.config.peer_timeout + allowance(most)
    for i, step in enumerate(todo):
        if i:
            repairer.deferred.append((step, erasures[step]))
            continue
        here = erasures[step].get(h.slot, Erasures())
        h.log(
            f"adoption: rebuilding step {step} before serving: the group lost "
            f"{sum(len(e.data) + len(e.parity) for e in erasures[step].values())} chunk(s), "
            f"{len(here.data) + len(here.parity)} of them here"
        )
        tr = time.monotonic()
        try:
            # every host verified all its chunks of it just now
            repairer.repair(h.catalog.steps[step], erasures[step], checked=True)
        except CapacityError as exc:  # every host of the group alike (Repairer.repair)
            h.log(f"adoption: rebuilding step {step} failed ({exc}); it is rebuilt while serving")
            repairer.deferred.insert(0, (step, erasures[step]))
            continue
        h.log(
            f"adoption: rebuilt step {step} in {time.monotonic() - tr:.2f} s; "
            f"{len(todo) - 1} older step(s) left to rebuild while serving"
        )
    if most:
        h.links.barrier("the rebuild before serving", timeout=rebuild_wait)
    h.stats["startup_rebuild_seconds"] = time.monotonic() - t2
    # files of steps that never became protected (the job died mid-put) are not state
    steps = h.catalog.steps
    keep = {s.buffer for r in steps.values() for s in r.shards.values() if s.slot == h.slot}
    keep |= {r.parity[h.slot] for r in steps.values() if h.slot in r.parity}
    if h.config.reserve:
        keep |= set(h.pool.adopt_reserve())  # pre-faulted by an earlier daemon: still good
    removed = h.pool.sweep(keep)
    for name in list(h.pool.files):
        if name not in keep:
            h.pool.drop(name)
    for step, rec in steps.items():
        loc = h.local.setdefault(step, Local())
        loc.buffers = {r: s.buffer for r, s in rec.shards.items() if s.slot == h.slot}
        loc.parity = rec.parity.get(h.slot)
        loc.prepared = loc.stored = True
        if rec.state.held:
            h.write_manifest(rec, loc)
            loc.pinned_manifest = rec.state == StepState.PINNED
        else:
            h.remove_manifest(step)
    for step in valid:
        if step not in steps:
            h.remove_manifest(step)  # dropped: never acknowledged
    tier.restore_newest()
    if repairer.deferred:
        h.degraded_stripes = repairer.degraded(repairer.deferred)
    else:
        h.health = "healthy"
        h.degraded_stripes = 0
        h.missing_slots = set()
    h.write_health()
    if adopted or removed:
        h.log(
            f"adopted {len(adopted)} step(s) as slot {h.slot}: checked in "
            f"{(t2 - t1) * 1e3:.0f} ms, rebuilt {int(h.stats['rebuilt_chunks'])} chunk(s) here "
            f"in {(time.monotonic() - t2) * 1e3:.0f} ms ({len(repairer.deferred)} older step(s) "
            f"left to rebuild while serving); lost steps {sorted(lost) or 'none'}; removed "
            f"{len(removed)} file(s) of unfinished steps; {(time.monotonic() - t0):.2f} s in all"
        )


def _bases(manifest: dict[str, Any]) -> set[int]:
    """The steps a manifest's shards refer to for their unchanged tensors."""
    return {int(sh.get("base", -1)) for sh in manifest["shards"]} - {-1}


def _agree(
    h: Host, by_slot: dict[int, dict[str, Any]], known: dict[int, list[int]]
) -> tuple[list[int], dict[int, list[int]]]:
    """The steps every daemon adopts, and per group index the steps it lost every host of.

    A step is adopted when every group either holds a manifest of it (on some host) or lost
    every host (then the step is lost). A group with surviving hosts but no manifest of the step
    either never finished writing it (the job died as it was protected, before any trainer was
    told: that waits until every host has written its manifest) or had removed it as retired,
    which a host does only once every host holds the manifest of the step that retired it (see
    :class:`storage.rounds.Rounds`): either way it is dropped everywhere, and a step any rank saw
    protected, or a newer one that retired it, is adopted."""
    adopted = []
    lost_groups: dict[int, list[int]] = {}
    for step in sorted(known):
        fully_lost = []
        complete = True
        for grp in h.groups:
            holders = [s for s in grp.slots if str(step) in by_slot[s]["steps"]]
            if holders:
                continue
            if all(by_slot[s]["claim"] is None for s in grp.slots):
                fully_lost.append(grp.index)
            else:
                complete = False
        if complete:
            adopted.append(step)
            for gi in fully_lost:
                lost_groups.setdefault(gi, []).append(step)
    return adopted, lost_groups


def _check_layout(h: Host, layouts: list[dict[str, Any]]) -> None:
    first = layouts[0]
    if any(lay != first for lay in layouts):
        raise ConfigError("hosts hold files of different layouts; wipe the odd ones out")
    groups = [{"slots": list(g.slots), "k": g.k, "m": g.m} for g in h.groups]
    same_groups = first["groups"] == groups
    same_chunk = first["chunk_bytes"] == h.chunk_bytes
    # What the arguments leave to ecsnap is taken from the files: (k, m) without --k/--m, the
    # largest chunk without --chunk-bytes (whose default differs between virtual hosts and a
    # network, and changed for networks once).
    if (
        first["hosts"] == h.nslots
        and (same_groups or h.config.k is None)
        and (same_chunk or not h.config.chunk_bytes)
    ):
        if not (same_groups and same_chunk):
            g0 = first["groups"][0]
            h.set_layout(None if same_groups else (g0["k"], g0["m"]), first["chunk_bytes"])
        return
    raise ConfigError(
        f"the files under {h.dir.parent} were written by {first['hosts']} hosts with "
        f"groups {[(g['k'], g['m']) for g in first['groups']]} and --chunk-bytes "
        f"{first['chunk_bytes']}; this job runs {h.nslots} hosts with "
        f"{[(g.k, g.m) for g in h.groups]} and --chunk-bytes {h.chunk_bytes}. "
        "Relaunch with the same arguments, or use a new --job (or root) to start afresh."
    )
