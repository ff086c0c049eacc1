"""The catalog's state machine, driven by ballots and group events as the rounds drive it."""

from __future__ import annotations

import numpy as np
import pytest

from storage.catalog import Catalog
from storage.placement import make_groups
from storage.protocol import LANES, Ballot, ShardRecord, StepState


def catalog(slots: int = 2, keep: int = 2) -> Catalog:
    cat = Catalog(make_groups(slots, 1, slots - 1), slots, 4096, keep=keep)
    cat.group = cat.groups[0]
    cat.hosts = [f"host{s}" for s in range(slots)]
    return cat


def shard(rank: int, slot: int, nbytes: int = 10) -> ShardRecord:
    return ShardRecord(rank, slot, nbytes, f"b{rank}-{slot}", (0, 0))


def staged(cat: Catalog, step: int, ranks: list[int], world: int) -> Ballot:
    """The job's ballot of a round in which ``ranks`` were staged (rank r on slot r % slots)."""
    lane = cat.lane_of(step)
    assert lane is not None
    b = Ballot()
    for r in ranks:
        cat.staged(step, shard(r, r % cat.slots))
        b.add(lane, Ballot.STAGED, 1)
        b.add(lane, Ballot.RANK_SUM, r)
        b.add(lane, Ballot.RANK_SQ, r * r)
        b.add(lane, Ballot.DATA_BYTES, 10)
        b.raise_to(lane, Ballot.WORLD, world)
        b.raise_to(lane, Ballot.WORLD_NEG, -world)
    return b


def counts(cat: Catalog, step: int, field: int, n: int, extra: int = 0) -> Ballot:
    lane = cat.lane_of(step)
    assert lane is not None
    b = Ballot()
    b.add(lane, field, n)
    if field == Ballot.STORED:
        b.add(lane, Ballot.PARITY_BYTES, extra)
    return b


def protect(cat: Catalog, step: int, world: int = 2) -> None:
    assert cat.assign(step) is not None
    cat.count(staged(cat, step, list(range(world)), world))
    assert cat.steps[step].state == StepState.READY
    cat.count(counts(cat, step, Ballot.PREPARED, cat.slots))
    assert cat.steps[step].state == StepState.ENCODING
    cat.count(counts(cat, step, Ballot.STORED, cat.slots - 1))
    assert cat.latest() != step  # never visible before every daemon stored parity
    cat.count(counts(cat, step, Ballot.STORED, 1, extra=4096))
    assert cat.steps[step].state == StepState.PROTECTED


def test_lifecycle_and_retention() -> None:
    cat = catalog()
    assert cat.latest() is None
    protect(cat, 1)
    protect(cat, 2)
    assert cat.protected() == [1, 2] and cat.lanes == [None] * LANES
    cat.assign(3)
    cat.count(staged(cat, 3, [0], 2))
    assert cat.protected() == [1, 2] and cat.steps[3].state == StepState.STAGING
    cat.count(staged(cat, 3, [1], 2))
    cat.count(counts(cat, 3, Ballot.PREPARED, 2))
    cat.count(counts(cat, 3, Ballot.STORED, 1))
    assert cat.protected() == [1, 2]  # step 1 stays until step 3 is protected
    cat.count(counts(cat, 3, Ballot.STORED, 1))
    assert cat.protected() == [2, 3]
    rec = cat.steps[3]
    assert rec.world_size == 2 and rec.data_bytes == 20 and rec.lane is None
    assert sorted(rec.shards) == [0, 1] and len(rec.layouts) == 1


def test_failed_prepare_fails_the_step_only_and_names_the_host() -> None:
    cat = catalog()
    protect(cat, 1)
    cat.assign(2)
    cat.count(staged(cat, 2, [0, 1], 2))
    b = counts(cat, 2, Ballot.PREPARED, 1)
    lane = cat.lane_of(2)
    assert lane is not None
    b.add(lane, Ballot.PREP_FAILED, 1)
    b.raise_to(lane, Ballot.FAIL_SLOT_NEG, -1)
    cat.count(b)
    rec = cat.steps[2]
    assert rec.state == StepState.FAILED and rec.lane is None
    assert rec.error is not None and rec.error["error"] == "CapacityError"
    assert "host1" in rec.error["message"]
    cat.drop_failed(2)
    assert 2 not in cat.steps and cat.failed[2]["error"] == "CapacityError"
    assert cat.protected() == [1]


def test_world_size_mismatch_fails_step() -> None:
    cat = catalog()
    cat.assign(5)
    b = staged(cat, 5, [0], 2)
    b2 = staged(cat, 5, [1], 3)
    b.sums += b2.sums  # the reduction of two daemons' ballots
    b.maxima = np.maximum(b.maxima, b2.maxima)
    cat.count(b)
    error = cat.steps[5].error
    assert cat.steps[5].state == StepState.FAILED
    assert error is not None and error["error"] == "StorageError"
    assert "world_size" in error["message"]


def test_a_rank_counted_twice_fails_the_step() -> None:
    cat = catalog(slots=3)
    cat.assign(7)
    b = staged(cat, 7, [0, 0, 2], 3)  # rank 0 on two hosts, rank 1 nowhere: 3 shards, world 3
    cat.count(b)
    error = cat.steps[7].error
    assert cat.steps[7].state == StepState.FAILED
    assert error is not None and "two hosts" in error["message"]


