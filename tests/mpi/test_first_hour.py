"""What a newcomer meets first: finding the daemon, a typo in the job, a script that ends with a
put in flight (issue #24's stumbles, each on real daemons)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import storage
from bench.harness import REPO, Cluster


def _python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_readme_connect_finds_virtual_hosts_and_errors_name_what_answers(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=3, m=1)
    try:
        # the README's line, as written, on a machine whose daemons run --virtual-hosts
        code = (
            f"import storage; s = storage.connect({c.job!r}); print(s.host); "
            "h = s.put(1, {'x': __import__('torch').ones(3)}); h.staged.result(); s.close()"
        )
        env = {"ECSNAP_ROOT": str(shm_root), "WORLD_SIZE": "6"}
        hosts = [_python(code, {**env, "RANK": str(r)}, 60) for r in (0, 1, 5)]
        for out in hosts:
            assert out.returncode == 0, out.stderr
        assert [out.stdout.split()[0] for out in hosts] == ["host0", "host1", "host1"]
        # a host nobody serves: the error names the hosts whose daemons answer
        with pytest.raises(storage.DaemonUnavailableError) as info:
            storage.connect(c.job, rank=0, world_size=1, host="nope", root=shm_root, timeout=1)
        assert "host0, host1, host2, host3" in str(info.value)
        # a job that never ran here: fails at once (not after its timeout), naming the jobs
        t0 = time.monotonic()
        with pytest.raises(storage.DaemonUnavailableError) as info:
            storage.connect(f"{c.job}x", rank=0, world_size=1, root=shm_root, timeout=120)
        assert time.monotonic() - t0 < 60, "waited for a job that never ran"
        assert f"jobs there: {c.job}" in str(info.value) and "a typo?" in str(info.value)
    finally:
        assert c.stop() == 0


@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_a_script_ending_with_a_put_in_flight_exits_and_says_what_it_abandoned(
    shm_root: Path, ending: str
) -> None:
    # rank 1 of 2 never puts: step 7 can never be protected, and the peer timeout is long
    c = Cluster(shm_root, hosts=2, k=1, m=1, peer_timeout=300)
    try:
        code = (
            "import storage, torch\n"
            f"s = storage.connect({c.job!r}, rank=0, world_size=2, host='host0', "
            f"root={str(shm_root)!r})\n"
            "h = s.put(7, {'w': torch.ones(1000)})\n"
            "h.staged.result()\n"
            + ("raise SystemExit('the training loop failed')\n" if ending == "raises" else "")
        )
        # it would wait 300 s for protection if the exit waited on it; 120 s is the hang guard
        out = _python(code, {}, 120)
        assert out.returncode == (1 if ending == "raises" else 0), out.stderr
        assert "step(s) 7 staged but not yet protected" in out.stderr, out.stderr
        assert "abandoned" in out.stderr
    finally:
        assert c.stop() == 0


def test_virtual_hosts_warn_when_mpich_moves_their_bytes_in_two_copies(shm_root: Path) -> None:
    """With MPICH's single-copy path off (here by its own variable; on Ubuntu by Yama's
    ptrace_scope), puts between virtual hosts take 10-20x longer: the daemons say so, and why,
    and serve on; with it on, nothing is said."""
    import torch

    from transport.mpi import single_copy_off

    warning = "warning: MPICH moves the bytes between these virtual hosts in two copies"
    off = Cluster(shm_root, hosts=2, k=1, m=1, env={"MPIR_CVAR_CH4_CMA_ENABLE": "0"})
    try:
        text = off.log.read_text()
        assert text.count(warning) == 1, text  # one line for the machine, not one per daemon
        assert "(MPIR_CVAR_CH4_CMA_ENABLE=0 is set)" in text
        assert "unset MPIR_CVAR_CH4_CMA_ENABLE to use it" in text
        stores = off.stores(2)
        state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
        for h in [s.put(3, state) for s in stores]:
            h.wait(60)
        assert torch.equal(stores[1].get(3)["w"], state["w"])
        for s in stores:
            s.close()
    finally:
        assert off.stop() == 0
    if single_copy_off("MPICH") is None:  # the venv's MPI is the mpich wheel's; CMA allowed here
        on = Cluster(shm_root, hosts=2, k=1, m=1)
        try:
            assert warning not in on.log.read_text()
        finally:
            assert on.stop() == 0
