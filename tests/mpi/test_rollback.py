"""Rollback, the same in every group and tier (#55, findings 2 and 6). Real daemons on 8 virtual
hosts, two RS(3,1) groups, ``--keep 1``, incremental puts.

The rule: steps are write-once and go forward. A put of a number the job holds (readable, or
pinned as the base of newer steps in any group) or older than the newest protected step is
refused with StepExistsError on every rank alike; the job goes on. To roll back, delete the steps
after the one resumed from (``Store.rollback``): in memory and on disk; then their numbers can be
put again, and ``get()`` serves the new ones from memory and, after memory is lost, from disk."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

import storage
from bench.harness import Cluster, close_all, same
from tests.mpi.test_warm import _until

HOSTS = 8


def _state(rank: int, step: int, timeline: int = 0) -> dict[str, torch.Tensor]:
    """Ranks 0-3 (the first group) keep a frozen tensor, so their group pins the step it lives
    in; ranks 4-7 change everything every step. ``timeline`` tells a rolled-back run's steps
    from the abandoned ones."""
    g = torch.Generator().manual_seed(rank * 7919 + step * 31 + timeline * 100_003)
    out = {"w": torch.randn(20_000, generator=g)}
    if rank < 4:
        out["frozen"] = torch.randn(60_000, generator=torch.Generator().manual_seed(rank))
    return out


def _put_all(stores: list[Any], step: int, timeline: int = 0) -> None:
    for h in [s.put(step, _state(r, step, timeline)) for r, s in enumerate(stores)]:
        assert h.wait(30) == step


def _on_disk(job_dir: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in job_dir.glob("step-*/manifest.json"))


def _outcome(store: Any, rank: int, step: int) -> str:
    try:
        store.put(step, _state(rank, step, 9)).wait(30)
    except storage.StepExistsError as exc:
        return f"refused: {exc}"
    except storage.StorageTimeoutError as exc:
        return f"timeout: {exc}"
    return "protected"


def test_a_put_of_a_pinned_or_older_step_is_refused_on_every_rank_and_the_job_goes_on(
    shm_root: Path,
) -> None:
    c = Cluster(shm_root, hosts=HOSTS, k=3, m=1, extra=["--keep", "1"])
    stores = c.stores(HOSTS, timeout=20.0)
    try:
        _put_all(stores, 1)
        _put_all(stores, 2)
        # the first group holds step 1 pinned (step 2 refers to its frozen tensors), the second
        # group dropped it: the refusal must not depend on which group a rank's host is in
        pinned = [s.info()["pinned"] for s in stores]
        assert pinned[:4] == [[1]] * 4 and pinned[4:] == [[]] * 4, pinned
        outcomes = [_outcome(s, r, 1) for r, s in enumerate(stores)]
        assert all(o.startswith("refused") for o in outcomes), outcomes
        assert "pinned" in outcomes[0] and "older than step 2" in outcomes[4], outcomes
        t0 = time.monotonic()
        _put_all(stores, 3)  # the job goes on
        assert time.monotonic() - t0 < 20
        for r, s in enumerate(stores):
            assert same(s.get(3), _state(r, 3)) and s.steps() == [3]
        # delete, then put the number again: every group takes it, get() serves the new bytes
        assert stores[5].rollback(2) == [3]
        assert all(s.steps() == [] for s in stores)
        _put_all(stores, 3, timeline=1)
        for r, s in enumerate(stores):
            assert same(s.get(), _state(r, 3, 1)) and s.steps() == [3]
    finally:
        close_all(stores)
        assert c.stop() == 0


def test_a_rollback_reaches_the_disk_and_a_restore_serves_the_new_timeline(
    shm_root: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "persist"
    args = [
        "--keep",
        "1",
        "--persist-dir",
        str(disk),
        "--persist-every",
        "1",
        "--persist-keep",
        "3",
    ]
    c = Cluster(shm_root, hosts=HOSTS, k=3, m=1, extra=args)
    stores = c.stores(HOSTS, timeout=20.0)
    try:
        for step in (1, 2, 3):
            _put_all(stores, step)
        _until("steps 1-3 on disk", lambda: _on_disk(disk / c.job) == [1, 2, 3], 60)
        # resume from step 1: steps 2 and 3 go from memory and disk, then are put again
        assert stores[0].rollback(1) == [2, 3]
        assert _on_disk(disk / c.job) == [1]
        assert all(s.steps() == [1] for s in stores)
        _put_all(stores, 2, timeline=1)
        _until("the new step 2 on disk", lambda: _on_disk(disk / c.job) == [1, 2], 60)
    finally:
        close_all(stores)
        c.kill()
    # every host's memory lost: the relaunch puts the newest step on disk back, the new one
    for h in range(HOSTS):
        shutil.rmtree(shm_root / c.job / f"host{h}")
    c = c.relaunch()
    stores = c.stores(HOSTS, timeout=20.0)
    try:
        for r, s in enumerate(stores):
            assert same(s.get(), _state(r, 2, 1)), f"rank {r} got the abandoned step 2"
            assert same(s.get(1), _state(r, 1))
    finally:
        close_all(stores)
        assert c.stop() == 0
