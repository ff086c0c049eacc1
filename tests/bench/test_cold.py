"""The part of ``ecsnap bench cold`` that explains its puts: what a fresh page costs."""

from __future__ import annotations

from pathlib import Path

from bench.cold import fresh_page_cost


def test_fresh_page_cost_is_measured_and_leaves_nothing(tmp_path: Path) -> None:
    cost = fresh_page_cost(tmp_path, nbytes=8 << 20)
    # faulting 8 MiB in takes CPU time (2048 page faults), far less than a second per MiB
    assert 0 < cost < 1000
    assert list(tmp_path.iterdir()) == []
