"""The part of ``ecsnap bench train`` that reports what idle daemons cost (the run itself is
too big for CI: ``ecsnap bench train --quick``)."""

from __future__ import annotations

import time
from pathlib import Path

from bench.harness import Cluster
from bench.train import WORLD, daemons_cpu


def test_the_idle_daemons_cpu_is_read_from_every_host_and_grows(shm_root: Path) -> None:
    cluster = Cluster(shm_root, hosts=WORLD, k=3, m=1, job="train")
    try:
        first = daemons_cpu("train", shm_root)
        time.sleep(1.0)  # idle rounds, every host's
        second = daemons_cpu("train", shm_root)
        # every daemon has run its start-up and rounds: CPU time, counted once per host
        assert 0 < first < second
    finally:
        assert cluster.stop(60) == 0
