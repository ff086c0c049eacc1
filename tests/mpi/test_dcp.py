"""torch.distributed.checkpoint through ecsnap: gloo process groups of 2 and 4 CPU processes,
DTensor state dicts, dcp.save / dcp.async_save / dcp.load, loading with another number of ranks
and another sharding (DCP's planner reshards), and after a host is lost."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.harness import Cluster, free_port

from ._trainer import trainers


def test_dcp_save_async_save_and_resharded_load(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=3, m=1)
    try:
        saved = trainers(c, "dcp_save", world=2, per_host=1, params={"port": free_port()})
        assert all(r["steps"] == [1, 2] and r["staged_at_return"] for r in saved), saved
        # 4 ranks read what 2 wrote, cut the other way; 2 ranks read it back as written
        for world, per_host, layout in ((4, 1, "cols"), (2, 2, "rows")):
            res = trainers(
                c,
                "dcp_load",
                world=world,
                per_host=per_host,
                params={"port": free_port(), "steps": [1, 2], "layout": layout},
            )
            assert all(r["wrong"] == {} for r in res), res
        # the host that held rank 1's shard is lost: DCP still loads every byte
        c.kill()
        shutil.rmtree(shm_root / c.job / "host1")
        c = Cluster(shm_root, hosts=4, k=3, m=1, job=c.job)
        res = trainers(
            c,
            "dcp_load",
            world=4,
            per_host=1,
            params={"port": free_port(), "steps": [2], "layout": "rows", "explicit": False},
        )
        assert all(r["wrong"] == {} for r in res), res
    finally:
        assert c.stop() == 0


def test_fsdp2_model_and_optimizer_resharded_2_to_4(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=2, m=2)
    try:
        saved = trainers(
            c, "fsdp_save", world=2, per_host=1, params={"port": free_port(), "step": 5}
        )
        expect = saved[0]["expect"]
        assert any(k.startswith("optim.state") for k in expect)  # AdamW moments saved too
        res = trainers(
            c, "fsdp_load", world=4, per_host=1, params={"port": free_port(), "expect": expect}
        )
        assert all(r["wrong"] == [] and r["compared"] == len(expect) for r in res), res
    finally:
        assert c.stop() == 0


def test_checkpoint_ids_overwrite_and_faults_on_one_rank(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=["--keep", "8"])
    try:
        res = trainers(c, "dcp_ids", world=2, per_host=1, params={"port": free_port()})
        for r in res:
            assert r["wrong"] == {} and r["newest"] == [], r
            assert r["steps"] == [10, 20, 30], r
            assert "already saved" in r["overwrite"] and r["after_overwrite"] == [], r
            assert "step-120" in r["bad_id"] and "latest" in r["bad_id"], r
            assert r["valid"] == [True, False, False]
        [one] = trainers(c, "dcp_no_dist", world=1, per_host=1, params={})
        assert one["same"] and 55 in one["steps"], one
        res = trainers(c, "dcp_faulty", world=2, per_host=1, params={"port": free_port()})
        for r in res:
            assert all(r["raised"].values()), r  # every injected fault reached every rank
            assert all(r["named"].values()), r  # and the rank it struck names it
            assert not any(r["protected"].values()), r  # and left no protected step
            assert r["wrong"] == {} and r["after"] == [], r
            assert r["steps"][-1] == 109 and not set(range(102, 107)) & set(r["steps"]), r
    finally:
        assert c.stop() == 0


def test_sharded_tensor_specs_and_dtensor_placements_reshard(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=["--keep", "3"])
    try:
        for scenario in ("dcp_sharded", "dcp_dtensor"):
            res = trainers(c, scenario, world=4, per_host=1, params={"port": free_port()})
            assert all(r["wrong"] == [] for r in res), (scenario, res)
    finally:
        assert c.stop() == 0
