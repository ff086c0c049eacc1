"""Starting and killing MPI jobs leaves nothing behind: Hydra's topology files of SIGKILLed
proxies are swept, a running job's are kept, and a killed job's proxy that is still exiting is
waited for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.lab import stop
from storage.launch import HYDRA_TOPOLOGY, mpiexec, sweep_hydra_files

WAIT = (
    "from mpi4py import MPI; import time; c = MPI.COMM_WORLD; c.Barrier()\n"
    "if c.Get_rank() == 0: print('up', flush=True)\n"
    "time.sleep(60)"
)


def _topology_files() -> set[str]:
    return {str(p) for p in Path("/").glob(HYDRA_TOPOLOGY.lstrip("/"))}


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _holds(pid: int, path: str) -> bool:
    try:
        return any(os.readlink(fd) == path for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def _job() -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, "-c", WAIT],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_a_sigkilled_jobs_topology_file_is_swept_and_a_running_jobs_kept() -> None:
    started = time.time()
    before = _topology_files()
    killed = _job()
    theirs = _topology_files() - before
    assert len(theirs) == 1, f"a running job's proxy holds one topology file: {theirs}"
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate()
    assert theirs <= _topology_files(), "SIGKILL no longer leaves the file: the sweep is moot"
    running = _job()
    try:
        kept = _topology_files() - before - theirs
        assert len(kept) == 1
        removed = sweep_hydra_files(started)
        assert set(removed) == theirs
        assert not theirs & _topology_files()
        assert kept <= _topology_files(), "the running job's file was removed"
    finally:
        os.killpg(running.pid, signal.SIGTERM)
        running.communicate(timeout=30)
    assert not kept & _topology_files(), "a job stopped by SIGTERM removes its own"


def test_the_sweep_waits_for_the_proxy_of_a_killed_mpiexec_to_exit() -> None:
    """Hydra's proxy runs in a session of its own: a killpg of mpiexec's leaves it to notice and
    exit by itself, holding its file until then. Stopped (SIGSTOP), it holds the file for as long
    as the test likes: a sweep that gives up soon keeps the file, one that waits removes it once
    the proxy goes on (SIGCONT) and exits."""
    started = time.time()
    before = _topology_files()
    killed = _job()
    (theirs,) = _topology_files() - before
    (proxy,) = _children(killed.pid)
    ranks = _children(proxy)
    assert len(ranks) == 2, ranks
    assert stop(proxy), "the proxy did not stop"
    try:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.communicate()
        # the fault fired: mpiexec is gone, and its proxy lives on, holding the file
        assert _holds(proxy, theirs), "the stopped proxy no longer holds its topology file"
        assert sweep_hydra_files(started, settle=0.3) == [], "a held file was removed"
        assert theirs in _topology_files()
        go_on = threading.Timer(0.5, os.kill, (proxy, signal.SIGCONT))
        go_on.start()
        t0 = time.monotonic()
        removed = sweep_hydra_files(started, settle=60.0)
        waited = time.monotonic() - t0
        go_on.join()
        assert removed == [theirs]
        assert theirs not in _topology_files()
        assert waited >= 0.5, f"the sweep returned in {waited:.2f}s, before the proxy went on"
    finally:
        for pid in [proxy, *ranks]:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
