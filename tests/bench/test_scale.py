from __future__ import annotations

import random

import pytest

from bench.scale import lost_by_burst, p_loss_burst, p_loss_independent, schemes


@pytest.mark.parametrize("scheme", schemes(3, 1) + schemes(2, 2)[:1], ids=lambda s: s["name"])
def test_independent_loss_model_matches_monte_carlo(scheme: dict) -> None:
    hosts, q = 24, 0.08
    rng = random.Random(5)
    trials = 20000
    lost = sum(
        lost_by_burst(scheme, {h for h in range(hosts) if rng.random() < q}, hosts)
        for _ in range(trials)
    )
    assert abs(lost / trials - p_loss_independent(scheme, hosts, q)) < 0.015


def test_burst_rules() -> None:
    ec, rep2, _ = schemes(3, 1)
    assert not lost_by_burst(ec, {0, 4, 8}, 16)  # one host of each group: m=1 survives
    assert lost_by_burst(ec, {0, 1}, 16)  # two hosts of one group
    assert lost_by_burst(rep2, {15, 0}, 16)  # a host and its successor on the ring
    assert not lost_by_burst(rep2, {0, 2}, 16)
    assert p_loss_burst(ec, 64, 8, "rack", 200, random.Random(1)) == 1.0  # racks hold groups
    assert p_loss_burst(ec, 64, 8, "rack-spread", 50, random.Random(1)) == 0.0  # one per group


def test_log2_fit_and_the_control_model() -> None:
    from bench.scale import control_model, fit_log2

    a, b = fit_log2({4: 10.0, 16: 14.0, 64: 18.0})  # exactly 6 + 2 log2 N
    assert abs(a - 6) < 1e-9 and abs(b - 2) < 1e-9
    costs = [
        {
            "hosts": n,
            "cpu_s_per_step": 0.04 + 0.005 * (n.bit_length() - 1),
            "gathered_bytes_per_step": 50_000.0,
            "metadata_bytes_per_step": 420_000.0,
            "rounds_per_step": 30.0,
            "ballot_bytes": 1456,
        }
        for n in (4, 8, 16)
    ]
    [at4, far] = control_model(costs, [4, 16384])
    assert abs(at4["cpu_s_per_step"] - 0.05) < 1e-9
    assert abs(far["cpu_s_per_step"] - (0.04 + 0.005 * 14)) < 1e-9
    assert far["gathered_bytes_per_step"] == 50_000.0
    assert far["reduction_wire_bytes_per_step"] == 30 * 1456 * 14
    # the control plane before grew linearly: 0.59 s at 4 hosts, 1.43 s at 12
    assert abs(far["before_cpu_s_per_step"] - (0.59 + 0.105 * (16384 - 4))) < 1e-6
