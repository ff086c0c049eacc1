"""A second launch of a live job (a duplicated launch line, a relaunch that fires early) is
refused before it touches anything: every file of the live job stays, and the live job goes on.
Two groups (8 virtual hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.harness import Cluster, close_all


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"w": torch.randint(0, 255, (50_000,), dtype=torch.uint8, generator=g)}


def _files(job_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of the job's host directories: path -> (inode, size)."""
    out = {}
    for p in sorted(job_dir.rglob("*")):
        if p.is_file() and not p.name.endswith(".log"):
            st = p.stat()
            out[str(p.relative_to(job_dir))] = (st.st_ino, st.st_size)
    return out


def test_a_second_launch_of_a_live_job_is_refused_and_changes_nothing(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1)
    stores = c.stores(8)
    try:
        for step in (1, 2):
            for h in [s.put(step, _state(r, step)) for r, s in enumerate(stores)]:
                assert h.wait(60) == step
        # the warmers have made the next puts' files; let them settle, then take stock
        before = _files(shm_root / c.job)
        assert any("/data/" in p for p in before) and any("/steps/" in p for p in before)
        with pytest.raises(RuntimeError) as launch:
            Cluster(shm_root, hosts=8, k=3, m=1, job=c.job, log=shm_root / "second.log")
        log = (shm_root / "second.log").read_text()
        assert "is served by a live daemon" in log and "stop the running one first" in log, log
        assert "Traceback" not in log, log
        del launch
        after = _files(shm_root / c.job)
        lost = sorted(p for p in before if p not in after)
        assert not lost, f"the second launch removed the live job's files: {lost}"
        assert c.alive
        for h in [s.put(3, _state(r, 3)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 3
        for r, s in enumerate(stores):
            for step in (2, 3):
                assert torch.equal(s.get(step)["w"], _state(r, step)["w"])
    finally:
        close_all(stores)
        assert c.stop() == 0
