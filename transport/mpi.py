"""Moving bytes between daemons with mpi4py's buffer calls, never pickle.

Every wait polls nonblocking requests with short sleeps: MPICH's blocking calls spin a core,
and the daemons share the host's cores with training. Every wait has a timeout, because a dead
peer makes an mpich job hang or die (measured); :class:`PeerTimeoutError` is the signal.

Large buffers travel as pieces of at most ``piece_bytes`` (default 64 MiB, always < 2 GiB: MPI
counts are C ints), posted together so they pipeline; sender and receiver must cut alike, which
:func:`pieces` guarantees.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transport.errors import PeerTimeoutError

__all__ = ["Counters", "Gathering", "Links", "halt", "pieces", "single_copy_off"]

# Set once a peer is known dead (storage.watch): a call into MPI that touches a dead peer can
# crash inside MPI (seen under srun: a segmentation fault), so every thread that would make one
# parks instead while the process says why and exits.
_HALT = threading.Event()


def halt() -> None:
    """No MPI call from this process from now on: a thread about to make one sleeps for good."""
    _HALT.set()


def _check() -> None:
    while _HALT.is_set():
        time.sleep(3600)


DEFAULT_PIECE = 64 << 20
CONTROL_SPIN = 64  # polls a busy control wait makes before it naps (tens of us)
CONTROL_NAP = 0.0002  # ... and its naps then (a nap costs ~13 us of CPU here)
# Seconds a bulk receive spins with nothing arriving before it naps (the clock is read every 256
# polls, so it spins at least 512). A sender that is not sending yet is descheduled, encoding or
# copying, and a receiver that spins holds the core it waits for. Beside the demo's GPT training
# (4 ranks, 4 virtual hosts, 2 cores, a put every step, two alternated runs of 30 steps each)
# 0.1 ms took receive from 47-48 to 39 daemon CPU ms a step, and 0 ms to 38-39; 0.5 ms before.
# Without training (bench store --quick, two alternated runs): RS(3,1) receive 0.212-0.213 CPU s
# per protected GB against 0.228-0.234, DCP until written / put->protected 3.18-3.32 against
# 3.30-3.31.
TRANSFER_STALL = 0.0001
TRANSFER_NAP = 0.0002
SEND_NAP = 0.0002  # a bulk wait's sleep once only its sends are left
MAX_PIECE = (1 << 31) - 1
YAMA_PTRACE = Path("/proc/sys/kernel/yama/ptrace_scope")
CMA_VARIABLES = ("MPIR_CVAR_CH4_CMA_ENABLE", "MPIR_PARAM_CH4_CMA_ENABLE", "MPICH_CH4_CMA_ENABLE")


def pieces(nbytes: int, piece_bytes: int = DEFAULT_PIECE) -> list[tuple[int, int]]:
    """(offset, length) cuts of a buffer of ``nbytes``, each at most ``piece_bytes``."""
    piece_bytes = min(piece_bytes, MAX_PIECE)
    return [(o, min(piece_bytes, nbytes - o)) for o in range(0, nbytes, piece_bytes)]


@dataclass
class Counters:
    """Bytes moved by this daemon over MPI (payload only): point-to-point sent and received, and
    the results of collectives received (``gathered``: an allgather's whole result, a
    reduction's one vector)."""

    sent: int = 0
    received: int = 0
    gathered: int = 0


@dataclass
class Gathering:
    """An allgather of JSON objects in flight: its sizes are being exchanged."""

    payload: Any
    sizes: Any
    requests: list[Any]


class Links:
    """Point-to-point and small collective transfers on one communicator, with timeouts.

    Not thread-safe: one thread (the daemon's MPI engine) drives it.
    """

    def __init__(
        self, comm: Any, timeout: float, piece_bytes: int = DEFAULT_PIECE, poll: float = 0.0002
    ) -> None:
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        self.poll = poll
        self.counters = Counters()
        self._peer: dict[int, int] = {}  # id of a point-to-point request -> its peer
        self._receives: set[int] = set()  # ids of the receive requests among them
        self.name = "links"  # which communicator, for errors (the daemon names its two)
        # CPU accounting (storage.cpu.Clock or anything with its ``phase``): a wait is charged
        # to "polling", a bulk one (``transfer``) to "receive" then "send"
        self.clock: Any = None

    def wait(
        self,
        requests: Sequence[Any],
        what: str,
        timeout: float | None = None,
        busy: bool = False,
        nap: float | None = None,
        transfer: bool = False,
        arrived: Callable[[Any], None] | None = None,
    ) -> None:
        """Complete every request or raise :class:`PeerTimeoutError` after ``timeout``.

        MPI progresses a transfer only while some call into it runs, so a bulk receiver waits
        ``busy``: polling, with a ``sched_yield`` every 32 tries (measured between two ranks:
        9 GB/s; 5 GB/s yielding after every try; 0.5 GB/s sleeping between polls). Otherwise it
        sleeps between polls, from ``poll`` doubling up to 2 ms (small control messages, leaving
        the cores to training), or ``nap`` seconds every time (a bulk sender, whose transfer
        needs its progress often but not its whole core).

        A ``busy`` wait that is no ``transfer`` (a control message: a round's collectives)
        polls ``CONTROL_SPIN`` times, enough for peers that are in the round already, then naps
        ``CONTROL_NAP`` between polls: a peer that is not there yet is busy, or waits for a core,
        and a wait that spins takes the core it needs. Spinning for 0.5 ms instead (about 1-3 ms
        in fact: the clock was read every 1024 polls) made puts of 64 kB on 4 virtual hosts,
        2 cores, 41-47 ms put->protected against 35-41 ms napping, three runs each, alternated.

        A ``transfer`` (bulk bytes) waits for this side's receives first, ``busy`` ones spinning
        while pieces arrive and napping while none does (:meth:`_drain`); then for its sends
        alone, napping ``nap`` (default ``SEND_NAP``) between polls: a sender that spins takes
        the core its receivers copy with (bench store --quick, 4 virtual hosts on 2 cores: CPU
        per protected GB in sends 0.36 -> 0.13 s, put->protected 0.212 -> 0.171 s).

        With a ``clock``, the wait's CPU time is charged to ``polling``; a transfer's to
        ``receive``, then ``send``.

        ``arrived`` is called with each receive of a ``busy`` transfer as the wait sees it
        complete, while the bytes MPI has just copied are in this core's cache; a wait that is not
        ``busy`` does not call it.
        """
        if not requests:
            return
        reqs = list(requests)
        limit = self.timeout if timeout is None else timeout
        now = time.monotonic()
        deadline = now + limit
        try:
            if not transfer:
                spin = CONTROL_SPIN if busy else 0
                with self._phase("polling"):
                    self._wait(reqs, what, limit, deadline, nap, spin)
                return
            # testing the receives alone progresses the sends too (MPI progress is global)
            receives = [r for r in reqs if id(r) in self._receives]
            with self._phase("receive"):
                if busy:
                    self._drain(receives, what, limit, deadline, arrived)
                else:
                    self._wait(receives, what, limit, deadline, nap)
            if len(receives) < len(reqs):  # sends left to wait for
                with self._phase("send"):
                    self._wait(reqs, what, limit, deadline, SEND_NAP if nap is None else nap)
        finally:
            for r in reqs:
                self._peer.pop(id(r), None)
                self._receives.discard(id(r))

    def _wait(
        self,
        reqs: list[Any],
        what: str,
        limit: float,
        deadline: float,
        nap: float | None,
        spin: int = 0,
    ) -> None:
        """Poll ``reqs`` until done: ``spin`` polls in a row, then sleeping between polls: ``nap``
        seconds, or from ``poll`` doubling up to ``CONTROL_NAP`` after a spin, else up to 2 ms
        (see :meth:`wait`)."""
        from mpi4py import MPI

        if not reqs:
            return
        sleep = self.poll if nap is None else nap
        longest = CONTROL_NAP if spin else 0.002
        tries = 0
        left = len(reqs)
        while not MPI.Request.Testall(reqs):
            _check()
            tries += 1
            if tries <= spin:
                continue
            if time.monotonic() > deadline:
                # requests still completing (a bulk send's pieces): the limit counts from the
                # last one, as a receive's does (see _drain)
                now_left = sum(1 for r in reqs if not r.Test())
                if now_left < left:
                    left = now_left
                    deadline = time.monotonic() + limit
                    continue
                raise self._timed_out(reqs, what, limit)
            time.sleep(sleep)
            sleep = nap if nap is not None else min(sleep * 2, longest)

    def _phase(self, name: str) -> Any:
        return contextlib.nullcontext() if self.clock is None else self.clock.phase(name)

    def _drain(
        self,
        reqs: list[Any],
        what: str,
        limit: float,
        deadline: float,
        arrived: Callable[[Any], None] | None = None,
    ) -> None:
        """A busy wait for bulk receives that naps while nothing arrives: spinning while pieces
        complete, ``TRANSFER_NAP`` sleeps once none has for ``TRANSFER_STALL`` (the sender is not
        sending yet: encoding, copying, or waiting for a core). ``arrived`` gets each request as
        it completes (see :meth:`wait`)."""
        from mpi4py import MPI

        pending = list(reqs)
        tries = 0
        stalled: float | None = None
        napping = False
        while pending:
            _check()
            done = MPI.Request.Testsome(pending)
            if done is None:
                if arrived is not None:  # every request was complete already
                    for r in pending:
                        arrived(r)
                return
            if done:
                if arrived is not None:
                    for i in done:
                        arrived(pending[i])
                gone = set(done)
                pending = [r for i, r in enumerate(pending) if i not in gone]
                tries, stalled, napping = 0, None, False
                # a transfer that moves is healthy however long it takes (a rebuild of a
                # large step runs in one wait): the limit counts from its last piece
                deadline = max(deadline, time.monotonic() + limit)
                continue
            if napping:
                if time.monotonic() > deadline:
                    raise self._timed_out(reqs, what, limit)
                time.sleep(TRANSFER_NAP)
                continue
            tries += 1
            if tries & 31 == 0:
                os.sched_yield()
            if tries & 255:
                continue
            now = time.monotonic()
            if now > deadline:
                raise self._timed_out(reqs, what, limit)
            if stalled is None:
                stalled = now
            elif now - stalled > TRANSFER_STALL:
                napping = True  # until a piece arrives

    def _timed_out(self, reqs: list[Any], what: str, limit: float) -> PeerTimeoutError:
        silent = [self._peer[id(r)] for r in reqs if id(r) in self._peer and not r.Test()]
        exc = PeerTimeoutError(
            f"daemon {self.rank}: {what} did not complete within {limit:.1f}s; a peer "
            "daemon is dead, stuck or unreachable. The storage job must be relaunched; "
            "state stays on disk.",
            sorted(set(silent)),
        )
        exc.links = self.name
        return exc

    def wait_any(self, groups: dict[Any, list[Any]], what: str, nap: float) -> list[Any]:
        """Wait until some groups of requests have all completed; remove them from ``groups``
        and return their keys. Polls every ``nap`` seconds (yielding the core); raises
        :class:`PeerTimeoutError` when none completes within the timeout."""
        from mpi4py import MPI

        deadline = time.monotonic() + self.timeout
        while True:
            _check()
            done = [key for key, reqs in groups.items() if MPI.Request.Testall(reqs)]
            if done:
                for key in done:
                    for r in groups.pop(key):
                        self._peer.pop(id(r), None)
                        self._receives.discard(id(r))
                return done
            if time.monotonic() > deadline:
                raise self._timed_out([r for g in groups.values() for r in g], what, self.timeout)
            time.sleep(nap)

    def isend(self, buf: Any, dest: int, tag: int) -> list[Any]:
        """Post the sends of ``buf`` (a contiguous buffer) to ``dest`` in pieces."""
        _check()
        view = _bytes(buf)
        self.counters.sent += view.nbytes
        reqs = [
            self.comm.Isend([view[o : o + n], n, _byte()], dest=dest, tag=tag)
            for o, n in pieces(view.nbytes, self.piece_bytes)
        ]
        self._peer.update((id(r), dest) for r in reqs)
        return reqs

    def irecv(self, buf: Any, source: int, tag: int) -> list[Any]:
        """Post the receives into ``buf`` (writable, contiguous) from ``source``, cut as sent."""
        _check()
        view = _bytes(buf)
        self.counters.received += view.nbytes
        reqs = [
            self.comm.Irecv([view[o : o + n], n, _byte()], source=source, tag=tag)
            for o, n in pieces(view.nbytes, self.piece_bytes)
        ]
        self._peer.update((id(r), source) for r in reqs)
        self._receives.update(id(r) for r in reqs)
        return reqs

    def allgather_json(
        self, obj: Any, what: str = "allgather", timeout: float | None = None, busy: bool = False
    ) -> list[Any]:
        """Every daemon's ``obj`` (JSON-serialisable), in rank order."""
        g = self.start_allgather_json(obj)
        self.wait(g.requests, what + " (sizes)", timeout, busy)
        return self.finish_allgather_json(g, what, timeout, busy)

    def start_allgather_json(self, obj: Any) -> Gathering:
        """Post the first half of :meth:`allgather_json` (the sizes), to be waited on with other
        requests; :meth:`finish_allgather_json` completes it once they are done."""
        _check()
        payload = np.frombuffer(json.dumps(obj, separators=(",", ":")).encode(), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([payload.nbytes], dtype=np.int64)
        return Gathering(payload, sizes, [self.comm.Iallgather(mine, sizes)])

    def finish_allgather_json(
        self, g: Gathering, what: str, timeout: float | None = None, busy: bool = False
    ) -> list[Any]:
        """The objects of a gathering whose sizes have arrived, in rank order."""
        sizes, payload = g.sizes, g.payload
        total = int(sizes.sum())
        out = np.empty(max(total, 1), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        counts = sizes.astype(np.int64)
        _check()
        req = self.comm.Iallgatherv(
            [payload, payload.nbytes, _byte()],
            [out, (counts.tolist(), displs.tolist()), _byte()],
        )
        self.wait([req], what, timeout, busy)
        self.counters.gathered += total + sizes.nbytes
        return [
            json.loads(out[int(d) : int(d) + int(c)].tobytes()) if c else None
            for d, c in zip(displs, counts, strict=True)
        ]

    def start_allreduce(self, values: Any, op: str) -> tuple[list[Any], Any]:
        """Post a reduction of the int64 vector ``values`` over every rank (``op`` "sum" or
        "max"); returns the requests to wait on and the array the result lands in."""
        from mpi4py import MPI

        _check()
        out = np.empty_like(values)
        req = self.comm.Iallreduce(values, out, op=MPI.SUM if op == "sum" else MPI.MAX)
        self.counters.gathered += out.nbytes
        return [req], out

    def max_of(self, value: int, what: str, timeout: float | None = None) -> int:
        """The largest ``value`` any rank gives (a reduction of one int64; every rank calls it,
        with ``timeout`` as :meth:`wait`'s)."""
        reqs, out = self.start_allreduce(np.array([value], dtype=np.int64), "max")
        self.wait(reqs, what, timeout)
        return int(out[0])

    def silent_peers(self, timeout: float, tag: int = 99) -> list[int]:
        """The ranks that do not answer a ping within ``timeout`` seconds (the failure path:
        after a collective timed out, which cannot say who is missing). Every rank that calls
        this pings every other and answers theirs; a rank cut off, stopped or dead does not."""
        from mpi4py import MPI

        _check()
        others = [r for r in range(self.size) if r != self.rank]
        out = np.ones(1, dtype=np.uint8)
        inbox = {r: np.zeros(1, dtype=np.uint8) for r in others}
        sends = [self.comm.Isend([out, 1, _byte()], dest=r, tag=tag) for r in others]
        recvs = {r: self.comm.Irecv([inbox[r], 1, _byte()], source=r, tag=tag) for r in others}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not MPI.Request.Testall(list(recvs.values())):
            time.sleep(0.005)
        silent = [r for r, req in recvs.items() if not req.Test()]
        for req in [*sends, *(recvs[r] for r in silent)]:
            try:
                req.Cancel()
            except Exception:  # a send may not be cancellable once matched; the job aborts
                pass
        return silent

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        _check()
        self.wait([self.comm.Ibarrier()], what, timeout)


def _bytes(buf: Any) -> Any:
    """A flat uint8 view of a contiguous buffer, no copy."""
    view = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return view.reshape(-1).view(np.uint8)


def _byte() -> Any:
    from mpi4py import MPI

    return MPI.BYTE


def single_copy_off(
    library: str, environ: Mapping[str, str] = os.environ, yama: Path = YAMA_PTRACE
) -> tuple[str, str] | None:
    """Why MPICH (``library``: ``MPI.Get_library_version()``) moves bulk bytes between the
    processes of one machine in two copies, and what turns its single-copy path on; None where
    nothing says it does.

    MPICH's single-copy path (CMA: the receiver reads the sender's memory with
    ``process_vm_readv``) needs ptrace permission between the processes, so MPICH turns it off
    where the kernel's Yama ``ptrace_scope`` is not 0 (Ubuntu's default is 1), as it does when
    ``MPIR_CVAR_CH4_CMA_ENABLE=0`` is set. Its other path copies every byte twice, through shared
    memory cells, and a message moves only while both sides poll: between virtual hosts on
    2 cores (4 daemons, RS(3,1)) a put of 1.5 GB took 13-15 s instead of 0.6 s, and one of 100
    MB 0.7 s instead of 0.07 s (``MPIR_CVAR_CH4_CMA_ENABLE`` set to 0 and then 1, alternated).
    Between real hosts the bytes go over the network, and none of this applies.
    """
    if "MPICH" not in library:
        return None
    for name in CMA_VARIABLES:
        value = environ.get(name, "").strip().lower()
        if value in ("0", "no", "false", "off"):
            return f"{name}={environ[name]} is set", f"unset {name} to use it"
    try:
        scope = yama.read_text().strip()
    except OSError:  # no Yama: nothing restricts ptrace beyond the usual same-user rule
        return None
    if scope != "0":
        return (
            f"kernel.yama.ptrace_scope is {scope}",
            "`sudo sysctl kernel.yama.ptrace_scope=0` allows it until the next boot, where the "
            "machine's owner accepts that",
        )
    return None
