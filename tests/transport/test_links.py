"""transport.mpi.Links between two real MPI ranks: what a wait costs while a peer is late."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.harness import REPO
from storage.launch import mpiexec


def test_busy_waits_nap_once_their_peer_is_late() -> None:
    late = 0.5
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "tests.transport._links_wait", str(late)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    control, transfer = out["control"], out["transfer"]
    assert control["wall"] >= 0.8 * late and transfer["wall"] >= 0.8 * late  # it did wait
    # a round's wait spins only for its first polls: then it naps, giving the core back;
    # so does a bulk receive once nothing has arrived for as long
    assert control["cpu"] < 0.3 * control["wall"], control
    assert transfer["cpu"] < 0.3 * transfer["wall"], transfer
    phases = out["phases"]  # the swap (its bytes checked) under a clock
    assert phases["receive"] > 0 and phases["send"] > 0 and phases["polling"] > 0
    assert out["arrived"] == {"calls": 8, "receives": 8}, out["arrived"]
