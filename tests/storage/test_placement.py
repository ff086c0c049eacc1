from __future__ import annotations

import itertools

import pytest

from storage.errors import ConfigError
from storage.placement import Group, HostBlob, StripeLayout, default_km, make_groups


@pytest.mark.parametrize("hosts", range(2, 40))
def test_default_km_always_forms_groups(hosts: int) -> None:
    k, m = default_km(hosts)
    groups = make_groups(hosts, k, m, shrink=True)
    assert sorted(s for g in groups for s in g.slots) == list(range(hosts))
    assert all(g.k >= 1 and g.m == m for g in groups)


def test_bad_groups_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="last group of 1"):
        make_groups(5, 3, 1)
    with pytest.raises(ConfigError):
        default_km(1)
    with pytest.raises(ConfigError):
        make_groups(4, 0, 1)
    assert issubclass(ConfigError, ValueError)
    # a smaller last group shrinks its k, only when asked to: else the error says what works
    assert [(g.k, g.m) for g in make_groups(7, 3, 1, shrink=True)] == [(3, 1), (2, 1)]
    with pytest.raises(ConfigError) as info:
        make_groups(4, 3, 2)
    message = str(info.value)
    assert "RS(2,2)" in message and "Run 5 hosts" in message and "--shrink-last-group" in message
    assert "--k 2 --m 2" in message
    assert [(g.k, g.m) for g in make_groups(4, 3, 2, shrink=True)] == [(2, 2)]


SHAPES = [(n, m) for n in range(2, 9) for m in range(1, n)]


@pytest.mark.parametrize(("n", "m"), SHAPES)
def test_stripes_are_valid_and_balanced(n: int, m: int) -> None:
    k = n - m
    g = Group(0, tuple(range(n)), k, m)
    for counts in ([300] * n, [300 - i for i in range(n)], [0] * (n - 1) + [50], [1] * n):
        lay = StripeLayout(g, counts)
        used = [0] * n
        for s in range(lay.stripes):
            parity = lay.parity_positions(s)
            data = [lay.data_position(s, j) for j in range(k)]
            assert len(set(parity + data)) == n  # k data + m parity on n distinct hosts
            for j in range(k):
                c = lay.data_chunk(s, j)
                if c is not None:
                    assert c == used[data[j]]  # each host's chunks go out in order, once
                    used[data[j]] += 1
        assert used == counts
        if counts == [300] * n:
            # every host holds m/k of its blob in parity, up to the rounding of one rotation
            for p in range(n):
                assert abs(len(lay.parity_stripes[p]) - 300 * m / k) <= n


@pytest.mark.parametrize(("n", "m"), [(4, 1), (4, 2), (10, 2), (12, 4)])
def test_network_bytes_per_host(n: int, m: int) -> None:
    """Each host sends its chunks once plus m-1 parity per stripe it encodes: (1+(m-1)/k)x."""
    k = n - m
    C = 1200
    lay = StripeLayout(Group(0, tuple(range(n)), k, m), [C] * n)
    for p in range(n):
        encodes = sum(1 for s in range(lay.stripes) if lay.encoder_position(s) == p)
        sent = C + (m - 1) * encodes
        assert sent <= (1 + (m - 1) / k) * C * 1.01 + n * m


@pytest.mark.parametrize(("n", "m"), [(4, 1), (4, 2), (5, 2), (6, 3), (8, 3), (10, 2), (12, 4)])
def test_every_host_sends_the_same_to_each_peer(n: int, m: int) -> None:
    """Data chunks to their stripe's encoder, parity from it to the other parity holders: with
    the parity holders taking turns at encoding, no pair of hosts carries more than another
    (with the first one always encoding, RS(2,2) on 4 hosts sent 1200 chunks to one peer and
    none to another)."""
    k = n - m
    lay = StripeLayout(Group(0, tuple(range(n)), k, m), [1200] * n)
    flow = [[0] * n for _ in range(n)]
    for s in range(lay.stripes):
        parity = lay.parity_positions(s)
        e = lay.encoder(s)
        for j in range(k):
            if lay.data_chunk(s, j) is not None:
                flow[lay.data_position(s, j)][parity[e]] += 1
        for i in range(m):
            if i != e:
                flow[parity[e]][parity[i]] += 1
    pairs = [flow[a][b] for a in range(n) for b in range(n) if a != b]
    assert max(pairs) - min(pairs) <= 4, flow


def test_host_blob_chunks() -> None:
    blob = HostBlob(((3, 10), (1, 2500)), 1000)
    refs = [(c.rank, c.offset, c.length) for c in blob.chunks]
    assert refs == [(1, 0, 1000), (1, 1000, 1000), (1, 2000, 500), (3, 0, 10)]
    assert blob.nbytes == 2510


def test_layout_is_a_pure_function() -> None:
    g = Group(0, (0, 1, 2, 3), 2, 2)
    a, b = StripeLayout(g, [7, 5, 9, 0]), StripeLayout(g, [7, 5, 9, 0])
    assert a.stripes == b.stripes
    assert all(
        a.data_chunk(s, j) == b.data_chunk(s, j)
        for s, j in itertools.product(range(a.stripes), range(2))
    )


@pytest.mark.parametrize(
    ("blob", "largest", "want"),
    [
        (0, 1 << 20, 4096),  # nothing: the floor
        (63_000, 1 << 20, 4096),  # a small shard: the floor, not 1 MiB
        (500_000, 1 << 20, 16384),
        (2_000_000, 1 << 20, 65536),  # about 1/32 of the blob, in pages
        (375_000_000, 1 << 20, 1 << 20),  # a big blob keeps --chunk-bytes
        (630_000, 8192, 8192),  # never above --chunk-bytes
    ],
)
def test_chunk_size_follows_the_blob(blob: int, largest: int, want: int) -> None:
    from storage.placement import chunk_size

    assert chunk_size(blob, largest) == want


def test_small_blobs_hold_parity_near_m_over_k() -> None:
    """Four 64 kB blobs on RS(3,1) held 2 MiB of parity with 1 MiB chunks (8x the data, where
    m/k is 0.33x); cut by chunk_size, parity stays within 6 % of m/k, and within 4 % from 1 MB."""
    from storage.placement import chunk_size

    g = Group(0, (0, 1, 2, 3), 3, 1)

    def over_m_k(blob: int, cb: int) -> float:
        lay = StripeLayout(g, [-(-blob // cb)] * 4)
        return lay.stripes * g.m * cb / (4 * blob) / (g.m / g.k)

    assert over_m_k(64_000, 1 << 20) > 20
    assert over_m_k(64_000, chunk_size(64_000, 1 << 20)) <= 1.06
    for blob in (1_000_000, 1_300_000, 10_000_000, 375_000_000):
        assert over_m_k(blob, chunk_size(blob, 1 << 20)) <= 1.04, blob
