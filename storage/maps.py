"""A trainer's mappings of the shared-memory files its daemon gives (:class:`Maps`).

A file's first mapping in a process costs: ``MAP_POPULATE`` of 375 MB took 21-35 ms here (36-71
ms with four trainers mapping at once on 2 cores), against 8 ms for a file mapped before. So a
:class:`storage.Store` maps each file once and keeps the mapping for the file's later puts and
reads; its threads map ahead of need the files the daemon makes for its rank's next puts and,
with ``--reserve``, the reserve files claimed for its rank (*premaps*: a put whose file is one of
them, renamed, takes that mapping over), and let go of the files the daemon deleted, whose memory
the mappings alone would keep.

Who calls it: :class:`storage.Store` (its puts and gets, and the threads that map ahead). What it
owns: every mapping of one Store, behind one lock; a file is mapped by one thread at a time, and
another that wants it meanwhile waits for that mapping. Paths are as the daemon gives them;
:meth:`Maps.here` says where this process sees them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage.errors import StorageError
from transport import shm

__all__ = ["Maps"]


class Maps:
    """One Store's mappings; thread-safe. ``forget`` is told of each mapping let go (the CUDA
    registry of pinned host memory)."""

    def __init__(self, daemon_dir: str, local_dir: str, forget: Callable[[Any], None]) -> None:
        self._daemon_dir = daemon_dir  # the daemon's host directory as the daemon names it
        self._local_dir = local_dir  # ... and as this process sees it
        self._forget = forget
        self._lock = threading.Lock()
        self._maps: dict[str, shm.MappedFile] = {}
        self._mapping: dict[str, threading.Event] = {}  # paths being mapped, set once mapped
        # reserve files (--reserve) mapped before the first put, by the path they had then
        self.premaps: dict[str, shm.MappedFile] = {}
        self._closed = False

    def here(self, path: str) -> str:
        """A path the daemon gave, as this process sees it: the daemon's host directory may be
        mounted elsewhere here (a container, or a lab host's /dev/shm seen from outside).

        Raises :class:`StorageError` for a path outside the daemon's host directory (or one
        that climbs out of it): a trainer maps what the daemon names read-write and shared, so
        a daemon's reply never makes it map any other file."""
        clean = os.path.normpath(path)
        if clean != path or not path.startswith(self._daemon_dir + "/"):
            raise StorageError(
                f"the daemon named {path!r}, outside its host directory {self._daemon_dir}: "
                "refusing to map it"
            )
        return self._local_dir + path[len(self._daemon_dir) :]

    def map(self, path: str, size: int) -> shm.MappedFile:
        """The mapping of a file the daemon gave (``size`` bytes), made once and kept for the
        file's later puts and reads; a reserve file mapped before, renamed to ``path``, is taken
        over. Raises :class:`StorageError` once closed."""
        path = self.here(path)
        while True:
            with self._lock:
                if self._closed:
                    raise StorageError("this Store is closed")
                busy = self._mapping.get(path)
                if busy is None:
                    mf = self._maps.get(path)
                    # a restarted daemon may have deleted that file and made another under its
                    # name
                    if mf is not None and mf.size == size and mf.current():
                        return mf
                    done = self._mapping[path] = threading.Event()
                    old = self._maps.pop(path, None)
                    break
            busy.wait()
        try:
            if old is not None:
                self._forget(old.array)
                old.close()
            mf = self._from_premap(path, size) or shm.MappedFile(path, size, populate=True)
            with self._lock:
                if self._closed:
                    mf.close()
                    raise StorageError("this Store is closed")
                self._maps[path] = mf
            return mf
        finally:
            with self._lock:
                del self._mapping[path]
            done.set()

    def mapped(self, path: str, size: int) -> bool:
        """Whether ``path`` is mapped at ``size`` bytes already, or being mapped."""
        path = self.here(path)
        with self._lock:
            mf = self._maps.get(path)
            return (mf is not None and mf.size == size) or path in self._mapping

    def rank_maps(self, rank: int) -> set[str]:
        """The paths of the shard buffers of ``rank`` mapped here."""
        data = Path(self._local_dir) / "data"
        with self._lock:
            return {
                p
                for p in self._maps
                if Path(p).parent == data and Path(p).name.startswith(f"r{rank}-")
            }

    def unmap(self, paths: set[str]) -> None:
        """Let go of the mappings of ``paths`` (files the daemon deleted); views that a get
        returned keep theirs."""
        with self._lock:
            gone = [self._maps.pop(p) for p in paths if p in self._maps and p not in self._mapping]
        for mf in gone:
            self._forget(mf.array)
            mf.close()

    # -- reserve files mapped before the first put ------------------------------------------------

    def premap(self, path: str, size: int) -> bool:
        """Map the reserve file ``path`` (``size`` bytes) unless it is mapped so already; False
        once closed. A file gone meanwhile (taken and renamed, or dropped) is left alone: the
        put maps its own."""
        path = self.here(path)
        with self._lock:
            if path in self.premaps:
                return not self._closed
        try:
            mf = shm.MappedFile(path, size, populate=True)
        except (OSError, ValueError):
            return True
        with self._lock:
            closed = self._closed
            if not closed:
                self.premaps[path] = mf
        if closed:
            mf.close()
        return not closed

    def premapped(self, path: str, size: int = 0) -> str | None:
        """The path under which the reserve file now at ``path`` was mapped before the first
        put (at least ``size`` bytes of it), if it was."""
        with self._lock:
            if not self.premaps:
                return None
        try:
            st = os.stat(self.here(path))
        except OSError:
            return None
        with self._lock:
            for old, mf in self.premaps.items():
                if mf.inode == (st.st_dev, st.st_ino) and mf.size >= size:
                    return old
        return None

    def _from_premap(self, path: str, size: int) -> shm.MappedFile | None:
        """The mapping made before the first put of the reserve file the daemon renamed to
        ``path``, narrowed to ``size`` bytes; None if there is none, or the file grew past it
        (then it is let go, and the caller maps the file anew)."""
        old = self.premapped(path)
        if old is None:
            return None
        with self._lock:
            mf = self.premaps.pop(old, None)
        if mf is None:
            return None  # taken by another thread meanwhile
        if size > mf.size:
            mf.close()
            return None
        mf.follow(path, size)
        return mf

    def drop_premaps(self) -> None:
        """Let go of the reserve files mapped before the first put that no put took over."""
        with self._lock:
            gone, self.premaps = list(self.premaps.values()), {}
        for mf in gone:
            mf.close()

    def close(self) -> None:
        """Unmap everything; a file being mapped now is closed by its mapper."""
        with self._lock:
            self._closed = True
            gone = list(self._maps.values()) + list(self.premaps.values())
            self._maps.clear()
            self.premaps.clear()
        for mf in gone:
            mf.close()
