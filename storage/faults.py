"""Fault injection for the tests and the fault matrix (as FTI's ``[injection]`` section).

The daemon builds one :class:`Hooks` from the spec that ``ECSNAP_FAULTS`` holds (read by
``ecsnap serve`` at start, never by a library module) and uses what it hands out: phase hooks it
calls at its named phases (:meth:`Hooks.phase`), and, in place of the real link layer and pool,
wrappers over their interfaces that fail as asked (:class:`FaultyLinks`, :class:`FaultyPool`).
With no faults named, the daemon gets the real :class:`~transport.mpi.Links` and
:class:`~storage.pool.Pool` and every phase hook returns at once.

A spec is a comma-separated list of faults, each ``KIND@POINT`` with ``:key=value`` options::

    ECSNAP_FAULTS="kill@encoding:host=host2:nth=3"     SIGKILL host2's daemon the 3rd time it
                                                        reaches the encoding phase
    ECSNAP_FAULTS="drop@send:host=host1:peer=2:nth=5"  host1 never sends its 5th bulk message
                                                        to MPI rank 2
    ECSNAP_FAULTS="delay@send:nth=1:seconds=2"         every daemon holds its 1st bulk send 2 s
    ECSNAP_FAULTS="enospc@alloc:host=host0"            host0's next shared-memory allocation
                                                        fails as if /dev/shm were full
    ECSNAP_FAULTS="delay@serving:host=host0:seconds=3"  host0 holds its 1st local read 3 s
                                                        between checking a shard and replying
    ECSNAP_FAULTS="delay@persisting:host=host0:seconds=3"  host0's disk writer holds its 1st
                                                        step 3 s before it checks and writes it

Points: ``staging`` (a trainer's allocation), ``encoding``, ``sending`` (bulk sends of a step
posted), ``committing`` (a step protected, its manifest about to be written), ``retiring``
(the files of a step retention or a delete dropped about to go), ``rebuilding``
(a repair about to move chunks), ``serving`` (a read of a shard held here, checked and about
to be answered), ``persisting`` (the disk writer about to check and write a step), ``send``
(one bulk MPI message), ``alloc`` (one shared-memory buffer taken from the pool). Kinds:
``kill`` (any point), ``drop`` (``send``), ``delay`` (``send``, ``serving``, ``persisting``,
``rebuilding``), ``enospc`` (``alloc``). ``nth`` counts that point's hits in this process
(default 1); each fault fires once, and says so on stderr (``injected fault: KIND@POINT``).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.errors import CapacityError
from storage.pool import Buffer, Pool
from transport.mpi import Links

__all__ = ["Fault", "FaultSpecError", "FaultyLinks", "FaultyPool", "Hooks", "parse"]

KINDS = {
    "kill": {
        "staging",
        "encoding",
        "sending",
        "committing",
        "retiring",
        "rebuilding",
        "send",
        "alloc",
    },
    "drop": {"send"},
    "delay": {"send", "serving", "persisting", "rebuilding"},
    "enospc": {"alloc"},
}


class FaultSpecError(ValueError):
    """``ECSNAP_FAULTS`` does not parse."""


@dataclass
class Fault:
    kind: str
    point: str
    host: str | None = None
    peer: int | None = None
    nth: int = 1
    seconds: float = 1.0
    hits: int = 0
    fired: bool = False


def parse(spec: str | None) -> list[Fault]:
    """The faults of ``spec``; raises :class:`FaultSpecError` naming the bad part."""
    out: list[Fault] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        head, *opts = part.split(":")
        kind, _, point = head.partition("@")
        if kind not in KINDS or point not in KINDS[kind]:
            raise FaultSpecError(
                f"fault {part!r}: KIND@POINT must be one of "
                + ", ".join(f"{k}@{'|'.join(sorted(v))}" for k, v in KINDS.items())
            )
        f = Fault(kind, point)
        for opt in opts:
            key, _, value = opt.partition("=")
            try:
                if key == "host":
                    f.host = value
                elif key == "peer":
                    f.peer = int(value)
                elif key == "nth":
                    f.nth = int(value)
                elif key == "seconds":
                    f.seconds = float(value)
                else:
                    raise FaultSpecError(f"fault {part!r}: unknown option {key!r}")
            except ValueError as exc:
                raise FaultSpecError(f"fault {part!r}: bad value for {key}: {exc}") from exc
        if f.nth < 1:
            raise FaultSpecError(f"fault {part!r}: nth counts from 1")
        out.append(f)
    return out


class Hooks:
    """The faults one daemon process runs; thread-safe enough for its one MPI thread and its
    allocating request threads (a hit is counted under the GIL)."""

    def __init__(self, faults: list[Fault] | None = None) -> None:
        self.faults = list(faults or [])

    @classmethod
    def from_spec(cls, spec: str | None) -> Hooks:
        return cls(parse(spec))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def hit(self, point: str, host: str, peer: int | None = None) -> str | None:
        """Count a hit of ``point`` on ``host``; run a fault that falls due. Returns ``"drop"``
        or ``"enospc"`` for the caller to act on, else None (``kill`` never returns)."""
        for f in self.faults:
            if f.fired or f.point != point or (f.host is not None and f.host != host):
                continue
            if f.peer is not None and peer != f.peer:
                continue
            f.hits += 1
            if f.hits != f.nth:
                continue
            f.fired = True
            line = f"ecsnap[{host}] injected fault: {f.kind}@{point} (hit {f.hits})\n"
            os.write(2, line.encode())
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "delay":
                time.sleep(f.seconds)
                return None
            return f.kind
        return None

    def phase(self, point: str, host: str) -> None:
        """The daemon of ``host`` reached phase ``point``."""
        if self.faults:
            self.hit(point, host)

    def make_pool(self, directory: Path, budget: int | None) -> Pool:
        if any(f.point == "alloc" for f in self.faults):
            return FaultyPool(directory, budget, self)
        return Pool(directory, budget)

    def make_links(self, comm: Any, timeout: float, host: str) -> Links:
        if any(f.point == "send" for f in self.faults):
            return FaultyLinks(comm, timeout, self, host)
        return Links(comm, timeout=timeout)


class FaultyPool(Pool):
    """A :class:`Pool` whose ``take`` fails as a full /dev/shm would, when a fault says so."""

    def __init__(self, directory: Path, budget: int | None, hooks: Hooks) -> None:
        super().__init__(directory, budget)
        self.hooks = hooks

    def take(self, size: int, prefix: str, reserve: int = 0) -> Buffer:
        if self.hooks.hit("alloc", self.dir.name) == "enospc":
            exc = OSError(errno.ENOSPC, "No space left on device (injected fault)")
            raise CapacityError(
                f"cannot allocate {max(size, 1)} bytes of shared memory: {exc}"
            ) from exc
        return super().take(size, prefix, reserve)


class FaultyLinks(Links):
    """:class:`Links` whose bulk sends are dropped or held, when a fault says so."""

    def __init__(self, comm: Any, timeout: float, hooks: Hooks, host: str) -> None:
        super().__init__(comm, timeout=timeout)
        self.hooks = hooks
        self.host = host

    def isend(self, buf: Any, dest: int, tag: int) -> list[Any]:
        if self.hooks.hit("send", self.host, dest) == "drop":
            return []  # the peer waits for a message that never comes
        return super().isend(buf, dest, tag)
