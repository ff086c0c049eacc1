"""The host's pool of shared-memory files: freed files are reused, except adopted shard buffers."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.errors import CapacityError
from storage.pool import _PIECE, RESERVE, Pool
from transport import shm


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


def _never_pause() -> bool:
    return True


def test_a_file_made_ahead_serves_the_next_take_with_no_fresh_pages(host_dir: Path) -> None:
    pool = Pool(host_dir, budget=None)
    made = pool.make(3 << 20, "r0-", _never_pause)
    assert made is not None and made.name in pool.free and not pool.partial
    assert pool.used == 3 << 20 and pool.count("r0-", 3 << 20) == 1
    got = pool.take(3 << 20, "r0-")
    assert got.name == made.name and pool.fresh_bytes == 0
    assert pool.ahead_bytes == 3 << 20
    assert pool.take(3 << 20, "r1-").name != made.name  # another prefix makes its own
    assert pool.fresh_bytes == 3 << 20


def test_made_lists_the_whole_free_files_of_a_prefix_in_the_order_takes_pick_them(
    host_dir: Path,
) -> None:
    """What a trainer may map ahead: never a partial file, one in use, or another prefix's."""
    pool = Pool(host_dir, budget=None)
    big = pool.make(3 << 20, "r0-", _never_pause)
    small = pool.make(2 << 20, "r0-", _never_pause)
    assert big is not None and small is not None
    pool.make(2 << 20, "r1-", _never_pause)
    stopped = pool.make(_PIECE + (1 << 20), "r0-", lambda: False)  # paused before a piece
    assert stopped is not None and stopped.name in pool.partial
    assert [b.name for b in pool.made("r0-")] == [small.name, big.name]
    got = pool.take(2 << 20, "r0-")
    assert got.name == small.name  # the first listed is the first given
    assert [b.name for b in pool.made("r0-")] == [big.name]
    pool.release(got.name)
    assert [b.name for b in pool.made("r0-")] == [small.name, big.name]


def test_a_take_finishes_a_file_the_warmer_paused_on(host_dir: Path) -> None:
    """Made ahead in pieces; live work came after the first: the take faults in the rest."""
    pool = Pool(host_dir, budget=None)
    size = _PIECE + (1 << 20)
    calls = []

    def pause_after_one() -> bool:
        calls.append(1)
        return len(calls) == 1  # one piece, then "the daemon is stopping"

    made = pool.make(size, "p", pause_after_one)
    assert made is not None and pool.partial == {made.name: _PIECE}
    got = pool.take(size, "p")
    assert got.name == made.name and made.name not in pool.partial
    assert pool.fresh_bytes == 1 << 20  # only the piece that was missing
    got.file.array[-1] = 7  # allocated and mapped to its end
    assert pool.advance(made.name, _never_pause) is False  # taken: the warmer lets go


def test_a_take_waits_for_the_piece_the_warmer_is_faulting_in_and_finishes_the_file(
    host_dir: Path,
) -> None:
    """A take that comes while the warmer faults in a piece of the one file it could use waits
    for that piece, then faults in only the rest; it does not make (and fault in) a whole new
    file beside it."""
    pool = Pool(host_dir, budget=None)
    size = _PIECE + (1 << 20)
    real_fault = pool._fault
    in_piece, go_on = threading.Event(), threading.Event()

    def held_fault(buf: Any, start: int, end: int, threads: int | None = None) -> None:
        if threads == 1:  # the warmer's piece: held here until the take is waiting
            in_piece.set()
            assert go_on.wait(30)
        real_fault(buf, start, end, threads)

    pool._fault = held_fault  # type: ignore[method-assign]
    pauses = []

    def pause_after_one() -> bool:
        pauses.append(1)
        return len(pauses) == 1  # one piece, then live work: the warmer stops

    warmer = threading.Thread(target=pool.make, args=(size, "p", pause_after_one))
    warmer.start()
    assert in_piece.wait(30)
    (made,) = (pool.files[n] for n in pool.partial)  # made, its first piece in progress
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(pool.take(size, "p")))
    taker.start()
    taker.join(0.5)
    assert taker.is_alive(), "the take did not wait for the piece in progress"
    assert pool.fresh_bytes == 0 and list(pool.files) == [made.name]
    go_on.set()
    taker.join(30)
    warmer.join(30)
    assert got[0].name == made.name and made.name not in pool.partial
    assert pool.fresh_bytes == 1 << 20  # only what the warmer had not faulted in
    assert pool.ahead_bytes == _PIECE and not pool.advancing


def test_a_reserve_file_turns_into_the_file_a_take_needs(host_dir: Path) -> None:
    pool = Pool(host_dir, budget=8 << 20)
    big = pool.make(4 << 20, RESERVE, _never_pause)
    small = pool.make(1 << 20, RESERVE, _never_pause)
    assert big is not None and small is not None
    shard = pool.take(3 << 20, "r0-")  # from the 4 MiB one: nothing faulted in, nothing cut yet
    assert shard.name.startswith("r0-") and shard.size == 3 << 20 and shard.file is big.file
    assert not pool.path(big.name).exists() and pool.path(shard.name).stat().st_size == 4 << 20
    assert pool.fresh_bytes == 0 and pool.reserve_wasted == 1 << 20
    assert pool.uncut == {shard.name: 1 << 20} and pool.used == 5 << 20  # the tail counts
    parity = pool.take(2 << 20, "p")  # grown from the 1 MiB one: 1 MiB faulted in
    assert pool.path(parity.name).parent.name == "parity" and parity.size == 2 << 20
    assert pool.fresh_bytes == 1 << 20 and pool.reserve_used == (3 << 20) + (1 << 20)
    parity.file.array[:] = 1
    assert pool.used == 6 << 20 and pool.counters()["reserve_free_bytes"] == 0
    # a trainer maps the shard and writes it; the cut (idle time) leaves both views whole
    trainer = shm.MappedFile(pool.path(shard.name), shard.size, populate=True)
    trainer.array[:] = 5
    assert pool.cut() == 1 << 20 and pool.uncut == {} and pool.used == 5 << 20
    assert pool.path(shard.name).stat().st_size == 3 << 20
    trainer.array[-1] = 6
    assert int(shard.file.array[0]) == 5 and int(shard.file.array[-1]) == 6
    trainer.close()


