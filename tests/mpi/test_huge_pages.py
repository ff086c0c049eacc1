"""Shared memory on a tmpfs with huge pages: real daemons and trainers whose files live there.

The README tells users to put ``--root`` on a tmpfs mounted ``huge=within_size``; these check
that the daemons run there as anywhere, that their ready line says which memory they have, and
that the shards are in fact mapped in 2 MiB pages (smaps), which /dev/shm here does not give.
"""

from __future__ import annotations

from pathlib import Path

from bench.harness import Cluster, assert_same, close_all, make_state
from tests._memory import mapped_kib
from transport import shm

HOSTS = 4
NBYTES = 6 << 20  # per rank: more than one 2 MiB page each


def _round_trip(root: Path) -> tuple[int, str]:
    """Two puts and gets under ``root``; the ShmemPmdMapped KiB of this process's mappings
    there (the trainers' shards) while they are mapped, and the daemons' log."""
    root.mkdir(mode=0o700, exist_ok=True)
    cluster = Cluster(root, hosts=HOSTS, k=3, m=1)
    try:
        stores = cluster.stores(HOSTS)
        try:
            for step in (1, 2):
                handles = [
                    s.put(step, make_state(r, step, nbytes=NBYTES)) for r, s in enumerate(stores)
                ]
                for h in handles:
                    assert h.wait(60) == step
            for r, s in enumerate(stores):
                assert_same(s.get(2), make_state(r, 2, nbytes=NBYTES))
                assert_same(s.get(1), make_state(r, 1, nbytes=NBYTES))
            assert mapped_kib(root, "Rss") >= HOSTS * NBYTES // 1024
            pmd = mapped_kib(root, "ShmemPmdMapped")
        finally:
            close_all(stores)
    finally:
        assert cluster.stop() == 0
    return pmd, cluster.log.read_text()


def test_shards_on_a_tmpfs_with_huge_pages_are_mapped_in_them(
    huge_root: Path, shm_root: Path
) -> None:
    pmd, log = _round_trip(huge_root / "ecsnap")
    assert pmd >= HOSTS * (NBYTES >> 21) * 2048, pmd  # each shard's whole 2 MiB pages
    assert log.count("shared memory on a tmpfs with huge=within_size") == HOSTS, log
    if shm.huge_pages(shm_root) == "never":  # this machine's /dev/shm: none of that
        pmd, log = _round_trip(shm_root)
        assert pmd == 0
        assert log.count("shared memory on a tmpfs without huge pages") == HOSTS, log
