"""Starting a storage job from Python (tests, benchmarks, the demo) as a user would by hand.

    proc = launch.start(4, "myjob", root, log, virtual_hosts=["host0", ...], k=3, m=1)

runs ``mpiexec -n 4 <python> -m storage.cli serve --job myjob --root ROOT --virtual-hosts ...``
in its own process session and returns once every daemon has logged its ``ready:`` line. One
``killpg`` of that session stops it all, though not at once: Hydra starts each proxy and each rank
in a session of its own, so the signal reaches mpiexec alone, and its proxies stop their ranks and
exit when they see it gone, a moment later (see :func:`sweep_hydra_files`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["mpiexec", "serve_command", "start", "sweep_hydra_files", "sweeping_hydra_files"]

# Hydra's proxy writes the machine's topology to a file of this name and holds it open while it
# runs; it unlinks it on a clean exit (SIGTERM included), so a SIGKILLed job leaves it behind.
HYDRA_TOPOLOGY = "/tmp/hydra_hwloc_xmlfile_*"


def mpiexec() -> str:
    """The venv's mpiexec (the mpich wheel's: ``mpiexec`` outside it starts the system Python)."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


SETTLE = 10.0  # seconds a sweep waits for the proxies of a killed mpiexec to exit


def sweep_hydra_files(since: float, settle: float = SETTLE) -> list[str]:
    """Remove the topology files of Hydra proxies that were SIGKILLed (the tests and benchmarks
    kill storage jobs on purpose): those modified at or after ``since`` (a ``time.time()``) that
    no live process holds open. Returns the paths removed.

    Hydra starts each proxy (and each rank) in a session of its own, so a ``killpg`` of
    mpiexec's reaches mpiexec alone; its proxies exit once they see it gone, a moment later, and
    leave their files. A sweep run right after found such a file still held and kept it (2 of 20
    jobs killed and swept at once). So a file whose holders all have no mpiexec above them any
    more is waited for, up to ``settle`` seconds; one a running job's proxy holds is kept at once.
    """
    # the candidates first: a proxy that starts after this glob makes a file it does not list,
    # and one that started before holds its file open from creation (mkstemp) while it runs
    candidates: list[str] = []
    for found in Path("/").glob(HYDRA_TOPOLOGY.lstrip("/")):
        try:
            if found.stat().st_mtime >= since:
                candidates.append(str(found))
        except FileNotFoundError:
            continue
    if not candidates:
        return []
    deadline = time.monotonic() + settle
    while True:
        held = _holders(candidates)
        exiting = [p for p in candidates if held[p] and not any(map(_under_mpiexec, held[p]))]
        if not exiting or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    removed = []
    for path in candidates:
        if not held[path]:
            Path(path).unlink(missing_ok=True)
            removed.append(path)
    return removed


def _holders(paths: Sequence[str]) -> dict[str, set[int]]:
    """The PIDs that hold each of ``paths`` open (of the processes /proc lets this one read)."""
    held: dict[str, set[int]] = {p: set() for p in paths}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in held:
                held[target].add(int(fd_dir.parent.name))
    return held


def _under_mpiexec(pid: int) -> bool:
    """Whether a live mpiexec (or mpirun) is among ``pid``'s ancestors: False for a proxy whose
    mpiexec was killed (it was handed to init or a subreaper) and for a process that is gone."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if name.startswith(("mpiexec", "mpirun")):
            return True
        pid = int(rest.split()[1])  # the parent's (field 4; the state is field 3)
    return False


@contextlib.contextmanager
def sweeping_hydra_files() -> Iterator[None]:
    """Run the block, then :func:`sweep_hydra_files` since it began (whatever the block raised):
    around a test session, a benchmark or the demo, which kill storage jobs on purpose."""
    started = time.time()
    try:
        yield
    finally:
        sweep_hydra_files(started)


def serve_command(
    hosts: int,
    job: str,
    root: str | Path,
    *,
    virtual_hosts: Sequence[str] | None = None,
    k: int | None = None,
    m: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    args = [
        mpiexec(),
        "-n",
        str(hosts),
        sys.executable,
        "-m",
        "storage.cli",
        "serve",
        "--job",
        job,
        "--root",
        str(root),
        "--virtual-hosts",
    ]
    if virtual_hosts:
        args.append(",".join(virtual_hosts))
    if k is not None and m is not None:
        args += ["--k", str(k), "--m", str(m)]
    return args + list(extra)


def start(
    hosts: int,
    job: str,
    root: str | Path,
    log: Path,
    *,
    virtual_hosts: Sequence[str] | None = None,
    k: int | None = None,
    m: int | None = None,
    extra: Sequence[str] = (),
    timeout: float = 120.0,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Start the daemons, logging to ``log`` (appended), and wait until all are ready."""
    log.touch()
    mark = log.stat().st_size
    with log.open("a") as out:
        proc: subprocess.Popen[str] = subprocess.Popen(
            serve_command(hosts, job, root, virtual_hosts=virtual_hosts, k=k, m=m, extra=extra),
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text()[mark:]
        if text.count("ready:") >= hosts:
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"the daemons exited with {proc.returncode}:\n{text}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the daemons were not ready in {timeout:.0f}s:\n{text}")
        time.sleep(0.05)
