"""The exchange's plan of a layout: every host's sends meet a receive, in the order MPI matches."""

from __future__ import annotations

import pytest

from storage.config import CHUNK_BYTES, ServeConfig
from storage.exchange import COPY, ENCODE, PARITY, Plan, half_window
from storage.placement import Group, HostBlob, StripeLayout

CB = 1000


def _blobs(sizes: list[int]) -> list[HostBlob]:
    return [HostBlob(((p, n),), CB) for p, n in enumerate(sizes)]


@pytest.mark.parametrize(
    ("k", "m", "sizes", "window"),
    [
        (3, 1, [12_000, 12_000, 12_000, 12_000], 4),
        (3, 1, [7_500, 3_000, 9_999, 0], 3),  # uneven shards: pads, a host without data
        (2, 2, [10_000, 8_000, 10_000, 10_000], 5),
        (1, 2, [4_000, 5_500, 3_000], 2),  # copies
        (1, 1, [3_000, 3_000], 64),
    ],
)
def test_every_send_meets_its_receive_in_order(
    k: int, m: int, sizes: list[int], window: int
) -> None:
    n = k + m
    group = Group(0, tuple(range(10, 10 + n)), k, m)  # slots are not positions
    blobs = _blobs(sizes)
    layout = StripeLayout(group, [len(b.chunks) for b in blobs])
    plans = [Plan(layout, p, blobs, window) for p in range(n)]
    assert all(len(pl.windows) == -(-layout.stripes // window) for pl in plans)
    # Per window, in posting order: what each host sends each peer (data, then parity once
    # encoded) and what each host expects from each peer.
    for wi in range(len(plans[0].windows)):
        sent: dict[tuple[int, int, str], list[tuple[int, int | None]]] = {}
        expected: dict[tuple[int, int, str], list[tuple[int, int | None]]] = {}
        for p, plan in enumerate(plans):
            for w in plan.windows[wi]:
                assert w0_of(w.s, window) == wi * window
                for c, to in w.sends:
                    sent.setdefault((p, to, "data"), []).append((w.s, c))
                if w.role in (ENCODE, COPY):
                    assert w.pslot == layout.parity_slot(p, w.s)
                    got = w.receives if w.role == ENCODE else w.receives[:1]
                    for j, frm, slot, c, length in got:
                        assert frm == layout.data_position(w.s, j)
                        assert (slot, c) == (group.slots[frm], layout.data_chunk(w.s, j))
                        assert length == (0 if c is None else blobs[frm].chunks[c].length)
                        if length:
                            expected.setdefault((frm, p, "data"), []).append((w.s, c))
                if w.role == ENCODE:
                    assert layout.encoder_position(w.s) == p
                    assert w.e == layout.encoder(w.s)
                    for i, to in w.forward:
                        sent.setdefault((p, to, "parity"), []).append((w.s, i))
                if w.role == PARITY:
                    assert p in layout.parity_positions(w.s) and w.source != p
                    i = layout.parity_positions(w.s).index(p)
                    expected.setdefault((w.source, p, "parity"), []).append((w.s, i))
                if w.role == COPY:
                    assert w.report == (layout.parity_positions(w.s)[0] == p)
        assert sent == expected


def test_each_stripe_has_one_encoder_and_every_chunk_travels() -> None:
    group = Group(0, (0, 1, 2, 3), 3, 1)
    blobs = _blobs([9_500, 9_000, 12_000, 4_000])
    layout = StripeLayout(group, [len(b.chunks) for b in blobs])
    plans = [Plan(layout, p, blobs, 8) for p in range(4)]
    assert sum(pl.encodes for pl in plans) == layout.stripes
    for p, plan in enumerate(plans):
        chunks = sorted(c for ws in plan.windows for w in ws for c, _ in w.sends)
        assert chunks == list(range(len(blobs[p].chunks)))  # each sent once, to its encoder


def test_a_plan_is_made_once_per_layout() -> None:
    group = Group(0, (0, 1, 2, 3), 3, 1)
    blobs = _blobs([9_000] * 4)
    a = Plan.of(StripeLayout(group, [9] * 4), 1, blobs, 8)
    assert Plan.of(StripeLayout(group, [9] * 4), 1, _blobs([9_000] * 4), 8) is a
    assert Plan.of(StripeLayout(group, [9] * 4), 2, blobs, 8) is not a
    assert Plan.of(StripeLayout(group, [9] * 4), 1, blobs, 4) is not a
    other = _blobs([9_000, 9_000, 9_000, 8_500])  # same chunk counts, a shorter last chunk

    def receives(blobs: list[HostBlob]) -> list[tuple[int, int, int, int | None, int]]:
        plans = [Plan.of(StripeLayout(group, [9] * 4), p, blobs, 8) for p in range(4)]
        return [got for pl in plans for ws in pl.windows for w in ws for got in w.receives]

    assert Plan.of(StripeLayout(group, [9] * 4), 1, other, 8) is not a
    assert (0, 3, 3, 8, 500) in receives(other) and (0, 3, 3, 8, 500) not in receives(blobs)


def w0_of(s: int, window: int) -> int:
    return s - s % window


@pytest.mark.parametrize(("k", "m"), [(3, 1), (2, 2), (1, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("chunk_bytes", [CHUNK_BYTES, 1 << 20, 64 << 20])
def test_over_a_network_every_host_encodes_in_every_window(
    k: int, m: int, chunk_bytes: int
) -> None:
    # a window's data all go to its encoders: one that leaves a host out idles that host's
    # incoming link (4 MiB chunks made a half window one stripe of RS(3,1))
    n = k + m
    rows = ServeConfig(job="t").exchange_rows
    window = half_window(rows, k, n, chunk_bytes, network=True)
    group = Group(0, tuple(range(n)), k, m)
    blobs = _blobs([8 * window * k * CB] * n)  # 8 n windows, every host with data
    layout = StripeLayout(group, [len(b.chunks) for b in blobs])
    plans = [Plan(layout, p, blobs, window) for p in range(n)]
    assert len(plans[0].windows) == 8 * n
    for wi in range(len(plans[0].windows)):
        encoders = {
            p
            for p, plan in enumerate(plans)
            if any(w.role in (ENCODE, COPY) for w in plan.windows[wi])
        }
        assert encoders == set(range(n)), (wi, window)


def test_between_virtual_hosts_the_window_is_what_its_rows_hold() -> None:
    # no links to keep busy there, and smaller rows stay in the caches
    assert half_window(12 << 20, 3, 4, 4 << 20, network=False) == 1
    assert half_window(12 << 20, 3, 4, 4 << 20, network=True) == 4
    assert half_window(12 << 20, 3, 4, 1 << 20, network=False) == 4
    assert half_window(12 << 20, 2, 4, 1 << 20, network=True) == 6
