"""The idle round engine's naps: how long, and that daemons wake on the same tick."""

from __future__ import annotations

import pytest

from storage.rounds import IDLE_FIRST, IDLE_LONGEST, idle_nap, next_quiet


@pytest.mark.parametrize("quiet", [0, 1, 2, 5, 8, 16, 40])
def test_a_nap_ends_on_the_next_multiple_of_its_length(quiet: int) -> None:
    length = min(IDLE_FIRST * 2**quiet, IDLE_LONGEST)
    for now in (1_796_435_534.8508, 1000.0, 1000.0 + length / 3, 12.3456789):
        nap = idle_nap(quiet, now)
        assert 0 < nap <= length + 1e-12
        ticks = (now + nap) / length
        assert ticks == pytest.approx(round(ticks), abs=1e-6)


def test_naps_double_with_quiet_rounds_up_to_the_longest() -> None:
    now = 0.0  # on a tick of every length: a whole nap
    lengths = [idle_nap(q, now) for q in range(20)]
    assert lengths[0] == pytest.approx(IDLE_FIRST)
    assert lengths[1] == pytest.approx(2 * IDLE_FIRST)
    assert max(lengths) == pytest.approx(IDLE_LONGEST)
    assert lengths == sorted(lengths)
    assert lengths[-1] == pytest.approx(IDLE_LONGEST)


def test_daemons_that_end_a_round_apart_wake_together() -> None:
    """The same quiet count, rounds ended a few milliseconds apart on each host: one wake-up."""
    for quiet in (6, 10, 16):
        ends = [5000.0011, 5000.0032, 5000.0047, 5000.0090]
        wakes = {round(t + idle_nap(quiet, t), 9) for t in ends}
        assert len(wakes) == 1, (quiet, wakes)


def test_naps_grow_step_by_step_only_while_they_ramp() -> None:
    quiet = 0
    naps = []
    for _ in range(4):  # a put's staging: quiet rounds, a step in flight
        quiet = next_quiet(quiet, hot=False, ramp=True)
        naps.append(idle_nap(quiet, 0.0))
    assert naps == pytest.approx([2 * IDLE_FIRST, 4 * IDLE_FIRST, 8 * IDLE_FIRST, 16 * IDLE_FIRST])
    assert next_quiet(quiet, hot=True, ramp=True) == 0  # a rank's shard staged
    assert next_quiet(quiet, hot=True, ramp=False) == 0  # the step protected
    # the first quiet round after a put of every host's ranks: the longest nap at once, and stays
    quiet = next_quiet(0, hot=False, ramp=False)
    assert idle_nap(quiet, 0.0) == pytest.approx(IDLE_LONGEST)
    again = next_quiet(quiet, hot=False, ramp=False)
    assert idle_nap(again, 0.0) == pytest.approx(IDLE_LONGEST)
