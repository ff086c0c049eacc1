"""Parts of ``ecsnap bench train`` (the run itself is too big for CI: ``ecsnap bench train
--quick``): what idle daemons cost, and training ranks that never outlive their run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.harness import Cluster
from bench.train import WORLD, daemons_cpu


def test_the_idle_daemons_cpu_is_read_from_every_host_and_grows(shm_root: Path) -> None:
    cluster = Cluster(shm_root, hosts=WORLD, k=3, m=1, job="train")
    try:
        first = daemons_cpu(cluster)
        time.sleep(1.0)  # idle rounds, every host's
        second = daemons_cpu(cluster)
        # every daemon has run its start-up and rounds: CPU time, counted once per host
        assert 0 < first < second
    finally:
        assert cluster.stop(60) == 0


def _running(module: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in cmd:
                pids.append(int(entry.name))
    return pids


def test_a_failed_rank_fails_the_run_and_leaves_no_rank_running() -> None:
    from bench.harness import gloo_ranks

    module = "tests.bench._gloo_worker"
    assert gloo_ranks(module, {}, 1, "one rank", timeout=60)[0]["rank"] == 0
    with pytest.raises(RuntimeError, match=r"a training rank failed \(3\) in three ranks"):
        gloo_ranks(module, {}, 3, "three ranks", timeout=60)
    assert _running(module) == []  # rank 2, a minute from its end, was killed
