"""The replicated catalog of steps: a state machine every daemon applies to the same event log.

Each round the daemons allgather their new events and apply them in slot order, so every daemon
holds the same catalog and takes the same decisions (which step is ready, when it is protected,
which step retention evicts) without a leader. A step moves

    staging --(all world_size shards staged)--> ready --(every daemon prepared)--> encoding
    encoding --(every daemon stored its parity)--> protected
    ready --(a daemon could not prepare: no memory)--> failed
    protected --(more than m chunks of a stripe lost: see recovery)--> lost

and only ``protected`` steps are visible to readers. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from storage.errors import StorageError, to_wire
from storage.placement import Group, HostBlob, StripeLayout
from storage.protocol import StepState

__all__ = ["Catalog", "ShardRec", "StepRec", "StepState"]


@dataclass
class ShardRec:
    rank: int
    slot: int
    nbytes: int
    buffer: str
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "slot": self.slot,
            "nbytes": self.nbytes,
            "buffer": self.buffer,
            "meta": self.meta,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ShardRec:
        return ShardRec(
            int(d["rank"]), int(d["slot"]), int(d["nbytes"]), str(d["buffer"]), d["meta"]
        )


@dataclass
class StepRec:
    step: int
    world_size: int
    shards: dict[int, ShardRec] = field(default_factory=dict)
    state: StepState = StepState.STAGING
    prepared: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    stored: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: dict[str, Any] | None = None  # why it failed, as an error reply (errors.to_wire)
    parity: dict[int, str] = field(default_factory=dict)  # slot -> its parity file
    lost: dict[str, Any] = field(default_factory=dict)  # why a step cannot be rebuilt
    blobs: dict[int, HostBlob] = field(default_factory=dict)
    layouts: dict[int, StripeLayout] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())


class Catalog:
    """Steps by number, as every daemon of the job sees them."""

    def __init__(self, groups: list[Group], slots: int, chunk_bytes: int, keep: int) -> None:
        self.groups = groups
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self.steps: dict[int, StepRec] = {}
        self.recently_protected: dict[int, None] = {}  # insertion-ordered, bounded
        self.failed: dict[int, dict[str, Any]] = {}  # step -> the error that failed it (to_wire)
        self.group_of = {slot: g for g in groups for slot in g.slots}

    # -- queries ---------------------------------------------------------------------------------

    def protected(self) -> list[int]:
        return sorted(s for s, r in self.steps.items() if r.state == StepState.PROTECTED)

    def latest(self) -> int | None:
        p = self.protected()
        return p[-1] if p else None

    # -- transitions -----------------------------------------------------------------------------

    def apply(self, slot: int, event: dict[str, Any]) -> None:
        kind = event.get("e")
        if kind == "staged":
            self._staged(event)
        elif kind == "prepared":
            rec = self.steps.get(int(event["step"]))
            if rec is not None and rec.state == StepState.READY:
                rec.prepared[slot] = event.get("error")
                if len(rec.prepared) == self.slots:
                    errors = [e for e in rec.prepared.values() if e]
                    if errors:
                        rec.state, rec.error = StepState.FAILED, errors[0]
                    else:
                        rec.state = StepState.ENCODING
        elif kind == "stored":
            rec = self.steps.get(int(event["step"]))
            if rec is not None and rec.state == StepState.ENCODING:
                rec.stored[slot] = event.get("crc", {})
                if event.get("parity"):
                    rec.parity[slot] = str(event["parity"])
                if len(rec.stored) == self.slots:
                    rec.state = StepState.PROTECTED
                    # retention may drop it in this same round: a late waiter must still learn
                    # that it was protected
                    self.recently_protected[rec.step] = None
                    while len(self.recently_protected) > 4096:
                        self.recently_protected.pop(next(iter(self.recently_protected)))
                    for old in self.evictions():
                        del self.steps[old]
                    for old in [s for s, r in self.steps.items() if r.state == StepState.LOST]:
                        if old < rec.step:
                            del self.steps[old]  # a newer step is protected: no use any more
        elif kind == "delete":
            self.steps.pop(int(event["step"]), None)

    def drop_failed(self, step: int) -> None:
        """A failed step leaves the catalog (its number may be put again); its error stays."""
        rec = self.steps.get(step)
        if rec is not None and rec.state == StepState.FAILED:
            del self.steps[step]
            self.failed[step] = rec.error or to_wire(StorageError(f"step {step} failed"))

    def _staged(self, event: dict[str, Any]) -> None:
        step, world = int(event["step"]), int(event["world_size"])
        rec = self.steps.get(step)
        if rec is None or rec.state == StepState.LOST:  # a lost step's number may be put afresh
            rec = self.steps[step] = StepRec(step, world)
            self.recently_protected.pop(step, None)
        if rec.state != StepState.STAGING:
            return
        if world != rec.world_size:
            rec.state = StepState.FAILED
            rec.error = to_wire(
                StorageError(
                    f"rank {event['shard']['rank']} put step {step} with world_size {world}, "
                    f"others with {rec.world_size}; every rank of a step must give the same "
                    "world_size"
                )
            )
            return
        shard = ShardRec.from_json(event["shard"])
        rec.shards[shard.rank] = shard
        if len(rec.shards) == rec.world_size:
            self.layout(rec)
            rec.state = StepState.READY

    def layout(self, rec: StepRec) -> None:
        """Compute each host's blob and each group's stripes from the step's shards."""
        per_slot: dict[int, list[tuple[int, int]]] = {s: [] for s in range(self.slots)}
        for shard in rec.shards.values():
            per_slot[shard.slot].append((shard.rank, shard.nbytes))
        rec.blobs = {s: HostBlob(tuple(sorted(v)), self.chunk_bytes) for s, v in per_slot.items()}
        for g in self.groups:
            rec.layouts[g.index] = StripeLayout(g, [len(rec.blobs[s].chunks) for s in g.slots])

    def evictions(self) -> list[int]:
        """Protected steps beyond ``keep``, oldest first: never the newest protected one.

        Applied in the same transition that protects a newer step, so readers never see more
        than ``keep`` protected steps and never fewer than one once any step is protected.
        """
        p = self.protected()
        return p[: max(0, len(p) - self.keep)]
