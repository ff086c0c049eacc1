"""The catalog of steps: what the whole job agrees on, and what this host's group knows in detail.

Every daemon applies the same reduced :class:`~storage.protocol.Ballot` each round, so the
job-wide part of the catalog is the same everywhere without a leader: each step's state, world
size, total bytes, and retention's choices. Steps in flight hold a *lane* of the ballot, the
same on every daemon. The group part (each shard's record, every member's checksums and parity
file, the stripe layout) is known only on the hosts of the step's group, which apply their
group's events each round: its size grows with the group, never with the job.

A step moves (see :class:`~storage.protocol.StepState`)::

    STAGING --(world_size ranks staged)--> READY --(every daemon prepared)--> ENCODING
    ENCODING --(every daemon stored)--> PROTECTED,   STAGING/READY --> FAILED,   PROTECTED --> LOST
    PROTECTED --(evicted or deleted while a kept step of the group refers to it)--> PINNED

Pinning is the group's own: a shard whose record names a ``base`` step keeps that step's chunks
in its group (state ``PINNED``: gone for readers, still checked and rebuilt) until no step of
the group refers to it, nor any put that announced it would (a :class:`~storage.protocol.Pin`).

Who calls it: the round engine is the only writer; every other thread reads under the host's
lock. No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.errors import CapacityError, StorageError, to_wire
from storage.placement import Group, HostBlob, StripeLayout, chunk_size
from storage.protocol import LANES, Ballot, ShardRecord, StepState

__all__ = ["Catalog", "ShardRec", "StepRec", "StepState"]

ShardRec = ShardRecord


@dataclass
class StepRec:
    """One step: the job-wide part first, then the part this host's group knows."""

    step: int
    world_size: int = 0  # 0 until a rank of it is counted
    state: StepState = StepState.STAGING
    lane: int | None = None
    # job-wide, accumulated from the ballots while in flight
    staged: int = 0
    rank_sum: int = 0
    rank_sq: int = 0
    data_bytes: int = 0
    prepared: int = 0
    prep_failed: int = 0
    fail_slot: int | None = None
    stored_count: int = 0
    parity_bytes: int = 0
    world_min: int | None = None
    error: dict[str, Any] | None = None  # why it failed, as an error reply (errors.to_wire)
    lost: dict[str, Any] = field(default_factory=dict)  # why it cannot be rebuilt
    # this host's group only
    chunk_bytes: int = 0  # the group's chunk for this step (from its blobs' size), once ready
    shards: dict[int, ShardRecord] = field(default_factory=dict)  # rank -> its shard record
    stored: dict[int, dict[str, Any]] = field(default_factory=dict)  # slot -> its checksums
    parity: dict[int, str] = field(default_factory=dict)  # slot -> its parity file
    blobs: dict[int, HostBlob] = field(default_factory=dict)
    layouts: dict[int, StripeLayout] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of every rank's shard (the whole job's)."""
        return self.data_bytes

    def chunk_checks(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(blob chunk index, offset in the shard, length, checksum) of each data chunk of
        ``rank``'s shard, on the host that holds it; -1 where no checksum is known (no chunk's
        bytes match it)."""
        slot = self.shards[rank].slot
        crc = self.stored.get(slot, {}).get("data", [])
        return [
            (c, ref.offset, ref.length, crc[c] if c < len(crc) else -1)
            for c, ref in enumerate(self.blobs[slot].chunks)
            if ref.rank == rank
        ]


