"""CPU seconds by phase: where a daemon's (and its trainers') cores go.

Each thread times itself with its own CPU clock (``CLOCK_THREAD_CPUTIME_ID``): a phase entered
inside another pauses the outer one, so every CPU second lands in exactly one phase, the
innermost. What no phase claims (start-up, MPI's own threads, metrics scrapes, the garbage
collector) is ``other``: the process's CPU time less the phases', so the phases add up to what
the kernel charged the daemon. Trainers time their staging copy and their hashing the same way and
send them with ``staged``; the daemon adds them under ``stage`` and ``hash`` (not part of its own
process time).

The phases (``ecsnap_cpu_seconds_total{phase}``):

- ``stage``, ``hash``: the trainer's copy into shared memory; its digests of leaves that may be
  unchanged (incremental puts);
- ``checksum``: CRCs of data and parity chunks;
- ``encode``: ISA-L encoding, the codec's helper threads included (``repair``'s decoding is
  under ``repair``);
- ``receive``, ``send``: bulk bytes over MPI (a wait while this daemon's receives are
  outstanding, then while only its sends are), with any spinning while they move;
- ``exchange``: the rest of an exchange: posting transfers (MPI copies in a message that
  arrived before its receive was posted right then), the window bookkeeping;
- ``polling``: waiting for the other daemons in a round's collectives;
- ``rounds``: the round engine's own work (events, ballots, the catalog, manifests);
- ``serve``: answering trainers (the socket threads);
- ``memory``: fresh shared memory faulted in during live work; ``warm``: ahead of need;
- ``repair``, ``fetch``, ``persist``: rebuilds and scrubs; reads served from another host; the
  persistent tier's writer;
- ``other``: the rest of the daemon's process time.

Thread-safe: each thread keeps its own stack; the totals are behind a lock.
"""

from __future__ import annotations

import functools
import resource
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["PHASES", "TRAINER", "Clock", "charged"]

F = TypeVar("F", bound=Callable[..., Any])

TRAINER = ("stage", "hash")
PHASES = (
    *TRAINER,
    "checksum",
    "encode",
    "receive",
    "send",
    "exchange",
    "polling",
    "rounds",
    "serve",
    "memory",
    "warm",
    "repair",
    "fetch",
    "persist",
    "other",
)


def process_seconds() -> float:
    """User + system CPU time of this process, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Clock:
    """CPU seconds per phase of one process (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._local = threading.local()
        self._phases = {name: _Phase(self, name) for name in PHASES}

    def phase(self, name: str) -> _Phase:
        """A context manager: charge this thread's CPU time to ``name`` until the block ends (an
        enclosing phase is paused meanwhile). Nests, on any thread.

        A class, not a generator: an exchange enters a phase for each chunk it checksums, and
        ``contextlib.contextmanager``'s generator cost 3.9 us a nested phase here against
        2.0 us."""
        p = self._phases.get(name)
        if p is None:
            raise ValueError(f"unknown CPU phase {name!r}; known: {', '.join(PHASES)}")
        return p

    def _stack(self) -> list[_Frame]:
        try:
            stack: list[_Frame] = self._local.stack
        except AttributeError:
            stack = self._local.stack = []
        return stack

    def _enter(self, name: str) -> None:
        stack = self._stack()
        now = time.thread_time()
        if stack:
            self._charge(stack[-1], now)
        stack.append(_Frame(name, now))

    def _exit(self) -> None:
        stack = self._local.stack
        now = time.thread_time()
        self._charge(stack.pop(), now)
        if stack:
            stack[-1].since = now  # the enclosing phase resumes

    def _charge(self, frame: _Frame, now: float) -> None:
        with self._lock:
            self._seconds[frame.name] += now - frame.since
        frame.since = now

    def flush(self) -> None:
        """Charge this thread's running phase up to now (a phase that runs for a thread's whole
        life, such as the warmer's, would otherwise show only when the thread ends)."""
        stack = self._stack()
        if stack:
            self._charge(stack[-1], time.thread_time())

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` measured elsewhere (a trainer's, a helper thread's) to ``name``."""
        if name not in self._seconds:
            raise ValueError(f"unknown CPU phase {name!r}; known: {', '.join(PHASES)}")
        with self._lock:
            self._seconds[name] += seconds

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far; ``other`` is the process time no phase of this process
        claimed, start-up included (never negative: phases still running are charged when they
        end)."""
        with self._lock:
            out = dict(self._seconds)
        mine = sum(v for k, v in out.items() if k not in TRAINER and k != "other")
        out["other"] = max(0.0, process_seconds() - mine)
        return out


class _Phase:
    """``with clock.phase(name)``: holds no state of its own (the stack is per thread), so one
    object per phase serves every thread and every nesting."""

    __slots__ = ("_clock", "_name")

    def __init__(self, clock: Clock, name: str) -> None:
        self._clock = clock
        self._name = name

    def __enter__(self) -> None:
        self._clock._enter(self._name)

    def __exit__(self, *exc: object) -> None:
        self._clock._exit()


class _Frame:
    """A phase running on a thread: its name and when it was last charged (thread CPU time)."""

    __slots__ = ("name", "since")

    def __init__(self, name: str, since: float) -> None:
        self.name = name
        self.since = since


def charged(phase: str) -> Callable[[F], F]:
    """A method of a daemon module (an object with ``host``) whose CPU time is ``phase``'s, less
    the phases entered inside it."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.host.cpu.phase(phase):
                return method(self, *args, **kwargs)

        return cast(F, timed)

    return decorate
