"""Shared-memory files: a new buffer is mapped page by page before anyone writes to it."""

from __future__ import annotations

import mmap
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._memory import mapped_kib
from transport import shm

MIB = 1 << 20


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ecsnap-test-shm-") as d:
        yield Path(d)


def _resident(path: Path) -> int:
    """Bytes of ``path``'s mapping in this process that have page-table entries (smaps Rss)."""
    return mapped_kib(path, "Rss") * 1024


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


@pytest.fixture(params=["populate", "writes"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How prefault maps pages in: the kernel's MADV_POPULATE_WRITE, or a write per page (what
    a kernel without it gets)."""
    if request.param == "writes":
        monkeypatch.setattr(shm, "_populate_works", False)
    elif not shm._populate_works:
        pytest.skip("this kernel refused MADV_POPULATE_WRITE (before 5.14)")
    return str(request.param)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefault_maps_every_page(shm_dir: Path, threads: int, way: str) -> None:
    size = 3 * 64 * MIB + 5000  # three pieces, the last one page-unaligned
    path = shm_dir / "buf"
    f = shm.create(path, size, prefault_pages=False)
    try:
        assert _resident(path) < size // 100  # nothing mapped yet
        shm.prefault(f.array, threads=threads)
        assert _resident(path) == _pages(size)
        assert not f.array.any()  # zeros stay zeros
    finally:
        f.close()


def test_prefault_of_an_unaligned_view_maps_all_of_it(shm_dir: Path, way: str) -> None:
    size = 2 * 64 * MIB + 3 * mmap.PAGESIZE
    path = shm_dir / "buf"
    with path.open("wb") as out:  # the file holds 7s, written without mapping it
        out.write(b"\x07" * size)
    f = shm.MappedFile(path)
    try:
        view = f.array[100 : size - 100]  # starts and ends inside a page
        shm.prefault(view, threads=2)
        assert _resident(path) == _pages(size)
        assert shm._populate_works == (way == "populate")  # no refusal on the way
        if way == "populate":  # the kernel mapped them in: no byte changed
            assert int(f.array.min()) == 7 and int(f.array.max()) == 7
        else:  # one zero a page, and at the view's end
            assert int(view[:: mmap.PAGESIZE].max()) == 0 and int(view[-1]) == 0
            assert int(view[1:-1].sum()) == 7 * (view.size - 2 - (view.size - 2) // mmap.PAGESIZE)
            assert int(f.array[99]) == 7 and int(f.array[-1]) == 7  # outside the view: untouched
    finally:
        f.close()


def test_create_prefaults_by_default_and_empty_files_are_fine(shm_dir: Path) -> None:
    big = shm.create(shm_dir / "big", 130 * MIB)
    empty = shm.create(shm_dir / "empty", 0)
    try:
        assert _resident(shm_dir / "big") == 130 * MIB
        assert empty.size == 0 and empty.array.size == 0
        shm.prefault(empty.array)
    finally:
        big.close()
        empty.close()


def test_a_mapping_knows_when_its_path_names_another_file(shm_dir: Path) -> None:
    """A cached mapping must not be reused once its file was deleted and the name made again."""
    path = shm_dir / "buf"
    old = shm.create(path, 1 << 20)
    try:
        assert old.current()
        path.unlink()
        assert not old.current()
        new = shm.create(path, 1 << 20)
        try:
            new.array[:4] = 5
            assert new.current() and not old.current()
            assert int(old.array[0]) == 0  # the old mapping still holds the deleted file
        finally:
            new.close()
    finally:
        old.close()


MOUNTS = """\
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683784k
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1g,huge=within_size
31 25 0:28 / /mnt/huge\\040pages rw,relatime shared:7 - tmpfs tmpfs rw,huge=always
32 25 0:29 / /mnt/huge\\040pages/disk rw,relatime - ext4 /dev/vda rw
33 1 0:30 / / rw,relatime - ext4 /dev/vda rw
"""


@pytest.mark.parametrize(
    ("path", "huge"),
    [
        ("/dev/shm/ecsnap/job", "within_size"),  # the later of two mounts on one point
        ("/mnt/huge pages/f", "always"),  # an escaped space; optional fields before " - "
        ("/mnt/huge pages/disk/f", None),  # the deepest mount holds it: no tmpfs
        ("/mnt/huge pagesX", None),  # a longer name is no path inside the mount
        ("/work", None),
    ],
)
def test_huge_pages_reads_the_option_of_the_tmpfs_holding_a_path(
    tmp_path: Path, path: str, huge: str | None
) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    assert shm.huge_pages(path, mountinfo=str(table)) == huge
    table.write_text(MOUNTS.replace(",huge=within_size", ""))
    if path.startswith("/dev/shm"):
        assert shm.huge_pages(path, mountinfo=str(table)) == "never"  # tmpfs's default
    assert shm.huge_pages(path, mountinfo=str(tmp_path / "gone")) is None


def test_a_file_on_a_tmpfs_with_huge_pages_is_mapped_in_them(
    huge_root: Path, shm_dir: Path
) -> None:
    """The mount's option reads back, and a file made there is mapped in 2 MiB page-table
    entries, every byte of it; the same file in /dev/shm (which this machine mounts without huge
    pages) in none."""
    assert shm.huge_pages(huge_root / "f") == "within_size"
    for d in (huge_root, shm_dir):
        with shm.create(d / "f", 8 * MIB) as mf:
            mf.array[:] = 7
            assert mapped_kib(d, "Rss") == 8 * 1024
            pmd = mapped_kib(d, "ShmemPmdMapped")
            if d == huge_root:
                assert pmd == 8 * 1024
            elif shm.huge_pages(d) == "never":
                assert pmd == 0


def _fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def _mappings(directory: Path) -> int:
    """Lines of /proc/self/maps that name a file under ``directory``."""
    return sum(
        1 for line in Path("/proc/self/maps").read_text().splitlines() if str(directory) in line
    )


def test_mappings_hold_no_descriptor(shm_dir: Path) -> None:
    """300 files mapped (shared, and copy-on-write) cost no descriptor: before, mmap.mmap kept
    a duplicate of each for the mapping's life, and a daemon keeping many steps ran out."""
    before = _fds()
    files = [shm.create(shm_dir / f"f{i}", 4096 * (i % 7 + 1)) for i in range(300)]
    private = [shm.map_private(shm_dir / f"f{i}", 4096) for i in range(300)]
    try:
        assert _mappings(shm_dir) == 600
        assert _fds() == before
    finally:
        for f in files:
            f.close()
        del private
    assert _mappings(shm_dir) == 0


def test_a_closed_mapping_lives_while_a_view_does(shm_dir: Path) -> None:
    """close() unmaps once no view is left; a numpy view, a memoryview or a torch tensor made
    before keeps the pages (and reads the file's bytes) until it goes."""
    import torch

    f = shm.create(shm_dir / "f", 3 * mmap.PAGESIZE)
    f.array[:] = 7
    view = f.array[10:20]
    mv = memoryview(f.array)[5:9]
    t = torch.frombuffer(f.array, dtype=torch.uint8, count=4, offset=100)
    f.close()
    assert f.array.size == 0 and _mappings(shm_dir) == 1
    assert int(view.sum()) == 70 and bytes(mv) == b"\x07" * 4 and int(t.sum()) == 28
    del view, mv
    assert _mappings(shm_dir) == 1  # the tensor still holds it
    del t
    assert _mappings(shm_dir) == 0

    g = shm.create(shm_dir / "g", mmap.PAGESIZE)
    g.close()
    assert _mappings(shm_dir) == 0  # no view: unmapped at close


def test_the_owner_of_a_private_mapping_lives_as_long_as_its_views(shm_dir: Path) -> None:
    """The client ends a read's lease when the mapping's owner dies: not before the last tensor
    made from it, whatever views came between."""
    import weakref

    import torch

    f = shm.create(shm_dir / "f", mmap.PAGESIZE)
    f.array[:] = 3
    a = shm.map_private(shm_dir / "f", mmap.PAGESIZE)
    ended: list[int] = []
    weakref.finalize(shm.mapping_owner(a), ended.append, 1)
    t = torch.frombuffer(a, dtype=torch.uint8, count=8, offset=64).view(torch.int64)
    n = a[100:200].reshape(10, 10)
    del a
    assert not ended
    n[0, 0] = 9  # copy-on-write: the file keeps its bytes
    assert int(f.array[100]) == 3 and int(n[0, 0]) == 9
    del n
    assert not ended and int(t.item()) == int.from_bytes(b"\x03" * 8, "little")
    del t
    assert ended == [1]
    f.close()
