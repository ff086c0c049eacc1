"""Starting and killing MPI jobs leaves nothing behind: Hydra's topology files of SIGKILLed
proxies are swept, a running job's are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from storage.launch import HYDRA_TOPOLOGY, mpiexec, sweep_hydra_files

WAIT = (
    "from mpi4py import MPI; import time; c = MPI.COMM_WORLD; c.Barrier()\n"
    "if c.Get_rank() == 0: print('up', flush=True)\n"
    "time.sleep(60)"
)


def _topology_files() -> set[str]:
    return {str(p) for p in Path("/").glob(HYDRA_TOPOLOGY.lstrip("/"))}


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
