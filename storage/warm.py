"""Shared memory made ahead of need: the files of the next puts, and ``--reserve``.

A fresh file of shared memory costs its first touch (about 1.5 GB/s here, 0.5 s per GB with the
two threads of :func:`transport.shm.prefault`), and a put that finds no free file of its size in
the pool pays that inside its put->protected: the first ``keep + 1`` puts after a start, until
retention frees files for reuse. The warmer makes those files before they are asked for, on a
thread of its own, one 8 MiB piece at a time and only while the host is idle (no shard being
staged, no step staging, ready or encoding, no trainer waiting to hear its step is protected:
live work always goes first):

- once a step has shards here (staged, or adopted after a restart), up to :data:`AHEAD` free
  files of each of their ranks' shard sizes, and of the host's parity size once the step is laid
  out (never more than the ``keep + 1`` of a size that steady state holds); free files of sizes
  no longer wanted are dropped past that bound (:meth:`storage.pool.Pool.trim`);
- ``--reserve BYTES``, made at start while nothing is known: reserve files of sizes halving from
  BYTES/2 down to 8 MiB, which :meth:`storage.pool.Pool.take` turns into the files it needs
  (renamed and grown, or cut here later: only the difference in size is faulted in then). A
  reserve file no take has used yet is turned into a wanted file when that costs fewer fresh
  pages than a new one.

Who calls it: the daemon starts it after adoption and closes it. It learns the sizes from the
catalog (the newest step with shards here) and owns its thread and the ``want`` table; it takes
the host's lock only to read the catalog and what is in flight.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from storage.catalog import StepState
from storage.cpu import charged
from storage.host import Host
from storage.pool import RESERVE, Buffer

__all__ = ["Warmer", "reserve_sizes"]

_MIN_RESERVE = 8 << 20
# Free files of each wanted size made ahead: the next two puts'. Steady state holds keep + 1
# files of a size (the kept steps and the one being put), and retention frees one for each put;
# only the first puts after a start, or after a size changed, find none, and making every one of
# the keep + 1 files ahead held the files of a thousand future puts at --keep 1000 (4,927 files,
# 13.8 GB for 80 MB of steps). So the warmer keeps AHEAD free files of each wanted size and makes
# no more, and free files of sizes no longer wanted are dropped once the free files add up to
# more than AHEAD times the wanted sizes (:meth:`Warmer.bound`).
AHEAD = 2
_LIVE = (StepState.STAGING, StepState.READY, StepState.ENCODING)


def reserve_sizes(total: int) -> list[int]:
    """Reserve files for ``total`` bytes: halving from total/2 while at least 8 MiB, and the rest
    (at least 8 MiB) as one more; a total under 16 MiB is one file."""
    sizes: list[int] = []
    left = total
    size = total // 2
    while size >= _MIN_RESERVE and left - size >= _MIN_RESERVE:
        sizes.append(size)
        left -= size
        size //= 2
    if left > 0:
        sizes.append(left)
    return sizes


class Warmer:
    """Makes the pool's files ahead of need, in idle time; see the module docstring."""

    def __init__(
        self, host: Host, reserve: int = 0, first: Callable[[], None] | None = None
    ) -> None:
        self.host = host
        self.reserve = reserve
        self.first = first  # made before anything else (the exchange's private rows)
        self.want: dict[str, int] = {}  # prefix -> size the next puts will take (see learn)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.reserving = bool(reserve)  # the reserve files are still being made

    # -- what the next puts will need -------------------------------------------------------------

    def learn(self) -> None:
        """What the next puts will take (:meth:`wanted`), for the thread to make."""
        self.want = self.wanted()

    def wanted(self) -> dict[str, int]:
        """Prefix -> size the next puts will take, from the newest step with shards here: each
        rank's shard size, and the host's parity size once the step is laid out."""
        h = self.host
        want: dict[str, int] = {}
        with h.lock:
            recs = sorted(h.catalog.steps.values(), key=lambda r: r.step, reverse=True)
            for rec in recs:
                mine = [(r, s) for r, s in rec.shards.items() if s.slot == h.slot]
                if not mine:
                    continue
                for rank, shard in mine:
                    want[f"r{rank}-"] = shard.nbytes
                if h.group.index in rec.layouts:
                    layout, pos = h.my_layout(rec)
                    want["p"] = len(layout.parity_stripes[pos]) * rec.chunk_bytes
                break
        return want

    def making(self, prefix: str) -> bool:
        """Whether files of ``prefix`` are still to be made ahead here: one is partial, or fewer
        than :attr:`target` of the wanted size exist and another fits. A trainer that maps the
        made ones ahead (``ahead`` requests) asks again until this is False. Any thread."""
        pool = self.host.pool
        size = self.wanted().get(prefix)
        if size is None or self._stop:
            return False
        with pool.lock:
            if any(n.startswith(prefix) for n in pool.partial):
                return True
        return not self.enough(prefix, size) and self._fits(size)

    @property
    def target(self) -> int:
        """Files of each wanted size at most, in use or free: the kept steps and the one being
        put."""
        return self.host.config.keep + 1

    def enough(self, prefix: str, size: int) -> bool:
        """Whether no more files of ``prefix`` at ``size`` are to be made ahead: :attr:`target`
        exist, or :data:`AHEAD` of them are free."""
        pool = self.host.pool
        return pool.count(prefix, size) >= self.target or pool.free_count(prefix, size) >= AHEAD

    def bound(self, want: dict[str, int] | None = None) -> int:
        """Bytes of free files (reserve ones aside) kept for the next puts: :data:`AHEAD` files
        of each wanted size. Free files of other sizes past it are dropped."""
        want = self.want if want is None else want
        return AHEAD * sum(want.values())

    def _fits(self, size: int) -> bool:
        return self.host.pool.fits(size) and self._room(size)

    def _room(self, size: int) -> bool:
        """The file system (a sized tmpfs) holds ``size`` more bytes, with 10 % to spare."""
        try:
            st = os.statvfs(self.host.dir)
        except OSError:
            return False
        return size <= st.f_bavail * st.f_frsize - st.f_blocks * st.f_frsize // 10

    # -- the thread -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ecsnap-warm", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        with self.host.cond:
            self.host.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def busy(self) -> bool:
        """Live work on this host: a shard being staged, a step staging, ready or encoding, or a
        trainer waiting to hear that its step is protected (the round that acknowledges it).

        Without the waiters, the first put after a start with ``--reserve`` was told of its
        protection 45-110 ms after every daemon had it: the warmers began at protection, and
        the acknowledging round waited for the cores and the GIL they held (4 virtual hosts on
        2 cores, 1.5 GB; later puts, with nothing to make, 1-5 ms)."""
        h = self.host
        with h.lock:
            if h.pending or h.stopping or h.waiters:
                return True
            return any(r.state in _LIVE for r in h.catalog.steps.values())

    def _pause(self) -> bool:
        """Wait until the host is idle; False once the daemon stops."""
        h = self.host
        h.cpu.flush()  # the thread's warm time so far shows on /metrics now
        with h.cond:
            while not self._stop and self.busy():
                h.cond.wait(0.1)  # the round engine notifies every round
        return not self._stop

    @charged("warm")
    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass  # a thread's niceness is a hint; idle-only is the rule that matters
        h = self.host
        try:
            if self.first is not None and self._pause():
                self.first()
            if self.reserve:
                try:
                    self._make_reserve()
                finally:
                    self.reserving = False
        except Exception as exc:  # never the daemon's end: puts make their own files
            self.reserving = False
            h.log(f"warm: making the reserve stopped: {type(exc).__name__}: {exc}")
        failing = 0  # failures in a row: out of descriptors or memory passes
        while not self._stop:
            try:
                if h.pool.uncut and self._pause():
                    h.pool.cut()  # the tails of reserve files the first puts took
                self.learn()
                h.pool.trim(self.want, self.bound())
                made = self._make_wanted()
                failing = 0
            except Exception as exc:  # never the daemon's end: puts make their own files
                if not failing:
                    h.log(
                        f"warm: making files ahead of need failed ({type(exc).__name__}: {exc}); "
                        "trying again in idle time"
                    )
                failing += 1
                made = False
            if failing:  # 1 s, doubling up to 5 s, between tries
                until = time.monotonic() + min(0.5 * (1 << min(failing, 4)), 5.0)
                with h.cond:
                    while not self._stop and time.monotonic() < until:
                        h.cond.wait(until - time.monotonic())
            elif not made:
                with h.cond:
                    h.cond.wait(0.5)  # notified every round

    def _make_reserve(self) -> None:
        """Reserve files for ``--reserve``, less what an earlier daemon left (taken back at
        adoption)."""
        h = self.host
        t0 = time.monotonic()
        had = h.pool.counters()["reserve_free_bytes"]
        made = 0
        for size in reserve_sizes(self.reserve - had) if self.reserve > had else []:
            if self._stop:
                return
            if not self._fits(size):
                h.log(f"warm: --reserve stopped at {had + made} bytes: the host holds no more")
                break
            if self.host.pool.make(size, RESERVE, self._pause) is None:
                break
            made += size
        with h.lock:
            h.stats["reserve_bytes"] = had + made
        h.log(
            f"warm: reserved {had + made} bytes of shared memory ({had} left by the last daemon, "
            f"{made} made in {time.monotonic() - t0:.2f} s)"
        )

    def _make_wanted(self) -> bool:
        """Make (or go on making) one wanted file, if one is missing; whether one was made."""
        pool = self.host.pool
        # the fewest first: the next put's files before the one after's; at equal counts
        # shard buffers before parity (a put stages its shards first, parity is taken once
        # every shard of the step is staged)
        for _, _, prefix, size in sorted(
            (pool.free_count(p, n), p == "p", p, n) for p, n in self.want.items()
        ):
            if self.enough(prefix, size):
                with pool.lock:
                    unfinished = [n for n in pool.partial if n.startswith(prefix)]
                if unfinished:  # paused by live work before: go on with it
                    return pool.advance(unfinished[0], self._pause)
                continue
            if not self._fits(size):
                continue
            if not self._pause():
                return False

            t0 = time.monotonic()
            if self._one(size, prefix) is not None:
                with self.host.lock:
                    self.host.stats["warm_files"] += 1
                    self.host.stats["warm_bytes"] += size
                if self.host.trace:
                    self.host.log(
                        f"warm: a {prefix} file of {size} B made ahead in "
                        f"{time.monotonic() - t0:.2f} s"
                    )
                return True
            return False
        return False

    def _one(self, size: int, prefix: str) -> Buffer | None:
        """A wanted file: from a reserve file if that faults in fewer pages, else a new one."""
        pool = self.host.pool
        return pool.from_reserve(size, prefix) or pool.make(size, prefix, self._pause)