class Catalog:
    """Steps by number, as this host sees them (module docstring)."""

    def __init__(self, groups: list[Group], slots: int, chunk_bytes: int, keep: int) -> None:
        self.groups = groups
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self.group: Group | None = None  # this host's group, once its slot is known
        self.hosts: list[str] = []  # by slot, for messages
        self.steps: dict[int, StepRec] = {}
        self.lanes: list[int | None] = [None] * LANES
        self.recently_protected: dict[int, None] = {}  # insertion-ordered, bounded
        self.failed: dict[int, dict[str, Any]] = {}  # step -> the error that failed it (to_wire)
        # puts announced with a base, before their records: (step, rank) -> base; and refused
        self.pins: dict[tuple[int, int], int] = {}
        self.pin_refused: set[tuple[int, int]] = set()
        self.group_of = {slot: g for g in groups for slot in g.slots}

    # -- queries ---------------------------------------------------------------------------------

    def protected(self) -> list[int]:
        return sorted(s for s, r in self.steps.items() if r.state == StepState.PROTECTED)

    def latest(self) -> int | None:
        p = self.protected()
        return p[-1] if p else None

    def refusal(self, step: int) -> str | None:
        """Why a new put of ``step`` is refused, or None. Steps are write-once and go forward:
        a number the job holds (readable, or pinned as the base of newer steps) cannot be put
        again, nor one older than the newest protected step (a rollback: delete the newer steps
        first). Only the job-wide part of this (protected steps) decides at lane time, so every
        group gives the same answer; pinned is per group, and is refused early where known."""
        rec = self.steps.get(step)
        if rec is not None and rec.state not in (StepState.STAGING, StepState.LOST):
            return (
                f"step {step} was already put by every rank (it is {rec.state}; steps are "
                "write-once); delete it first or put a new step"
                + (
                    " (a pinned step is gone for readers, but later steps still refer to its "
                    "tensors: delete those first)"
                    if rec.state == StepState.PINNED
                    else ""
                )
            )
        latest = self.latest()
        if rec is None and latest is not None and step < latest:
            return (
                f"step {step} is older than step {latest}, which the job holds: steps go forward "
                "(get() serves the newest). To roll back, delete every step after the one you "
                "resume from (store.delete(s) for each, or store.rollback(to)), then put again"
            )
        return None

    def lane_of(self, step: int) -> int | None:
        rec = self.steps.get(step)
        return rec.lane if rec is not None else None

    # -- the group's events ------------------------------------------------------------------------

    def pin(self, step: int, rank: int, base: int) -> None:
        """A put of ``step`` by ``rank`` will refer to ``base``: kept from now on, if still held."""
        held = self.steps.get(base)
        if held is not None and held.state.held and rank in held.shards:
            self.pins[(step, rank)] = base
        else:
            self.pin_refused.add((step, rank))

    def unpin(self, step: int, rank: int) -> None:
        self.pins.pop((step, rank), None)

    def _drop_pins(self, step: int) -> None:
        """The puts of ``step`` that announced a base will not stage (deleted, failed)."""
        self.pins = {k: b for k, b in self.pins.items() if k[0] != step}

    def referenced(self) -> set[int]:
        """Steps some step of the group (or an announced put) refers to."""
        out = set(self.pins.values())
        for rec in self.steps.values():
            if rec.state != StepState.FAILED:
                out.update(s.base for s in rec.shards.values() if s.base >= 0)
        return out

    def release_pins(self) -> list[int]:
        """Pinned steps nothing refers to any more leave the catalog; returns them."""
        gone: list[int] = []
        # none pinned, none to release: the common case, without walking every step's shards
        # (once a round: a daemon keeping 1,000 steps spent a fifth of its rounds here)
        if not any(r.state == StepState.PINNED for r in self.steps.values()):
            return gone
        while True:
            refs = self.referenced()
            free = [
                s for s, r in self.steps.items() if r.state == StepState.PINNED and s not in refs
            ]
            if not free:
                return gone
            for s in free:
                del self.steps[s]
            gone += free

    def _retire(self, step: int) -> None:
        """A protected step leaves the readers' view: pinned if the group refers to it."""
        rec = self.steps.get(step)
        if rec is None:
            return
        if step in self.referenced():
            rec.state = StepState.PINNED
        else:
            del self.steps[step]

    def staged(self, step: int, shard: ShardRecord) -> ShardRecord | None:
        """A group member staged ``shard``; returns the record it replaces (a rank putting an
        unfinished step again), if any."""
        self.pins.pop((step, shard.rank), None)
        rec = self.steps.get(step)
        if rec is None or rec.state != StepState.STAGING:
            return None
        old = rec.shards.get(shard.rank)
        rec.shards[shard.rank] = shard
        return old

    def stored(
        self,
        slot: int,
        step: int,
        parity: str | None,
        crc: dict[str, Any],
        data_crc: Sequence[Sequence[int]] = (),
    ) -> None:
        """A group member's exchange is done: its parity's name and checksums, and those of the
        other hosts' data chunks it took as they arrived (``[slot, chunk, crc]``), in any order
        among the members' (see :class:`storage.protocol.Stored`)."""
        rec = self.steps.get(step)
        if rec is None or rec.state != StepState.ENCODING:
            return
        mine = rec.stored.setdefault(slot, {"data": [], "parity": []})
        mine["parity"] = list(crc.get("parity", []))
        if crc.get("data"):  # the host's own, where it takes them itself
            mine["data"] = list(crc["data"])
        for of, c, value in data_crc:
            data = rec.stored.setdefault(of, {"data": [], "parity": []})["data"]
            if len(data) <= c:
                data.extend([-1] * (c + 1 - len(data)))
            data[c] = value
        if parity:
            rec.parity[slot] = parity

    # -- the job's ballot --------------------------------------------------------------------------

    def assign(self, step: int) -> StepRec | None:
        """Give the new ``step`` a lane (the lowest free one); None if every lane is taken."""
        free = [i for i, s in enumerate(self.lanes) if s is None]
        if not free:
            return None
        old = self.steps.get(step)
        if old is not None and old.state == StepState.LOST:
            del self.steps[step]  # a lost step's number may be put afresh
        self.recently_protected.pop(step, None)
        self.failed.pop(step, None)
        rec = self.steps[step] = StepRec(step, lane=free[0])
        self.lanes[free[0]] = step
        return rec

    def oldest_staging(self) -> int | None:
        staging = [
            s for s in self.lanes if s is not None and self.steps[s].state == StepState.STAGING
        ]
        return min(staging) if staging else None

    def count(self, b: Ballot) -> list[StepRec]:
        """Apply the job's reduced ballot to every step in a lane; return the steps whose state
        changed, in step order."""
        changed = []
        for lane, step in enumerate(self.lanes):
            if step is None:
                continue
            rec = self.steps[step]
            before = rec.state
            self._count_lane(rec, lane, b)
            if rec.state != before:
                changed.append(rec)
                if not rec.state.in_flight:
                    self.lanes[lane] = None
                    rec.lane = None
        for rec in sorted(changed, key=lambda r: r.step):
            if rec.state == StepState.PROTECTED:
                self._protected(rec)
        return sorted(changed, key=lambda r: r.step)

    def _count_lane(self, rec: StepRec, lane: int, b: Ballot) -> None:
        rec.staged += b.sum(lane, Ballot.STAGED)
        rec.rank_sum += b.sum(lane, Ballot.RANK_SUM)
        rec.rank_sq += b.sum(lane, Ballot.RANK_SQ)
        rec.data_bytes += b.sum(lane, Ballot.DATA_BYTES)
        rec.prepared += b.sum(lane, Ballot.PREPARED)
        rec.prep_failed += b.sum(lane, Ballot.PREP_FAILED)
        rec.stored_count += b.sum(lane, Ballot.STORED)
        rec.parity_bytes += b.sum(lane, Ballot.PARITY_BYTES)
        world, world_neg = b.max(lane, Ballot.WORLD), b.max(lane, Ballot.WORLD_NEG)
        if world is not None and world_neg is not None:
            rec.world_size = max(rec.world_size, world)
            low = -world_neg
            rec.world_min = low if rec.world_min is None else min(rec.world_min, low)
        fail = b.max(lane, Ballot.FAIL_SLOT_NEG)
        if fail is not None:
            slot = -fail
            rec.fail_slot = slot if rec.fail_slot is None else min(rec.fail_slot, slot)
        if rec.state == StepState.STAGING:
            self._staging(rec)
        if rec.state == StepState.READY and rec.prepared + rec.prep_failed == self.slots:
            if rec.prep_failed:
                host = self._host(rec.fail_slot)
                rec.state = StepState.FAILED
                rec.error = to_wire(
                    CapacityError(
                        f"step {rec.step} failed: host {host} had no memory for its parity "
                        f"(over --memory-budget or /dev/shm full); raise the budget, lower "
                        "--keep, or delete old steps. Nothing stored was touched."
                    )
                )
            else:
                rec.state = StepState.ENCODING
        if rec.state == StepState.ENCODING and rec.stored_count == self.slots:
            rec.state = StepState.PROTECTED

    def _staging(self, rec: StepRec) -> None:
        w = rec.world_size
        if rec.world_min is not None and rec.world_min != w:
            self._fail(
                rec,
                f"ranks put step {rec.step} with world_size {rec.world_min} and {w}; every rank "
                "of a step must give the same world_size",
            )
        elif w and rec.staged > w:
            self._fail(
                rec,
                f"step {rec.step}: {rec.staged} shards staged for world_size {w}: a rank put "
                "it on two hosts; put each rank's shard on one host",
            )
        elif w and rec.staged == w:
            if rec.rank_sum != w * (w - 1) // 2 or rec.rank_sq != (w - 1) * w * (2 * w - 1) // 6:
                self._fail(
                    rec,
                    f"step {rec.step}: {w} shards staged, but not one of each rank 0..{w - 1} "
                    "(a rank put it on two hosts); put each rank's shard on one host",
                )
            else:
                self.layout(rec)
                rec.state = StepState.READY

    def _fail(self, rec: StepRec, message: str) -> None:
        rec.state = StepState.FAILED
        rec.error = to_wire(StorageError(message))

    def _host(self, slot: int | None) -> str:
        if slot is None:
            return "?"
        return self.hosts[slot] if slot < len(self.hosts) else f"slot {slot}"

    def _protected(self, rec: StepRec) -> None:
        # retention may drop it in this same round: a late waiter must still learn that it was
        # protected
        self.recently_protected[rec.step] = None
        while len(self.recently_protected) > 4096:
            self.recently_protected.pop(next(iter(self.recently_protected)))
        for old in self.evictions():
            self._retire(old)
        for old in [s for s, r in self.steps.items() if r.state == StepState.LOST]:
            if old < rec.step:
                del self.steps[old]  # a newer step is protected: no use any more

    def apply_retention(self) -> list[int]:
        """Retire the protected steps beyond ``keep`` (at adoption, where a crash may have come
        before the commit's retention reached every host's files); returns them."""
        old = self.evictions()
        for step in old:
            self._retire(step)
        return old

    def fail(self, step: int, message: str) -> None:
        """Fail an in-flight step that every daemon gives up alike (its lane is needed)."""
        rec = self.steps.get(step)
        if rec is not None and rec.lane is not None:
            self._fail(rec, message)
            self.lanes[rec.lane] = None
            rec.lane = None

    # -- rare events -------------------------------------------------------------------------------

    def delete(self, step: int) -> None:
        rec = self.steps.get(step)
        if rec is None or rec.state == StepState.PINNED:
            return
        if rec.lane is not None:
            self.lanes[rec.lane] = None
            rec.lane = None
        if rec.state == StepState.PROTECTED:
            self._retire(step)
        else:
            del self.steps[step]
        self._drop_pins(step)

    def lose(self, step: int, lost_hosts: list[str], ranks: list[int]) -> StepRec | None:
        """Another group found ``step`` beyond repair (this group may hold its part still)."""
        rec = self.steps.get(step)
        if rec is None or rec.state != StepState.PROTECTED:
            return None
        rec.state = StepState.LOST
        rec.lost = {"lost_hosts": lost_hosts, "ranks": ranks}
        return rec

    def lose_referrers(self, base: int, hosts: list[str]) -> list[tuple[StepRec, list[int]]]:
        """``base`` is lost in this group: so is every step whose shards here refer to it (and
        to those, in turn); returns each with the ranks that referred."""
        out: list[tuple[StepRec, list[int]]] = []
        todo = [base]
        while todo:
            b = todo.pop()
            for rec in self.steps.values():
                refs = sorted(r for r, s in rec.shards.items() if s.base == b)
                if refs and rec.state.held:
                    rec.state = StepState.LOST
                    rec.lost = {"lost_hosts": hosts, "ranks": refs}
                    out.append((rec, refs))
                    todo.append(rec.step)
        return out

    def drop_failed(self, step: int) -> None:
        """A failed step leaves the catalog (its number may be put again); its error stays."""
        rec = self.steps.get(step)
        if rec is not None and rec.state == StepState.FAILED:
            del self.steps[step]
            self._drop_pins(step)
            self.failed[step] = rec.error or to_wire(StorageError(f"step {step} failed"))

    # -- layout ------------------------------------------------------------------------------------

    def layout(self, rec: StepRec) -> None:
        """Each member's blob and the stripes of this host's group, from the group's shards;
        the chunk size from the largest blob (:func:`~storage.placement.chunk_size`), unless
        a manifest gave it."""
        g = self.group
        if g is None:
            return
        per_slot: dict[int, list[tuple[int, int]]] = {s: [] for s in g.slots}
        for shard in rec.shards.values():
            per_slot[shard.slot].append((shard.rank, shard.nbytes))
        if not rec.chunk_bytes:
            largest = max((sum(n for _, n in v) for v in per_slot.values()), default=0)
            rec.chunk_bytes = chunk_size(largest, self.chunk_bytes)
        cb = rec.chunk_bytes
        rec.blobs = {s: HostBlob(tuple(sorted(v)), cb) for s, v in per_slot.items()}
        rec.layouts = {g.index: StripeLayout(g, [len(rec.blobs[s].chunks) for s in g.slots])}

    def evictions(self) -> list[int]:
        """Protected steps beyond ``keep``, oldest first: never the newest protected one.

        Applied in the same transition that protects a newer step, so readers never see more
        than ``keep`` protected steps and never fewer than one once any step is protected.
        """
        p = self.protected()
        return p[: max(0, len(p) - self.keep)]
