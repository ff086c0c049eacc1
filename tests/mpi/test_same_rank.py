"""A put belongs to the connection that allocated it (#55, finding 7): another process that
gives the same rank (two trainers with one RANK, a stale one) can neither stage into its buffer
nor give it up, and a put refused before it allocated sends no abort that could free another's.
Real daemons, two groups (8 virtual hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

import storage
from bench.harness import Cluster, close_all


def test_only_the_allocating_connection_stages_or_aborts_a_put(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1)
    a, b = (
        storage.connect(c.job, rank=0, world_size=8, host="host0", root=shm_root, timeout=20)
        for _ in range(2)
    )
    try:
        req = {"op": "alloc", "step": 1, "rank": 0, "world_size": 8, "nbytes": 4096}
        alloc = a._request(dict(req))
        staged = {
            "op": "staged",
            "step": 1,
            "rank": 0,
            "world_size": 8,
            "buffer": alloc["buffer"],
            "nbytes": 4096,
            "table": [0, 16],
        }
        with pytest.raises(storage.StorageError, match="allocated by another connection"):
            b._request(dict(staged))
        b._request({"op": "abort", "step": 1, "rank": 0})  # not b's: nothing happens
        with pytest.raises(storage.StepExistsError, match="already putting step 1"):
            a._request(dict(req))  # a's put is still allocated, its buffer not freed
        assert Path(alloc["path"]).exists()
        with pytest.raises(storage.StepExistsError):
            b.put(1, {"x": 1}).staged.result(20)  # refused: its abort must not free a's put
        with pytest.raises(storage.StepExistsError, match="already putting step 1"):
            a._request(dict(req))
        a._request({"op": "abort", "step": 1, "rank": 0})  # a's own: freed
        assert a._request(dict(req))["buffer"]
        a._request({"op": "abort", "step": 1, "rank": 0})
    finally:
        close_all([a, b])
        assert c.stop() == 0


def test_a_pinned_step_is_read_only_through_a_step_that_refers_to_it(shm_root: Path) -> None:
    """#55, finding 11: ``base_of`` serves a shard of a step gone for readers (pinned) only to a
    reader of a step whose shard of that rank refers to it."""
    import torch

    c = Cluster(shm_root, hosts=8, k=3, m=1, extra=["--keep", "1"])
    stores = c.stores(8)
    frozen = torch.randn(50_000, generator=torch.Generator().manual_seed(5))

    def state(rank: int, step: int) -> dict[str, torch.Tensor]:
        out = {"w": torch.full((1000,), float(step * 10 + rank))}
        if rank == 0:
            out["frozen"] = frozen  # rank 0's later puts refer to step 1; rank 1's do not
        return out

    try:
        for step in (1, 2):
            for h in [s.put(step, state(r, step)) for r, s in enumerate(stores)]:
                assert h.wait(30) == step
        assert stores[0].info()["pinned"] == [1]
        assert torch.equal(stores[0].get(2)["frozen"], frozen)  # read through step 2's reference
        with pytest.raises(storage.StepNotFoundError, match="does not refer to step 1"):
            stores[1]._request({"op": "get", "step": 1, "rank": 1, "base_of": 2})
        with pytest.raises(storage.StepNotFoundError):
            stores[1].get(1)
        # from the other group (host4): fetched from host0, which checks the reference itself
        assert torch.equal(stores[4].get(2, rank=0)["frozen"], frozen)
        with pytest.raises(storage.StepNotFoundError, match="gone"):
            stores[4]._request({"op": "get", "step": 1, "rank": 1, "base_of": 2})
    finally:
        close_all(stores)
        assert c.stop() == 0