def test_a_take_over_the_budget_cuts_the_tails_of_converted_reserve_files_first(
    host_dir: Path,
) -> None:
    pool = Pool(host_dir, budget=6 << 20)
    assert pool.make(5 << 20, RESERVE, _never_pause) is not None
    shard = pool.take(2 << 20, "r0-")  # the 3 MiB tail is still held: 5 MiB used
    assert pool.used == 5 << 20
    parity = pool.take(3 << 20, "p")  # fits once the tail is cut
    assert parity.size == 3 << 20 and pool.uncut == {} and pool.used == 5 << 20
    assert pool.path(shard.name).stat().st_size == 2 << 20


def test_files_made_ahead_obey_the_budget_and_give_way_to_takes(host_dir: Path) -> None:
    pool = Pool(host_dir, budget=4 << 20)
    assert pool.make(3 << 20, "r0-", _never_pause) is not None
    assert pool.make(2 << 20, "r1-", _never_pause) is None  # would pass the budget: not made
    live = pool.take(2 << 20, "r1-")  # the free file made ahead is dropped for live work
    assert live.size == 2 << 20 and pool.count("r0-", 3 << 20) == 0


def test_a_relaunched_daemon_takes_back_the_reserve_left_to_it(host_dir: Path) -> None:
    first = Pool(host_dir, budget=None)
    shard = first.take(1 << 20, "r0-")
    spare = first.make(2 << 20, RESERVE, _never_pause)
    later = Pool(host_dir, budget=None)
    assert spare is not None and later.adopt_reserve() == [spare.name]
    assert spare.name in later.free and shard.name not in later.files
    got = later.take(2 << 20, "r0-")  # turned into a shard buffer, as its own would be
    assert got.name.startswith("r0-") and later.fresh_bytes == 0


def test_a_reserve_file_grown_ahead_of_need_is_not_counted_as_a_puts_fresh_pages(
    host_dir: Path,
) -> None:
    pool = Pool(host_dir, budget=None)
    assert pool.make(1 << 20, RESERVE, _never_pause) is not None
    made = pool.from_reserve(2 << 20, "p")  # the warmer's doing, in idle time
    assert made is not None and made.name in pool.free and made.size == 2 << 20
    assert pool.fresh_bytes == 0 and pool.ahead_bytes == 2 << 20
    assert pool.take(2 << 20, "p").name == made.name and pool.fresh_bytes == 0


def test_a_rank_claims_its_share_of_the_reserve_and_its_takes_prefer_it(host_dir: Path) -> None:
    pool = Pool(host_dir, budget=None)
    big, mid, small = (pool.make(n << 20, RESERVE, _never_pause) for n in (8, 4, 2))
    assert big is not None and mid is not None and small is not None
    # largest first, within the share: 8 MiB is more than r0's 6, so 4 and 2
    assert {b.name for b in pool.claim("r0-", 6 << 20)} == {mid.name, small.name}
    assert [b.name for b in pool.claim("r1-", 16 << 20)] == [big.name]  # what is left
    assert {b.name for b in pool.claim("r0-", 6 << 20)} == {mid.name, small.name}  # the same
    # both 8 and 4 MiB hold 3 MiB with nothing to fault in: r1's own claim wins over smaller
    assert pool.take(3 << 20, "r1-").file is big.file
    # parity has no claim: the smallest that fits, whoever claimed it
    assert pool.take(3 << 19, "p").file is small.file
    assert pool.claims == {mid.name: "r0-"}
    pool.drop(mid.name)  # dropped to make room: no claim outlives its file
    assert pool.claims == {} and pool.claim("r0-", 6 << 20) == []


def test_trim_drops_free_files_of_sizes_no_longer_wanted_past_the_bound(host_dir: Path) -> None:
    """Free files of old sizes are dropped, the largest first, until the free files fit the
    bound; files of wanted sizes, files in use and reserve files stay."""
    pool = Pool(host_dir, budget=None)
    old = [pool.take(n << 20, "r0-") for n in (1, 2, 3)]
    wanted = pool.take(4 << 20, "r0-")
    used = pool.take(5 << 20, "r0-")
    reserve = pool.make(6 << 20, RESERVE, lambda: True)
    assert reserve is not None
    for b in (*old, wanted):
        pool.release(b.name)
    assert pool.ahead() == 10 << 20  # 1 + 2 + 3 + 4 MiB free; the reserve file aside
    want = {"r0-": 4 << 20}
    assert pool.free_count("r0-", 4 << 20) == 1
    assert pool.trim(want, bound=5 << 20) == 5 << 20  # 3 then 2 MiB: 5 MiB left free
    names = set(pool.files)
    assert old[0].name in names and {old[1].name, old[2].name}.isdisjoint(names)
    assert not pool.path(old[2].name).exists()
    assert {wanted.name, used.name, reserve.name} <= names
    assert pool.trim(want, bound=0) == 1 << 20  # the wanted size's file stays, whatever the bound
    assert set(pool.files) == {wanted.name, used.name, reserve.name}