def test_a_rank_putting_again_replaces_its_shard() -> None:
    cat = catalog()
    cat.assign(4)
    cat.staged(4, shard(0, 0))
    old = cat.staged(4, ShardRecord(0, 0, 10, "newer", (0, 0)))
    assert old is not None and old.buffer == "b0-0"
    assert cat.steps[4].shards[0].buffer == "newer"


def test_lanes_run_out_and_the_oldest_staging_step_is_named() -> None:
    cat = catalog()
    for step in range(LANES):
        assert cat.assign(100 + step) is not None
    assert cat.assign(999) is None
    assert cat.oldest_staging() == 100
    cat.fail(100, "abandoned")
    assert cat.steps[100].state == StepState.FAILED
    assert cat.assign(999) is not None


def test_delete_and_lose() -> None:
    cat = catalog()
    protect(cat, 1)
    protect(cat, 2)
    cat.delete(1)
    assert cat.protected() == [2]
    rec = cat.lose(2, ["host1"], [1])
    assert rec is not None and rec.state == StepState.LOST and cat.latest() is None
    assert cat.lose(2, ["host1"], [1]) is None  # once
    # a lost step's number may be put afresh
    assert cat.assign(2) is not None and cat.steps[2].state == StepState.STAGING


@pytest.mark.parametrize("world", [1, 2, 5, 64])
def test_rank_sums_accept_one_of_each(world: int) -> None:
    cat = catalog(slots=2)
    cat.assign(1)
    cat.count(staged(cat, 1, list(range(world)), world))
    assert cat.steps[1].state == StepState.READY


def test_a_referenced_step_is_pinned_then_freed() -> None:
    """Retention and deletes pin a step the group's records (or announced puts) refer to; it is
    freed once nothing does, and a step a pinned step refers to stays with it."""
    cat = catalog(keep=1)
    protect(cat, 1)
    protect(cat, 2)
    assert 1 not in cat.steps  # nothing refers to it: freed by retention
    cat.pin(3, 0, 2)  # rank 0 announces a put of step 3 that refers to step 2
    cat.pin(3, 1, 1)  # step 1 is gone: refused
    assert cat.pins == {(3, 0): 2} and cat.pin_refused == {(3, 1)}
    assert cat.assign(3) is not None
    lane = cat.lane_of(3)
    assert lane is not None
    b = Ballot()
    for r in (0, 1):
        cat.staged(3, ShardRecord(r, r, 10, f"c{r}", (0, 0), base=2 if r == 0 else -1))
        b.add(lane, Ballot.STAGED, 1)
        b.add(lane, Ballot.RANK_SUM, r)
        b.add(lane, Ballot.RANK_SQ, r * r)
        b.raise_to(lane, Ballot.WORLD, 2)
        b.raise_to(lane, Ballot.WORLD_NEG, -2)
    cat.count(b)
    assert cat.pins == {}  # the record took the pin's place
    cat.count(counts(cat, 3, Ballot.PREPARED, 2))
    cat.count(counts(cat, 3, Ballot.STORED, 2))
    # --keep 1: step 2 leaves the readers' view, but step 3 refers to it
    assert cat.protected() == [3] and cat.steps[2].state == StepState.PINNED
    assert cat.release_pins() == []
    cat.delete(2)  # a delete of a pinned step changes nothing
    assert cat.steps[2].state == StepState.PINNED
    # a delete of the referring step frees both (in the round's settling)
    cat.delete(3)
    assert 3 not in cat.steps
    assert cat.release_pins() == [2] and cat.steps == {}


def test_data_checksums_from_the_encoders_join_each_hosts_own_in_any_order() -> None:
    """An encoder reports the CRCs of the other hosts' data chunks it encoded; its Stored may
    come before or after theirs, and a host's own Stored (none of its own data CRCs, where the
    encoders take them) leaves what the encoders gave."""
    for first in (0, 1):
        cat = catalog(slots=3)
        assert cat.assign(1) is not None
        cat.count(staged(cat, 1, [0, 1, 2], 3))
        cat.count(counts(cat, 1, Ballot.PREPARED, 3))
        assert cat.steps[1].state == StepState.ENCODING
        events = [
            (2, "p2", {"data": [], "parity": [22]}, [[0, 1, 101], [1, 0, 110], [0, 0, 100]]),
            (0, "p0", {"data": [], "parity": [20]}, [[1, 1, 111]]),
        ]
        for slot, parity, crc, data_crc in events[first:] + events[:first]:
            cat.stored(slot, 1, parity, crc, data_crc)
        cat.stored(1, 1, None, {"data": [], "parity": []})
        stored = cat.steps[1].stored
        assert stored[0] == {"data": [100, 101], "parity": [20]}, first
        assert stored[1] == {"data": [110, 111], "parity": []}, first
        assert stored[2] == {"data": [], "parity": [22]}, first
        assert cat.steps[1].parity == {2: "p2", 0: "p0"}
    # a host that takes its own data CRCs (over a network) reports them itself
    cat = catalog(slots=2)
    assert cat.assign(1) is not None
    cat.count(staged(cat, 1, [0, 1], 2))
    cat.count(counts(cat, 1, Ballot.PREPARED, 2))
    cat.stored(0, 1, "p0", {"data": [7, 8], "parity": [9]})
    assert cat.steps[1].stored[0] == {"data": [7, 8], "parity": [9]}
