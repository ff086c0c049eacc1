"""Fault injection, off unless ``ECSNAP_FAULTS`` is set (as FTI's ``[injection]`` section).

A spec is a comma-separated list of faults, each ``KIND@POINT`` with ``:key=value`` options::

    ECSNAP_FAULTS="kill@encoding:host=host2:nth=3"     SIGKILL host2's daemon the 3rd time it
                                                        reaches the encoding phase
    ECSNAP_FAULTS="drop@send:host=host1:peer=2:nth=5"  host1 never sends its 5th bulk message
                                                        to MPI rank 2
    ECSNAP_FAULTS="delay@send:nth=1:seconds=2"         every daemon holds its 1st bulk send 2 s
    ECSNAP_FAULTS="enospc@alloc:host=host0"            host0's next shared-memory allocation
                                                        fails as if /dev/shm were full

Points: ``staging`` (a trainer's allocation), ``encoding``, ``sending`` (bulk sends of a step
posted), ``committing`` (a step protected, its manifest about to be written), ``rebuilding``
(a repair about to move chunks), ``send`` (one bulk MPI message), ``alloc`` (one shared-memory
file). Kinds: ``kill`` (any point), ``drop`` and ``delay`` (``send``), ``enospc`` (``alloc``).
``nth`` counts that point's hits in this process (default 1); each fault fires once.

Off, the cost is one module attribute test per call site (``if faults.ACTIVE:``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

__all__ = ["ACTIVE", "Fault", "FaultSpecError", "hit", "parse"]

KINDS = {
    "kill": {"staging", "encoding", "sending", "committing", "rebuilding", "send", "alloc"},
    "drop": {"send"},
    "delay": {"send"},
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


FAULTS: list[Fault] = parse(os.environ.get("ECSNAP_FAULTS"))
ACTIVE: bool = bool(FAULTS)


def hit(point: str, host: str, peer: int | None = None) -> str | None:
    """Count a hit of ``point`` on ``host``; run a fault that falls due. Returns ``"drop"`` or
    ``"enospc"`` for the caller to act on, else None (``kill`` never returns)."""
    for f in FAULTS:
        if f.fired or f.point != point or (f.host is not None and f.host != host):
            continue
        if f.peer is not None and peer != f.peer:
            continue
        f.hits += 1
        if f.hits != f.nth:
            continue
        f.fired = True
        print(f"ecsnap[{host}] injected fault: {f.kind}@{point} (hit {f.hits})", file=sys.stderr)
        sys.stderr.flush()
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "delay":
            time.sleep(f.seconds)
            return None
        return f.kind
    return None
