"""Where every chunk of a step lives: groups, stripes, rotation. Pure functions of the layout.

Hosts (slots 0..H-1) are split into groups of k+m; the last group may be smaller, with its k
shrunk (it must still hold more than m hosts). In a group of n = k+m hosts, stripe s puts its
parity on the m hosts at positions ``(s + i) % n`` (parity index k+i, the first of them encodes)
and takes data index j from position ``(s + m + j) % n``: the parity rotates RAID-6 style, so each
host holds m/k of its blob in parity and sends about ``(1 + (m-1)/k)`` x its blob.

A host's blob is its shards in rank order, each cut into ``chunk_bytes`` chunks (a shard's last
chunk may be short: the rest is a virtual zero pad, never stored or sent). A host's c-th chunk
goes to the c-th stripe in which it is a data host; a host that runs out of chunks contributes
virtual zero chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from storage.errors import ConfigError

__all__ = [
    "MIN_CHUNK",
    "ChunkRef",
    "Group",
    "HostBlob",
    "StripeLayout",
    "chunk_size",
    "default_km",
    "make_groups",
]

# Per chunk there is a Python call, a checksum and a message: RS(3,1) encodes 4 KiB chunks at
# 2.2 GB/s through the binding against 7.5 at 16 KiB and 34 at 1 MiB (one thread, measured).
# Only blobs under 32 x 4 KiB are cut that fine, where the time is microseconds either way.
MIN_CHUNK = 4 << 10
TARGET_CHUNKS = 32  # chunks per blob: a stripe's padding costs about 1/32 of the parity


@dataclass(frozen=True)
class Group:
    index: int
    slots: tuple[int, ...]
    k: int
    m: int

    def position(self, slot: int) -> int:
        return self.slots.index(slot)


def default_km(hosts: int) -> tuple[int, int]:
    """A sensible (k, m) for ``hosts`` daemons: m=1 below 6 hosts, else 2; groups up to 10."""
    if hosts < 2:
        raise ConfigError(
            f"ecsnap needs at least 2 hosts to place parity on a peer, got {hosts}; start more "
            "daemons (one per host, or --virtual-hosts on one machine)"
        )
    m = 1 if hosts < 6 else 2
    for n in range(min(hosts, 10), m, -1):
        rest = hosts % n
        if rest == 0 or rest > m:
            return n - m, m
    return hosts - 1, 1


def make_groups(hosts: int, k: int, m: int, shrink: bool = False) -> list[Group]:
    """Split slots 0..hosts-1 into groups of k+m; raise :class:`ConfigError` if they cannot form.

    A last group of fewer than k+m hosts (its k shrunk, so more parity per byte than m/k) is
    formed only with ``shrink`` (``--shrink-last-group``, and the layout ``default_km`` picks);
    otherwise it is an error naming the smallest host count that gives RS(k, m) everywhere.
    """
    if k < 1 or m < 1:
        raise ConfigError(f"k and m must be >= 1, got k={k}, m={m}")
    if k + m > 255:
        raise ConfigError(f"k + m must be <= 255, got {k + m}")
    if hosts < k + m and hosts <= m:
        raise ConfigError(f"{hosts} hosts cannot hold RS({k},{m}): need more than m={m} hosts")
    n = k + m
    groups: list[Group] = []
    for start in range(0, hosts, n):
        slots = tuple(range(start, min(start + n, hosts)))
        if len(slots) <= m:
            raise ConfigError(
                f"{hosts} hosts in groups of k+m={n} leave a last group of {len(slots)} host(s), "
                f"which cannot hold m={m} parity chunks plus data; choose k and m so that "
                f"hosts % (k+m) is 0 or more than m (for example --k {hosts - m} --m {m})"
            )
        if len(slots) < n and not shrink:
            short = len(slots) - m
            fits = [f"--k {d - m} --m {m}" for d in range(m + 1, hosts + 1) if hosts % d == 0]
            raise ConfigError(
                f"RS({k},{m}) needs groups of k+m={n} hosts, and {hosts} hosts leave a last group "
                f"of {len(slots)}, which would run RS({short},{m}) (parity {m / short:.2f}x of its "
                f"data instead of {m / k:.2f}x). Run {-(-hosts // n) * n} hosts (a multiple of "
                f"{n}), choose k and m whose sum divides {hosts} ("
                + (", ".join(fits[-2:]) if fits else f"--k {hosts - m} --m {m}")
                + "), or pass --shrink-last-group to run it so"
            )
        groups.append(Group(len(groups), slots, len(slots) - m, m))
    return groups


def chunk_size(blob_bytes: int, largest: int) -> int:
    """The chunk size of a group's step: about 1/32 of its largest blob (page multiples, at least
    4 KiB), at most ``largest`` (``--chunk-bytes``). Parity is stored in whole chunks per
    stripe, so a chunk large against the blob holds far more parity than m/k of the data (a
    63 kB shard held 2 MB of parity with 1 MiB chunks); 32 chunks a blob keep it within a few
    percent of m/k while big blobs keep their big chunks."""
    want = -(-max(blob_bytes, 1) // TARGET_CHUNKS)
    want = -(-want // 4096) * 4096
    return min(largest, max(MIN_CHUNK, want))


@dataclass(frozen=True)
class ChunkRef:
    """One data chunk of a host's blob: ``length`` bytes at ``offset`` in ``rank``'s shard."""

    rank: int
    offset: int
    length: int


@dataclass(frozen=True)
class HostBlob:
    """A host's blob for one step: its shards (rank, nbytes) in rank order, cut into chunks."""

    shards: tuple[tuple[int, int], ...]
    chunk_bytes: int

    @cached_property
    def chunks(self) -> list[ChunkRef]:
        out = []
        for rank, nbytes in sorted(self.shards):
            for o in range(0, nbytes, self.chunk_bytes):
                out.append(ChunkRef(rank, o, min(self.chunk_bytes, nbytes - o)))
        return out

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.shards)


