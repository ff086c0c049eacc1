"""Shared-memory buffers: files under /dev/shm (or any directory), mapped by daemon and trainers.

The daemon creates and owns every file (mode 0600 inside a 0700 directory); trainers map the
files their daemon names. A new buffer is pre-faulted once by the daemon (first touch of a
/dev/shm page costs ~8x a later write) and then reused across steps, so the trainer's copy runs at
memory speed.

A mapping holds no file descriptor. Before Python 3.13 ``mmap.mmap`` keeps a duplicate of the
descriptor it was given for the mapping's whole life (``trackfd=False`` exists from 3.13 on), so a
daemon that keeps 1,000 steps held 1,000+ descriptors and ran out of them under the common soft
limit of 1,024. Here a mapping is made with ``trackfd=False`` where the interpreter has it, else
by ``mmap(2)`` itself through libc; either way the descriptor is closed as soon as the mapping
exists, and the mapping lives until the last view of it is gone (:func:`map_file`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "MappedFile",
    "create",
    "huge_pages",
    "map_file",
    "map_private",
    "mapping_owner",
    "prefault",
]

_PAGE = mmap.PAGESIZE


# Each thread touches at least this much. Mapping a fresh tmpfs page costs ~1.5 us of kernel
# time, and the kernel takes the faults of one file on several cores at once. Measured on a
# 2-core VM for 500 MB after posix_fallocate: 0.19 s on one thread, 0.10 s on two. A host
# replacing a lost one made its files for the newest step (1.5 GB state, RS(3,1)) in a median
# 381 ms instead of 435 ms.
_PARALLEL_BYTES = 64 << 20

# madvise(MADV_POPULATE_WRITE), Linux 5.14+: the kernel maps the pages in for writing in one
# call, without a write that changes a byte. Measured here (gVisor on a 2-core VM), 512 MB of
# /dev/shm after posix_fallocate, in 64 MiB pieces on one thread, six alternated runs each:
# 0.20-0.25 CPU s against 0.26-0.33 for a write of a zero per page. Where the kernel refuses it
# (older kernels: EINVAL), the write per page does it.
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_populate_works = sys.platform.startswith("linux")  # False once the kernel refused it

_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
# Python 3.13+: mmap.mmap(..., trackfd=False) keeps no duplicate of the descriptor
_TRACKFD = sys.version_info >= (3, 13)


class _Region:
    """One ``mmap(2)`` region of ``size`` bytes at ``addr``, unmapped when this object dies.

    numpy arrays made from it (``np.asarray``) and every view of those keep it alive as their
    ``base`` (numpy sets a view's base to the first owner that is not an array), and so do
    memoryviews and torch tensors made from such arrays: the region is unmapped exactly when
    the last of them is gone, never under a live view.
    """

    __slots__ = ("__array_interface__", "__weakref__", "_unmap")

    def __init__(self, addr: int, size: int) -> None:
        self.__array_interface__ = {
            "data": (addr, False),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }
        self._unmap = weakref.finalize(self, _libc.munmap, addr, size)


def map_file(fd: int, size: int, *, private: bool = False, populate: bool = False) -> Any:
    """Map ``size`` (> 0) bytes of the open file ``fd`` read-write: shared, or copy-on-write
    (``private``); ``populate`` maps every page in now (``MAP_POPULATE``). Returns a flat uint8
    numpy array over the mapping, which holds no descriptor: the caller may close ``fd`` at once.

    The mapping lives as long as the array or any view of it (numpy, memoryview, torch): its
    owner is :func:`mapping_owner` of the array. Raises ``OSError`` as ``mmap(2)`` fails.
    """
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    if _TRACKFD:
        m = mmap.mmap(fd, size, flags=flags, prot=prot, trackfd=False)  # type: ignore[call-arg]
        return np.frombuffer(m, dtype=np.uint8)
    addr = _libc.mmap(None, size, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    return np.asarray(_Region(addr, size))


def mapping_owner(array: Any) -> Any:
    """The object that owns the mapping under an array :func:`map_file` returned (or a view of
    it): the mapping lives while this object does, so a finalizer on it runs once the last view
    is gone."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


def prefault(
    view: npt.NDArray[np.uint8],
    threads: int | None = None,
    on_thread: Callable[[float], None] | None = None,
) -> None:
    """Map in every page of ``view`` for writing, so later writes do not fault.

    The kernel does it in one call where it can (``MADV_POPULATE_WRITE``: the bytes stay as
    they are); elsewhere a zero is written to one byte of each page, the view's first and last.
    A large view is split into page-aligned pieces touched by up to ``threads`` threads (default:
    the CPUs this process may run on, at most 8); neither the kernel call nor numpy's strided
    write holds the GIL.
    ``on_thread`` is told each helper thread's CPU seconds (the caller's own are its own).
    """
    if not view.size:
        return
    if threads is None:
        threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    n = max(1, min(threads, view.size // _PARALLEL_BYTES))
    if n == 1:
        _touch(view, last=True)
    else:
        piece = -(-view.size // n // _PAGE) * _PAGE
        workers = [
            threading.Thread(
                target=_touch, args=(view[i * piece : (i + 1) * piece], on_thread, i == n - 1)
            )
            for i in range(1, n)
        ]
        for w in workers:
            w.start()
        try:
            _touch(view[:piece])
        finally:
            for w in workers:
                w.join()


def _touch(
    view: npt.NDArray[np.uint8],
    on_thread: Callable[[float], None] | None = None,
    last: bool = False,
) -> None:
    """Map in ``view``'s pages (the view's ``last`` piece: a write reaches its last byte)."""
    t0 = time.thread_time()
    if not _populate(view):
        view[::_PAGE] = 0
        if last:
            view[-1] = 0
    if on_thread is not None:
        on_thread(time.thread_time() - t0)


def _populate(view: npt.NDArray[np.uint8]) -> bool:
    """``MADV_POPULATE_WRITE`` over the pages ``view`` lies in; whether the kernel did it."""
    global _populate_works
    if not _populate_works:
        return False
    start = view.ctypes.data // _PAGE * _PAGE
    end = -(-(view.ctypes.data + view.size) // _PAGE) * _PAGE
    if _libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _populate_works = False  # this kernel has no such advice
    return False  # EFAULT, ENOMEM (the file system is full), EINTR...: the writes find out


class MappedFile:
    """A file mapped read-write with a flat uint8 numpy view ``array``; it holds no descriptor.

    ``close()`` lets go of the mapping: it is unmapped then, or, while views handed out live
    (numpy, memoryview, torch), when the last of them dies; so closing is safe even while
    readers hold views (the kernel frees the pages when the last map goes).
    """

    def __init__(
        self, path: str | os.PathLike[str], size: int | None = None, *, populate: bool = False
    ) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            self._inode = (st.st_dev, st.st_ino)
            actual = st.st_size
            self.size = actual if size is None else size
            if self.size > actual:
                raise ValueError(f"{self.path} holds {actual} bytes, {self.size} expected")
            self.array: npt.NDArray[np.uint8] = (
                map_file(fd, self.size, populate=populate)
                if self.size
                else np.zeros(0, dtype=np.uint8)
            )
        finally:
            os.close(fd)
        self._lock = threading.Lock()

    @property
    def inode(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the file mapped (it stays the same file when renamed)."""
        return self._inode

    def current(self) -> bool:
        """Whether ``path`` still names the file this maps (not deleted, not made anew)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def follow(self, path: str | os.PathLike[str], size: int) -> None:
        """The file was renamed to ``path`` and will be cut to ``size`` bytes (at most its
        mapped size): the view narrows to them, the mapping stays (its pages already mapped).

        Nothing may touch the bytes past ``size`` from now on, so the file can be cut later
        (``ftruncate``) while this and other mappings of its first ``size`` bytes live on.
        """
        if size > self.size:
            raise ValueError(f"{self.path} maps {self.size} bytes; cannot widen to {size}")
        self.path = Path(path)
        self.size = size
        self.array = self.array[:size]

    def close(self) -> None:
        with self._lock:
            self.array = np.zeros(0, dtype=np.uint8)  # the mapping goes with its last view

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create(
    path: str | os.PathLike[str],
    size: int,
    *,
    prefault_pages: bool = True,
    exclusive: bool = False,
    on_thread: Callable[[float], None] | None = None,
) -> MappedFile:
    """Create (or resize) ``path`` as a 0600 file of ``size`` bytes, map it and pre-fault it.

    Raises ``OSError`` (ENOSPC) when the file system is full: /dev/shm is memory; with
    ``exclusive``, ``FileExistsError`` if ``path`` exists. ``on_thread``: see :func:`prefault`.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        if size and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)  # fail now with ENOSPC, not later with SIGBUS
    finally:
        os.close(fd)
    mf = MappedFile(path, size)
    if prefault_pages:
        prefault(mf.array, on_thread=on_thread)
    return mf


def map_private(path: str | os.PathLike[str], size: int) -> npt.NDArray[np.uint8]:
    """A copy-on-write mapping of ``path`` (a flat uint8 array): reads share the file's pages,
    writes stay private.

    The mapping outlives the file's name (unlink is safe) and lives while the array or any view
    of it does (:func:`mapping_owner`); it holds no descriptor. Pages are mapped on first touch
    (populating a private writable mapping would copy them all).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} holds fewer than {size} bytes")
        return map_file(fd, size, private=True)  # type: ignore[no-any-return]
    finally:
        os.close(fd)


def huge_pages(path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The ``huge=`` option of the tmpfs that holds ``path`` (``"never"`` when it names none, the
    default), or None where ``path`` lies on no tmpfs or the mount table cannot be read.

    A tmpfs mounted ``huge=within_size`` backs each file with 2 MiB pages as far as its size
    allows (``always``: even a small file's). MPICH's single copy between daemons reads a shard
    from the sender's mapping; from 4 KiB pages that cost 2.5x what it costs from huge ones here
    (README: "Huge pages for shared memory").
    """
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None  # mount point, file system type, its options
    for line in lines:
        # ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [TAGS...] - TYPE SOURCE SUPER-OPTIONS
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        # the deepest mount point holds it; of equal ones, the last mounted (it hides the rest)
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, tail[0], tail[2])
    if best is None or best[1] != "tmpfs":
        return None
    for opt in best[2].split(","):
        if opt.startswith("huge="):
            return opt[len("huge=") :]
    return "never"
