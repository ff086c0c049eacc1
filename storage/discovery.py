"""Finding a job's daemons from a trainer: which host directory a rank talks to, which jobs ran
under a root, which daemons answer now. Used by :func:`storage.connect` and by the Store's
errors; reads the directories only, never the daemons' state."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from storage.config import check_name
from storage.errors import DaemonUnavailableError
from transport import control

__all__ = ["alive", "answering", "ended", "env_int", "host_of", "jobs"]


def process_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (``[0]`` the state letter,
    ``[19]`` the start time in clock ticks since boot), or None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def alive(health: dict[str, Any]) -> bool:
    """Whether the process ``health.json`` names still runs on this machine: its pid, with the
    start time it wrote (a later process given the same pid is another)."""
    pid, start = health.get("pid"), health.get("pid_start")
    if not isinstance(pid, int) or pid <= 0:
        return False
    fields = process_stat(pid)
    if fields is None or fields[0] == "Z":
        return False  # gone, or exited and not yet reaped
    return start is None or int(fields[19]) == start


def ended(host_dir: Path) -> str | None:
    """What a host's ``health.json`` says of a daemon that no longer runs (its pid gone), or
    None: no such file, or its daemon is alive."""
    try:
        health = json.loads((host_dir / "health.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(health, dict) or alive(health):
        return None
    said = health.get("health")
    why = f"; its health.json says {said!r}" if said not in (None, "healthy") else ""
    if health.get("reason"):
        why += f": {health['reason']}"
    return f"pid {health.get('pid')}{why}"


def env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


# a job directory appears within a second or two of the daemons' launch; past this, a job that
# has no directory never ran here (a typo, or another --root)
_NEW_JOB_GRACE = 5.0


def host_of(job: str, root: Path, rank: int, given: str | None, timeout: float) -> str:
    """The host whose daemon rank ``rank`` talks to: ``given`` (``host=`` or ``ECSNAP_HOST``),
    else this machine's hostname, else, on a machine whose daemons run ``--virtual-hosts``,
    virtual host ``rank % H`` in the order the daemons name them. Waits (within ``timeout``)
    for the job's directory; fails fast, naming the jobs under ``root``, when none appears."""
    if given:
        check_name("host", given)
    machine = socket.gethostname().split(".")[0]
    job_dir = root / job
    deadline = time.monotonic() + timeout
    grace = time.monotonic() + min(timeout, _NEW_JOB_GRACE)
    while True:
        if job_dir.is_dir():
            if given:
                return given
            if (job_dir / machine).is_dir():
                return machine
            try:
                names = json.loads((job_dir / "virtual-hosts.json").read_text())["hosts"]
                return check_name("host", str(names[rank % len(names)]))
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                pass  # not a virtual-host job, or its daemons are still starting
        elif time.monotonic() >= grace:
            found = jobs(root)
            raise DaemonUnavailableError(
                f"no ecsnap daemon of job {job!r} has run under {root} (no {job_dir}); "
                + (f"jobs there: {', '.join(found)} (a typo?); " if found else "no job ran there; ")
                + f"start it with `mpiexec -n HOSTS ecsnap serve --job {job}`, or point "
                "ECSNAP_ROOT (root=) at the daemons' --root"
            )
        if time.monotonic() >= deadline:
            return given or machine  # the Store says what it finds there
        time.sleep(0.05)


def jobs(root: Path) -> list[str]:
    """Names of the job directories under ``root``."""
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*/health.json")))
    except OSError:
        return []


def answering(job_dir: Path) -> list[str]:
    """Hosts under ``job_dir`` whose daemon accepts a connection now."""
    live = []
    for sock in sorted(job_dir.glob("*/ctl.sock")):
        try:
            control.connect(sock, timeout=0.2).close()
        except OSError:
            continue
        live.append(sock.parent.name)
    return live
