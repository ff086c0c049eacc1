"""Starting a storage job from Python (tests, benchmarks, the demo) as a user would by hand.

    proc = launch.start(4, "myjob", root, log, virtual_hosts=["host0", ...], k=3, m=1)

runs ``mpiexec -n 4 <python> -m storage.cli serve --job myjob --root ROOT --virtual-hosts ...``
in its own process session (so one ``killpg`` stops it all) and returns once every daemon has
logged its ``ready:`` line.
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


def sweep_hydra_files(since: float) -> list[str]:
    """Remove the topology files of Hydra proxies that were SIGKILLed (the tests and benchmarks
    kill storage jobs on purpose): those modified at or after ``since`` (a ``time.time()``) that
    no live process holds open. Returns the paths removed."""
    # the candidates first: a proxy that starts after this glob makes a file it does not list,
    # and one that started before holds its file open from creation (mkstemp) while it runs
    candidates = []
    for path in Path("/").glob(HYDRA_TOPOLOGY.lstrip("/")):
        try:
            if path.stat().st_mtime >= since:
                candidates.append(path)
        except FileNotFoundError:
            continue
    if not candidates:
        return []
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                held.add(os.readlink(fd))
            except OSError:
                continue
    removed = []
    for path in candidates:
        if str(path) not in held:
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


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
