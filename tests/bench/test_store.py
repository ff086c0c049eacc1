"""The parts of the benchmarks that decide what is compared (the run itself is too big
for CI: ``ecsnap bench store --quick``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench._ranks import run_fresh
from bench.harness import make_state, same


def test_equal_is_bit_exact() -> None:
    state = make_state(1, 0, nbytes=64 << 10, tensors=4)
    copy = {k: v.clone() for k, v in state.items()}
    assert same(copy, state)
    flipped = {k: v.clone() for k, v in state.items()}
    bf16 = next(k for k, v in flipped.items() if v.dtype == torch.bfloat16)
    flipped[bf16].view(torch.uint8).view(-1)[7] ^= 1  # one bit, in a bf16 tensor
    assert not same(flipped, state)
    assert not same({k: v for k, v in copy.items() if k != bf16}, state)


def test_fresh_processes_time_loads_and_report_failures(tmp_path: Path) -> None:
    state = make_state(2, 0, nbytes=256 << 10, tensors=4)
    path = tmp_path / "state.pt"
    torch.save(state, path)
    results = run_fresh([{"op": "load", "path": str(path)}] * 2)
    assert len(results) == 2 and all(r["load"] > 0 for r in results)
    path.unlink()  # a process that cannot load fails the run; it is never timed as a zero
    with pytest.raises(RuntimeError, match="exited"):
        run_fresh([{"op": "load", "path": str(path)}])


def test_a_puts_cpu_sums_the_hosts_and_counts_the_trainers_once() -> None:
    from bench._common import put_cpu

    before = [{"cpu": {"encode": 1.0, "stage": 0.5}}, {"cpu": {"encode": 2.0, "stage": 0.0}}]
    after = [{"cpu": {"encode": 1.5, "stage": 0.75}}, {"cpu": {"encode": 2.25, "stage": 0.125}}]
    puts = [{"cpu": 0.5}, {"cpu": 0.25}]  # each trainer process's whole time, its copies too
    out = put_cpu(before, after, puts)
    assert out["encode"] == 0.75 and out["stage"] == 0.375
    assert out["trainer"] == 0.375  # 0.75 less the copies the daemons were told of
    assert out["total"] == 0.75 + 0.375 + 0.375


def test_the_floors_parts_are_measured() -> None:
    import numpy as np

    from bench import baselines, transfer_floor

    samples = transfer_floor.measure(8 << 20, repeats=2)  # the swap checks its bytes arrived
    assert len(samples) == 2 and all(s["cpu"] > 0 and s["wall"] > 0 for s in samples)
    data = np.ones(12 << 20, dtype=np.uint8)
    assert baselines.floor_encode_cpu(data, 3, 1, 1 << 20) > 0