class StripeLayout:
    """The stripes of one group for one step, given each member's chunk count."""

    def __init__(self, group: Group, chunk_counts: Sequence[int]) -> None:
        if len(chunk_counts) != len(group.slots):
            raise ValueError("one chunk count per group member")
        self.group = group
        self.n = len(group.slots)
        self.k, self.m = group.k, group.m
        self.counts = list(chunk_counts)
        self.stripes = self._stripe_count()
        # per position: the stripes it feeds as data, and the stripes whose parity it holds
        self.data_stripes: list[list[int]] = [[] for _ in range(self.n)]
        self.parity_stripes: list[list[int]] = [[] for _ in range(self.n)]
        for s in range(self.stripes):
            for i in range(self.m):
                self.parity_stripes[(s + i) % self.n].append(s)
            for j in range(self.k):
                self.data_stripes[(s + self.m + j) % self.n].append(s)
        self._data_index = [{s: c for c, s in enumerate(x)} for x in self.data_stripes]
        self._parity_index = [{s: c for c, s in enumerate(x)} for x in self.parity_stripes]

    def _stripe_count(self) -> int:
        need = max(self.counts, default=0)
        if need == 0:
            return 0
        s = max(need, -(-need * self.n // self.k) - self.n)
        while True:
            ok = True
            for p in range(self.n):
                parity_here = (s // self.n) * self.m + sum(
                    1 for x in range(s - s % self.n, s) if (x - p) % self.n < self.m
                )
                if s - parity_here < self.counts[p]:
                    ok = False
                    break
            if ok:
                return s
            s += 1

    def parity_positions(self, s: int) -> list[int]:
        """Positions holding parity index k+i of stripe s (i = list index); see :meth:`encoder`."""
        return [(s + i) % self.n for i in range(self.m)]

    def encoder(self, s: int) -> int:
        """Which of stripe s's parity positions (an index into :meth:`parity_positions`) encodes
        it: the data chunks go there, and it sends the other parity chunks on.

        The parity holders take turns, one rotation of the group (n stripes) each, and every
        host sends the same to each peer. With the first parity position always encoding, the
        flows were uneven for m >= 2: in RS(2,2) on 4 hosts each host sent two thirds of its
        bytes to the next host (data and parity), a third to the one after, and nothing to its
        third peer; puts over 2 Gbit/s links took about 10 % longer (bench store --lab: 2.96-3.17
        s against 2.71-2.97 s taking turns, alternated runs)."""
        return (s // self.n) % self.m

    def encoder_position(self, s: int) -> int:
        """The position that encodes stripe s (see :meth:`encoder`)."""
        return self.parity_positions(s)[self.encoder(s)]

    def data_position(self, s: int, j: int) -> int:
        return (s + self.m + j) % self.n

    def data_chunk(self, s: int, j: int) -> int | None:
        """Which chunk of its blob the data host of (stripe s, index j) puts there; None = pad."""
        p = self.data_position(s, j)
        c = self._data_index[p][s]
        return c if c < self.counts[p] else None

    def parity_slot(self, p: int, s: int) -> int:
        """Index of stripe s's parity among the parity chunks position p holds."""
        return self._parity_index[p][s]
