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
