"""Starting a storage job from Python (tests, benchmarks, the demo) as a user would by hand.

    proc = launch.start(4, "myjob", root, log, virtual_hosts=["host0", ...], k=3, m=1)

runs ``mpiexec -n 4 <python> -m storage.cli serve --job myjob --root ROOT --virtual-hosts ...``
in its own process session (so one ``killpg`` stops it all) and returns once every daemon has
logged its ``ready:`` line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["mpiexec", "serve_command", "start"]


def mpiexec() -> str:
    """The venv's mpiexec (the mpich wheel's: ``mpiexec`` outside it starts the system Python)."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


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
