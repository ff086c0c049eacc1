"""A host's shared-memory files: shard buffers (``data/``) and parity (``parity/``), reused.

Every file is created pre-faulted by the daemon and handed to trainers by name; a file freed by
retention goes back to the pool and is reused by a later step of similar size, so steady-state
puts never touch fresh pages. ``used`` counts every file, in use or free, against the host's
budget; free files are dropped before a request is refused.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from storage.errors import CapacityError
from transport import shm

__all__ = ["Buffer", "Pool"]


@dataclass
class Buffer:
    name: str
    file: shm.MappedFile

    @property
    def size(self) -> int:
        return self.file.size


class Pool:
    """Thread-safe. Parity file names start with ``p``, shard buffers with ``r<rank>-``."""

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
        self._seq = 0
        # in every name, so that no later daemon (even one with this pid) makes a name again
        self._tag = secrets.token_hex(3)

    @property
    def used(self) -> int:
        return sum(b.size for b in self.files.values())

    def path(self, name: str) -> Path:
        return self.dir / ("parity" if name.startswith("p") else "data") / name

    def take(self, size: int, prefix: str, reserve: int = 0) -> Buffer:
        """A pre-faulted file of at least ``size`` bytes (a free one of similar size if any).

        ``reserve`` is memory the caller needs soon after (parity): it must fit too. Raises
        :class:`CapacityError` when the budget or the file system cannot hold it.
        """
        with self.lock:
            best = None
            for name in self.free:
                b = self.files[name]
                fits = size <= b.size <= size + size // 4 + 4096
                if name.startswith(prefix) and fits and (best is None or b.size < best.size):
                    best = b
            if best is not None and self._fits(reserve):
                self.free.discard(best.name)
                return best
            need = max(size, 1)
            if not self._fits(need + reserve):
                for name in sorted(self.free, key=lambda n: -self.files[n].size):
                    self._drop(name)
                    if self._fits(need + reserve):
                        break
            if not self._fits(need + reserve):
                raise CapacityError(
                    f"{size + reserve} more bytes would exceed this host's --memory-budget of "
                    f"{self.budget} ({self.used} in use); raise the budget, lower --keep, or "
                    "delete old steps. Nothing stored was touched."
                )
            while True:
                # Never an existing file's name: a daemon relaunched with an earlier one's pid
                # (a container's pids start over) wrote over the files it adopted from it. The
                # tag makes that unlikely; this check and O_EXCL make it impossible.
                self._seq += 1
                name = f"{prefix}{os.getpid()}-{self._tag}-{self._seq}"
                if name not in self.files and not self.path(name).exists():
                    break
        try:
            f = shm.create(self.path(name), need, exclusive=True)
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
        return buf

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

    def _drop(self, name: str) -> None:
        buf = self.files.pop(name)
        self.free.discard(name)
        self.adopted.discard(name)
        buf.file.close()
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            pass

    def drop(self, name: str) -> None:
        with self.lock:
            if name in self.files:
                self._drop(name)

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
