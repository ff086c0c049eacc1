"""``ecsnap bench control`` at a size CI runs: the measurement itself, on real daemons."""

from __future__ import annotations

from pathlib import Path

from bench.control import measure
from storage.protocol import Ballot


def test_measure_counts_what_the_daemons_did(shm_root: Path) -> None:
    r = measure(shm_root, hosts=4, tensors=300, warmup=1, steps=2, interval=0.2)
    assert r["hosts"] == 4 and r["steps"] == 2
    # every round brings at least the ballot's reductions; a put brings a few more
    assert r["rounds_per_step"] >= 3
    assert r["gathered_bytes_per_round"] >= Ballot().nbytes
    assert 0 < r["cpu_s_per_step"] <= r["cpu_s_per_step_max"]
    assert 0 < r["staged_to_protected_s"] < 60
    # each host's manifest plus its rank's tensor table (300 tensors: some kB)
    assert 2_000 < r["metadata_bytes_per_step"] < 200_000
