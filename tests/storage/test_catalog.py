from __future__ import annotations

from typing import Any

from storage.catalog import Catalog
from storage.placement import make_groups


def staged(step: int, rank: int, slot: int, world: int, nbytes: int = 10) -> dict[str, Any]:
    shard = {"rank": rank, "slot": slot, "nbytes": nbytes, "buffer": f"b{rank}", "meta": {}}
    return {"e": "staged", "step": step, "world_size": world, "shard": shard}


def protect(cat: Catalog, step: int, world: int = 2) -> None:
    for r in range(world):
        cat.apply(r, staged(step, r, r, world))
    assert cat.steps[step].state == "ready"
    for slot in range(cat.slots):
        cat.apply(slot, {"e": "prepared", "step": step, "error": None})
    assert cat.steps[step].state == "encoding"
    for slot in range(cat.slots):
        assert cat.latest() != step  # never visible before every daemon stored parity
        cat.apply(slot, {"e": "stored", "step": step, "crc": {}})


def test_lifecycle_and_retention() -> None:
    cat = Catalog(make_groups(2, 1, 1), 2, 4096, keep=2)
    assert cat.latest() is None
    protect(cat, 1)
    protect(cat, 2)
    assert cat.protected() == [1, 2]
    cat.apply(0, staged(3, 0, 0, 2))
    assert cat.protected() == [1, 2] and cat.steps[3].state == "staging"
    cat.apply(1, staged(3, 1, 1, 2))
    for slot in range(2):
        cat.apply(slot, {"e": "prepared", "step": 3, "error": None})
    cat.apply(0, {"e": "stored", "step": 3, "crc": {}})
    assert cat.protected() == [1, 2]  # step 1 stays until step 3 is protected
    cat.apply(1, {"e": "stored", "step": 3, "crc": {}})
    assert cat.protected() == [2, 3]


def test_failed_prepare_fails_the_step_only() -> None:
    cat = Catalog(make_groups(2, 1, 1), 2, 4096, keep=2)
    protect(cat, 1)
    cat.apply(0, staged(2, 0, 0, 2))
    cat.apply(1, staged(2, 1, 1, 2))
    cat.apply(0, {"e": "prepared", "step": 2, "error": None})
    cat.apply(1, {"e": "prepared", "step": 2, "error": "no memory"})
    assert cat.steps[2].state == "failed" and cat.steps[2].error == "no memory"
    assert cat.protected() == [1]


def test_world_size_mismatch_fails_step() -> None:
    cat = Catalog(make_groups(2, 1, 1), 2, 4096, keep=2)
    cat.apply(0, staged(5, 0, 0, 2))
    cat.apply(1, staged(5, 1, 1, 3))
    assert cat.steps[5].state == "failed"
    error = cat.steps[5].error
    assert error is not None and error["error"] == "StorageError"
    assert "world_size" in error["message"]


def test_same_log_same_catalog() -> None:
    """Two daemons applying one event log agree on everything."""
    log = []
    for step in (1, 2, 3):
        for r in range(4):
            log.append((r % 2, staged(step, r, r % 2, 4, 1000 * (r + 1))))
        log += [(s, {"e": "prepared", "step": step, "error": None}) for s in range(2)]
        log += [(s, {"e": "stored", "step": step, "crc": {}}) for s in range(2)]
    a = Catalog(make_groups(2, 1, 1), 2, 4096, keep=2)
    b = Catalog(make_groups(2, 1, 1), 2, 4096, keep=2)
    for slot, e in log:
        a.apply(slot, e)
        b.apply(slot, e)
    assert a.protected() == b.protected() == [2, 3]
    assert a.steps[3].layouts[0].stripes == b.steps[3].layouts[0].stripes
