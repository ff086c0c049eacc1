"""A host's shared-memory files: shard buffers (``data/``) and parity (``parity/``), reused.

Every file is created pre-faulted by the daemon and handed to trainers by name; a file freed by
retention goes back to the pool and is reused by a later step of similar size, so steady-state
puts never touch fresh pages. ``used`` counts every file, in use or free (and those being made),
against the host's budget; free files are dropped before a request is refused.

Files can also be made ahead of need (:meth:`Pool.make`, called by :mod:`storage.warm` when the
host is idle): a free file of a size a prefix will ask for, or a *reserve* file (prefix ``v``) of
no purpose yet, which :meth:`Pool.take` turns into the file it needs (renamed, then grown, or
cut later when it is larger), so that only the difference in size is faulted in then.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from storage.cpu import Clock
from storage.errors import CapacityError
from transport import shm

__all__ = ["RESERVE", "Buffer", "Pool"]

RESERVE = "v"  # the prefix of reserve files: pre-faulted memory of no purpose yet
# A file made ahead of need is allocated and faulted in pieces this big; between pieces the
# warmer gives way to live work, so a put that starts meanwhile shares the cores with at most one
# piece per host. At 3-4 CPU s per GB of fresh pages (this VM, after a job freed its memory) a
# 64 MiB piece took up to 0.25 s. A fresh job's second put, 3 s after the first (4 virtual hosts,
# 1.5 GB, RS(3,1)), put->protected: 64 MiB pieces and a write per page 0.80 and 1.12 s (two
# runs); 64 MiB and MADV_POPULATE_WRITE (transport.shm.prefault) 0.95 s, 8 MiB and a write per
# page 0.93 s (one run each); 8 MiB and MADV_POPULATE_WRITE 0.52 and 0.55 s (two runs: 1.07 and
# 1.16x the run's steady put).
_PIECE = 8 << 20
_PIECE_WAIT = 1.0  # seconds between a waiting take's looks at the pieces being faulted in


@dataclass
class Buffer:
    name: str
    file: shm.MappedFile

    @property
    def size(self) -> int:
        return self.file.size


class Pool:
    """Thread-safe. Parity file names start with ``p``, shard buffers with ``r<rank>-``, reserve
    files with ``v``."""

    def __init__(self, directory: Path, budget: int | None) -> None:
        self.dir = directory  # the host directory
        self.budget = budget
        self.files: dict[str, Buffer] = {}
        self.free: set[str] = set()
        # Shard buffers adopted from an earlier daemon. Trainers may still hold views under
        # leases the earlier daemon granted, which this one never heard of. So such a buffer is
        # deleted when freed, never reused: a view keeps its pages, and they never change.
        self.adopted: set[str] = set()
        self.lock = threading.Lock()
        # a partial file whose next piece the warmer is faulting in (out of ``free`` meanwhile),
        # and the condition a take that wants it waits on (see :meth:`_take`)
        self.advancing: set[str] = set()
        self._piece_done = threading.Condition(self.lock)
        self.clock: Clock | None = None  # CPU accounting (the daemon's, set by its host)
        self._seq = 0
        self._making = 0  # bytes of files being made or changed (counted against the budget)
        # free files made ahead of need and not faulted in whole yet: name -> bytes faulted in
        self.partial: dict[str, int] = {}
        # pre-faulted bytes of reserve files cut off when turned into a smaller file: made for
        # nothing (the pages go back to the system)
        self.reserve_wasted = 0
        self.reserve_used = 0  # bytes of reserve files turned into the files takes asked for
        self.fresh_bytes = 0  # faulted in by a take that found no file made before
        self.ahead_bytes = 0  # faulted in ahead of need (make): reserve and warm files
        # in every name, so that no later daemon (even one with this pid) makes a name again
        self._tag = secrets.token_hex(3)
        # reserve files turned into smaller ones and not cut yet: name -> bytes past its size
        # that it still holds (cut in idle time by :meth:`cut`, counted in ``used`` till then)
        self.uncut: dict[str, int] = {}
        # free reserve files a trainer maps before its rank's first put (:meth:`claim`): name ->
        # the prefix of that rank's files, whose takes prefer them
        self.claims: dict[str, str] = {}
        self.temps: dict[str, int] = {}  # temporary files for readers: path -> bytes (counted)

    @property
    def used(self) -> int:
        return (
            sum(b.size for b in self.files.values())
            + self._making
            + sum(self.uncut.values())
            + sum(self.temps.values())
        )

    def temp_made(self, path: Path, size: int) -> None:
        """A temporary file outside the pool (a shard fetched from another host, or read from
        disk, for one reader) holds ``size`` bytes of shared memory until :meth:`temp_gone`."""
        with self.lock:
            self.temps[str(path)] = size

    def temp_gone(self, path: Path | str) -> None:
        """The temporary file at ``path`` is removed (its reader mapped it, or went away)."""
        Path(path).unlink(missing_ok=True)
        with self.lock:
            self.temps.pop(str(path), None)

    def count(self, prefix: str, size: int) -> int:
        """Files of ``prefix`` of about ``size`` bytes, in use or free (steady state holds
        ``keep + 1`` of them)."""
        with self.lock:
            return sum(
                1
                for n, b in self.files.items()
                if n.startswith(prefix) and _fits_size(size, b.size)
            )

    def free_count(self, prefix: str, size: int) -> int:
        """Free files of ``prefix`` of about ``size`` bytes (whole or being made ahead)."""
        with self.lock:
            return sum(
                1
                for n in self.free | self.advancing
                if n.startswith(prefix) and _fits_size(size, self.files[n].size)
            )

    def made(self, prefix: str) -> list[Buffer]:
        """The free files of ``prefix`` that are whole (none partial, none adopted): what the next
        takes of ``prefix`` will be given, for a trainer to map ahead; the smallest first (a take
        picks the smallest whole file that fits)."""
        with self.lock:
            names = [
                n
                for n in self.free
                if n.startswith(prefix) and n not in self.partial and n not in self.adopted
            ]
            return sorted((self.files[n] for n in names), key=lambda b: (b.size, b.name))

    def held(self, prefix: str) -> tuple[list[str], list[str]]:
        """The names of every file of ``prefix`` in the pool (in use or free), and those of them
        adopted from an earlier daemon (deleted once freed, never reused)."""
        with self.lock:
            names = sorted(n for n in self.files if n.startswith(prefix))
            return names, [n for n in names if n in self.adopted]

    def path(self, name: str) -> Path:
        return self.dir / ("parity" if name.startswith("p") else "data") / name

    def take(self, size: int, prefix: str, reserve: int = 0) -> Buffer:
        """A pre-faulted file of at least ``size`` bytes (a free one of similar size if any).

        ``reserve`` is memory the caller needs soon after (parity): it must fit too. Raises
        :class:`CapacityError` when the budget or the file system cannot hold it. Its CPU time,
        with the helper threads' that fault pages in, is the ``clock``'s ``memory``.
        """
        if self.clock is None:
            return self._take(size, prefix, reserve)
        with self.clock.phase("memory"):
            return self._take(size, prefix, reserve)

    def _helpers(self) -> Callable[[float], None] | None:
        """Where the threads that fault pages in for a take say their CPU time."""
        return None if self.clock is None else functools.partial(self.clock.add, "memory")

    def _take(self, size: int, prefix: str, reserve: int) -> Buffer:
        def fits(name: str) -> bool:
            return name.startswith(prefix) and _fits_size(size, self.files[name].size)

        with self.lock:
            # A file the warmer is faulting a piece of is no free file until that piece is in:
            # wait for it (at most one piece), rather than fault a whole new file. A take that
            # made a new one instead faulted the whole shard inside the put: a fresh job's
            # second put, whose file the warmer had not finished in the 3 s before it, took
            # 0.8 s to stage instead of 0.15.
            while not any(fits(n) for n in self.free) and any(fits(n) for n in self.advancing):
                self._piece_done.wait(_PIECE_WAIT)
            best = None
            for name in self.free:
                if not fits(name):
                    continue
                b = self.files[name]
                rank = (self.partial.get(name, b.size) < b.size, b.size)  # complete ones first
                if best is None or rank < best[0]:
                    best = (rank, b)
            if best is not None and self._fits(reserve):
                buf = best[1]
                self.free.discard(buf.name)
                done = self.partial.pop(buf.name, None)
            else:
                buf = None
        if buf is not None:
            if done is not None:  # made ahead in part: the rest now
                try:
                    self._fault(buf, done, buf.size)  # pieces end on pages
                except OSError as exc:
                    self.drop(buf.name)
                    raise CapacityError(
                        f"cannot allocate {buf.size} bytes of shared memory: {exc}"
                    ) from exc
                with self.lock:
                    self.fresh_bytes += buf.size - done
            return buf
        need = max(size, 1)
        if self.uncut and not self.fits(need + reserve):
            self.cut()  # the tails of converted reserve files make room first
        claimed = self._claim_reserve(need, prefix, reserve)
        if claimed is not None:
            return self._convert(*claimed, need)
        with self.lock:
            if not self._fits(need + reserve):
                for name in sorted(self.free, key=lambda n: -self.files[n].size):
                    self._drop(name)
                    if self._fits(need + reserve):
                        break
            if not self._fits(need + reserve):
                raise self._over(size + reserve)
            name = self._name(prefix)
        try:
            f = shm.create(self.path(name), need, exclusive=True, on_thread=self._helpers())
        except OSError as exc:
            if not isinstance(exc, FileExistsError):  # not ours to delete
                try:
                    self.path(name).unlink()
                except FileNotFoundError:
                    pass
            raise CapacityError(f"cannot allocate {need} bytes of shared memory: {exc}") from exc
        buf = Buffer(name, f)
        with self.lock:
            self.files[name] = buf
            self.fresh_bytes += need
        return buf

    def counters(self) -> dict[str, int]:
        """Bytes faulted in: inside takes, ahead of need, and what became of reserve files."""
        with self.lock:
            return {
                "pool_fresh_bytes": self.fresh_bytes,
                "pool_ahead_bytes": self.ahead_bytes,
                "reserve_used_bytes": self.reserve_used,
                "reserve_wasted_bytes": self.reserve_wasted,
                "reserve_uncut_bytes": sum(self.uncut.values()),
                "reserve_free_bytes": sum(
                    self.files[n].size for n in self.free if n.startswith(RESERVE)
                ),
                # made ahead of need for the next puts (free, not reserve), and readers' files
                "pool_ahead_free_bytes": sum(
                    self.files[n].size for n in self.free if not n.startswith(RESERVE)
                ),
                "pool_temp_bytes": sum(self.temps.values()),
            }

    def _name(self, prefix: str) -> str:
        """A new file name (under the lock)."""
        while True:
            # Never an existing file's name: a daemon relaunched with an earlier one's pid (a
            # container's pids start over) wrote over the files it adopted from it. The tag
            # makes that unlikely; this check and O_EXCL make it impossible.
            self._seq += 1
            name = f"{prefix}{os.getpid()}-{self._tag}-{self._seq}"
            if name not in self.files and not self.path(name).exists():
                return name

    def claim(self, prefix: str, share: int) -> list[Buffer]:
        """The complete free reserve files claimed for ``prefix`` (one rank's files), after
        claiming unclaimed ones, largest first, while the claims add up to at most ``share``
        bytes: that rank's trainer maps them before its first put, and the takes of ``prefix``
        prefer them among the files that fault in as few pages (:meth:`_reserve_for`), so that
        the put finds its file mapped already. A claim binds nothing: it only breaks ties."""
        with self.lock:
            mine = [n for n, p in self.claims.items() if p == prefix and n in self.free]
            total = sum(self.files[n].size for n in mine)
            unclaimed = [
                self.files[n]
                for n in self.free
                if n.startswith(RESERVE) and n not in self.partial and n not in self.claims
            ]
            for b in sorted(unclaimed, key=lambda b: (-b.size, b.name)):
                if total + b.size <= share:
                    self.claims[b.name] = prefix
                    mine.append(b.name)
                    total += b.size
            return [self.files[n] for n in mine]

    def _reserve_for(self, need: int, prefix: str) -> Buffer | None:
        """The complete free reserve file that turns into one of ``need`` bytes with the fewest
        pages left to fault in, one claimed for ``prefix`` first, then an unclaimed one (then
        the smallest, keeping larger ones for larger needs), if that beats a new file (under the
        lock). Cutting a larger one costs no time: its pre-faulted tail goes back to the system
        (counted in ``reserve_wasted``)."""
        best: tuple[int, int, int] | None = None
        found = None
        for name in self.free:
            if name.startswith(RESERVE) and name not in self.partial:
                b = self.files[name]
                owner = self.claims.get(name)
                mine = 0 if owner == prefix else 1 if owner is None else 2
                key = (max(0, need - b.size), mine, b.size)
                if key[0] < need and (best is None or key < best):
                    best, found = key, b
        return found

    def _claim_reserve(self, need: int, prefix: str, reserve: int) -> tuple[Buffer, str] | None:
        """Take the best reserve file for ``need`` bytes off the pool (counted as being made
        meanwhile) and name the file it becomes, if one beats a new file and its growth and
        ``reserve`` fit the budget; None otherwise."""
        with self.lock:
            spare = self._reserve_for(need, prefix)
            if spare is None or not self._fits(reserve + max(0, need - spare.size)):
                return None
            self.free.discard(spare.name)
            del self.files[spare.name]
            self.claims.pop(spare.name, None)
            self._making += need  # counted while it changes name and size
            return spare, self._name(prefix)

    def _convert(self, spare: Buffer, name: str, need: int, ahead: bool = False) -> Buffer:
        """Turn the reserve file ``spare`` (taken off the free list) into ``name`` of ``need``
        bytes: renamed, then grown and the rest faulted in, or, if it is larger, kept mapped and
        cut later (:meth:`cut`, in idle time).

        A larger file is not cut here: a take is on a put's path, and unmapping the reserve,
        cutting it and mapping the rest again cost 0.13 s for 783 MB cut to 375 MB (0.03 s
        unmap, 0.05 s ftruncate, 0.045 s MAP_POPULATE), 0.1 to 0.24 s for each of 4 daemons
        converting at once on 2 cores; renaming and narrowing the view cost under 1 ms.
        """
        old = spare.size
        src, dst = self.path(spare.name), self.path(name)
        try:
            os.rename(src, dst)
            if need <= old:
                spare.file.follow(dst, need)
                f = spare.file
            else:
                spare.file.close()
                fd = os.open(dst, os.O_RDWR)
                try:
                    os.ftruncate(fd, need)
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, old, need - old)
                finally:
                    os.close(fd)
                # MAP_POPULATE maps in the pages the reserve holds (0.07 s per GB here, against
                # 0.47 s for faults one page at a time when first read) and faults in the tail
                f = shm.MappedFile(dst, need, populate=True)
                with self.lock:
                    if ahead:
                        self.ahead_bytes += need - old
                    else:
                        self.fresh_bytes += need - old
        except OSError as exc:
            with self.lock:
                self._making -= need
            spare.file.close()
            for p in (src, dst):
                p.unlink(missing_ok=True)
            raise CapacityError(f"cannot allocate {need} bytes of shared memory: {exc}") from exc
        buf = Buffer(name, f)
        with self.lock:
            self._making -= need
            self.files[name] = buf
            if old > need:
                self.uncut[name] = old - need
            self.reserve_used += min(old, need)
            self.reserve_wasted += max(0, old - need)
        return buf

    def from_reserve(self, size: int, prefix: str) -> Buffer | None:
        """Turn a reserve file into a free file of ``size`` for ``prefix`` when that faults in
        fewer pages than a new file; None (nothing done) otherwise."""
        claimed = self._claim_reserve(size, prefix, 0)
        if claimed is None:
            return None
        buf = self._convert(*claimed, size, ahead=True)
        with self.lock:
            self.free.add(buf.name)
        return buf

    def make(self, size: int, prefix: str, pause: Callable[[], bool]) -> Buffer | None:
        """Make a free file of ``size`` bytes for later takes of ``prefix``, ahead of need.

        The file is free from the start, *partial* (:attr:`partial`: its bytes faulted in so
        far) until :meth:`advance` has allocated and faulted it all in, 8 MiB a piece, pausing
        between pieces while live work runs. A take that picks a partial file faults in only the
        rest; one that comes while a piece is being faulted in waits for that piece first.
        Returns None, making nothing, when the file would not fit the budget or the file system;
        else the file (complete, or partial if ``pause()`` gave up or a take took it).
        """
        with self.lock:
            if not self._fits(size):
                return None
            name = self._name(prefix)
            self._making += size
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            f = shm.MappedFile(path, size)
        except OSError:
            path.unlink(missing_ok=True)
            with self.lock:
                self._making -= size
            return None
        buf = Buffer(name, f)
        with self.lock:
            self._making -= size
            self.files[name] = buf
            self.free.add(name)
            self.partial[name] = 0
        self.advance(name, pause)
        return buf

    def advance(self, name: str, pause: Callable[[], bool]) -> bool:
        """Go on faulting in the partial free file ``name``, a piece at a time, each after
        ``pause()`` (False: stop). Returns whether the file is complete now; False also when a
        take took it (the take finishes it) or the budget dropped it."""
        while True:
            if not pause():
                return False
            with self.lock:
                done = self.partial.get(name)
                if done is None or name not in self.free:
                    return False
                self.free.discard(name)  # this piece is ours: no take picks it meanwhile
                self.advancing.add(name)
                buf = self.files[name]
            n = min(_PIECE, buf.size - done)
            try:
                self._fault(buf, done, done + n, threads=1)
            except OSError:
                with self.lock:
                    self.advancing.discard(name)
                    self._piece_done.notify_all()
                    self._drop(name)  # the file system is full: nothing more made ahead
                return False
            with self.lock:
                self.advancing.discard(name)
                self._piece_done.notify_all()
                self.free.add(name)
                self.ahead_bytes += n
                if done + n >= buf.size:
                    del self.partial[name]
                    return True
                self.partial[name] = done + n

    def _fault(self, buf: Buffer, start: int, end: int, threads: int | None = None) -> None:
        """Allocate bytes ``start:end`` of ``buf``'s file (ENOSPC now, not SIGBUS later) and
        fault them in.

        Ahead of need (one thread: the warmer's pieces) the pages are allocated by writing zeros
        with ``pwrite``, then mapped here; inside a put, by ``posix_fallocate`` and faulted in by
        several threads at once (``pwrite`` is one thread's). A file made ahead so is cheaper to
        use for every other process: a trainer's first
        mapping of a 375 MB file took 12.6-12.8 ms against 20-23 ms for one allocated with
        ``posix_fallocate`` and faulted in (8 files, alternated), and a peer's first
        ``process_vm_readv`` of it (MPI's single copy) cost no more than later ones, against 15
        ms more. A reserved first put (bench cold's reserve phase alone, 3 trials each, 4
        virtual hosts, 1.5 GB) mapped its file in 9-27 ms against 24-69 and staged in 0.16-0.17
        s against 0.19-0.21. Making the file costs 15 % more CPU where fresh pages are cheap
        (0.354 against 0.308 s per GB, 256 MB files alternated) and no more where they are dear
        (2.6-2.9 against 2.8-3.0).
        """
        if end <= start:
            return
        fd = os.open(self.path(buf.name), os.O_RDWR)
        try:
            if threads == 1:
                zeros = _zeros()
                for off in range(start, end, len(zeros)):
                    n = min(len(zeros), end - off)
                    if os.pwrite(fd, zeros if n == len(zeros) else zeros[:n], off) != n:
                        raise OSError(errno.ENOSPC, f"short write allocating {buf.name}")
            elif hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, start, end - start)
        finally:
            os.close(fd)
        shm.prefault(buf.file.array[start:end], threads=threads, on_thread=self._helpers())

    def adopt_reserve(self) -> list[str]:
        """Take back the reserve files an earlier daemon left (no trainer ever mapped one)."""
        names = []
        d = self.dir / "data"
        for path in sorted(d.glob(f"{RESERVE}*")) if d.is_dir() else []:
            size = path.stat().st_size
            buf = self.adopt(path.name, size) if size else None
            if buf is not None:
                with self.lock:
                    self.adopted.discard(path.name)
                    self.free.add(path.name)
                names.append(path.name)
        return names

    def adopt(self, name: str, size: int) -> Buffer | None:
        """Map an existing file left by an earlier daemon; None if missing or shorter than size."""
        path = self.path(name)
        try:
            if path.stat().st_size < max(size, 1):
                return None
            f = shm.MappedFile(path)
        except (OSError, ValueError):
            return None
        buf = Buffer(name, f)
        with self.lock:
            self.files[name] = buf
            if not name.startswith("p"):
                self.adopted.add(name)
        return buf

    def _over(self, more: int) -> CapacityError:
        return CapacityError(
            f"{more} more bytes would exceed this host's --memory-budget of {self.budget} "
            f"({self.used} in use); raise the budget, lower --keep, or delete old steps. "
            "Nothing stored was touched."
        )

    def check(self, size: int, reserve: int = 0) -> None:
        """Raise the :class:`CapacityError` a take of ``size`` bytes (and ``reserve``) would
        raise for the budget, taking nothing (free files count as room: a take drops them)."""
        with self.lock:
            if self.budget is None:
                return
            free = sum(self.files[name].size for name in self.free)
            if self.used - free + max(size, 1) + reserve > self.budget:
                raise self._over(size + reserve)

    def fits(self, extra: int) -> bool:
        """Whether ``extra`` more bytes fit the budget now."""
        with self.lock:
            return self._fits(extra)

    def _fits(self, extra: int) -> bool:
        return self.budget is None or self.used + extra <= self.budget

    def get(self, name: str) -> Buffer:
        with self.lock:
            return self.files[name]

    def release(self, name: str | None) -> None:
        if name is None:
            return
        with self.lock:
            if name in self.adopted:
                self._drop(name)
            elif name in self.files:
                self.free.add(name)

    def cut(self) -> int:
        """Cut the files converted from larger reserve files to their size (their tails' pages
        go back to the system); the bytes given back. Safe while trainers map them: nobody
        touches a file past its size. The ftruncate runs outside the lock (0.05 s for 400 MB)."""
        freed = 0
        with self.lock:
            todo = [(n, self.files[n].size) for n in self.uncut if n in self.files]
        for name, size in todo:
            try:
                fd = os.open(self.path(name), os.O_RDWR)
            except FileNotFoundError:
                continue  # dropped meanwhile
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            with self.lock:
                freed += self.uncut.pop(name, 0)
        return freed

    def _drop(self, name: str) -> None:
        buf = self.files.pop(name)
        self.free.discard(name)
        self.uncut.pop(name, None)
        self.partial.pop(name, None)
        self.adopted.discard(name)
        self.claims.pop(name, None)
        buf.file.close()
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            pass

    def drop(self, name: str) -> None:
        with self.lock:
            if name in self.files:
                self._drop(name)

    def ahead(self) -> int:
        """Bytes of free files made ahead of need or freed by retention, waiting for a take:
        every free file but reserve ones (``--reserve``, bounded by itself)."""
        with self.lock:
            return sum(self.files[n].size for n in self.free if not n.startswith(RESERVE))

    def trim(self, wanted: dict[str, int], bound: int) -> int:
        """Drop free files (not reserve ones) that no take of ``wanted`` (prefix -> size) would
        be given, the largest first, while the free files add up to more than ``bound`` bytes:
        sizes a state no longer has are let go rather than kept for good. Returns the bytes
        dropped. A file being faulted in by the warmer is left alone."""
        dropped = 0
        with self.lock:
            free = sum(self.files[n].size for n in self.free if not n.startswith(RESERVE))
            stale = [
                n
                for n in self.free
                if not n.startswith(RESERVE)
                and n not in self.advancing
                and not any(
                    n.startswith(p) and _fits_size(size, self.files[n].size)
                    for p, size in wanted.items()
                )
            ]
            for name in sorted(stale, key=lambda n: (-self.files[n].size, n)):
                if free <= bound:
                    break
                size = self.files[name].size
                self._drop(name)
                free -= size
                dropped += size
        return dropped

    def sweep(self, keep: set[str]) -> list[str]:
        """Delete files under data/ and parity/ that are not in the pool nor in ``keep``."""
        removed = []
        for sub in ("data", "parity"):
            d = self.dir / sub
            if not d.is_dir():
                continue
            for path in d.iterdir():
                if path.name not in keep and path.name not in self.files:
                    path.unlink()
                    removed.append(path.name)
        return removed


_ZEROS: list[memoryview] = []


def _zeros() -> memoryview:
    """8 MiB of zeros, made once: what :meth:`Pool._fault` writes."""
    if not _ZEROS:
        _ZEROS.append(memoryview(bytes(_PIECE)))
    return _ZEROS[0]


def _fits_size(size: int, have: int) -> bool:
    """A file of ``have`` bytes serves a take of ``size`` (at most a quarter larger)."""
    return size <= have <= size + size // 4 + 4096
