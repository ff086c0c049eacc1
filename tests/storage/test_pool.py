"""The host's pool of shared-memory files: freed files are reused, except adopted shard buffers."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.errors import CapacityError
from storage.pool import Pool


@pytest.fixture
def host_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ecsnap-test-pool-") as d:
        root = Path(d)
        (root / "data").mkdir()
        (root / "parity").mkdir()
        yield root


def test_a_freed_buffer_is_reused_for_a_similar_size(host_dir: Path) -> None:
    pool = Pool(host_dir, budget=None)
    a = pool.take(1 << 20, "r0-")
    a.file.array[:4] = 9
    pool.release(a.name)
    b = pool.take((1 << 20) - 100, "r0-")
    assert b.name == a.name and b.file.array[0] == 9  # the same file, not a new one
    assert pool.take(1 << 20, "r1-").name != a.name  # another rank's prefix never shares


def test_an_adopted_shard_buffer_is_deleted_when_freed_never_reused(host_dir: Path) -> None:
    """A trainer may still map it under a lease the earlier daemon granted."""
    first = Pool(host_dir, budget=None)
    shard, parity = first.take(1 << 20, "r0-"), first.take(1 << 20, "p")
    shard.file.array[:4] = 7
    later = Pool(host_dir, budget=None)  # the daemon restarted
    assert later.adopt(shard.name, 1 << 20) is not None
    assert later.adopt(parity.name, 1 << 20) is not None
    later.release(shard.name)
    assert shard.name not in later.files and not later.path(shard.name).exists()
    assert shard.file.array[0] == 7  # an old mapping keeps its bytes
    fresh = later.take(1 << 20, "r0-")
    assert fresh.file.array[0] == 0 and shard.file.array[0] == 7
    later.release(parity.name)  # parity is never mapped by trainers: it is reused
    assert later.take(1 << 20, "p").name == parity.name


def test_the_budget_counts_free_files_and_drops_them_before_refusing(host_dir: Path) -> None:
    pool = Pool(host_dir, budget=3 << 20)
    a = pool.take(2 << 20, "r0-")
    with pytest.raises(CapacityError, match="memory-budget"):
        pool.take(2 << 20, "r1-")
    pool.release(a.name)
    b = pool.take(2 << 20, "r1-")  # the free file of rank 0 is dropped to make room
    assert a.name not in pool.files and pool.used == b.size


def test_a_relaunch_with_the_same_pid_never_writes_over_adopted_files(host_dir: Path) -> None:
    """Names are <prefix><pid>-<n>: a daemon in a fresh container can get its predecessor's pid."""
    first = Pool(host_dir, budget=None)
    old = [first.take(1 << 20, "r0-") for _ in range(3)]
    for i, b in enumerate(old):
        b.file.array[:] = i + 1
    later = Pool(host_dir, budget=None)  # same pid, its sequence starts over
    assert later.adopt(old[1].name, 1 << 20) is not None  # one adopted; two not yet looked at
    new = [later.take(1 << 20, "r0-") for _ in range(2)]
    assert not {b.name for b in new} & {b.name for b in old}
    for i, b in enumerate(old):
        assert int(b.file.array.min()) == int(b.file.array.max()) == i + 1


def test_names_are_never_made_again_by_a_later_daemon(host_dir: Path) -> None:
    """A trainer caches its mapping of a buffer by path: a later daemon (same pid, as in a fresh
    container) must not give a new file the name of one deleted before it started."""
    first = Pool(host_dir, budget=None)
    gone = first.take(1 << 20, "r0-")
    first.drop(gone.name)
    later = Pool(host_dir, budget=None)
    assert later.take(1 << 20, "r0-").name != gone.name
