"""Lightning through ecsnap: a real training run, checkpointing every step with
``SnapshotCheckpointIO``, SIGKILLed mid-training and resumed from ecsnap, ends with the same
weights, bit for bit, as the same run resumed from Lightning's own checkpoint file; on one
process and with DDP on two."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from bench import forks
from bench.harness import Cluster, assert_same


def _run(spec: dict[str, Any], killed: bool) -> dict[str, Any] | None:
    out = forks.run("tests.frameworks._lightning_run", [json.dumps(spec)], timeout=300)
    if killed:  # the run SIGKILLed itself (and with DDP, its peer died with it or did too)
        assert out.returncode != 0, out.stdout + out.stderr
        return None
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("devices", [1, 2])
def test_a_killed_run_resumes_from_ecsnap_as_from_lightnings_own_file(
    shm_root: Path, tmp_path: Path, devices: int
) -> None:
    c = Cluster(shm_root, hosts=2, k=1, m=1, extra=["--keep", "4"])
    try:
        results = {}
        for mode in ("ecsnap", "file"):
            work = tmp_path / mode
            base = {"mode": mode, "job": c.job, "root": str(shm_root), "dir": str(work)}
            base |= {"steps": 10, "devices": devices, "out": str(tmp_path / f"{mode}.pt")}
            _run({**base, "kill_at": 5}, killed=True)
            killed = [int(x) for x in (work / "killed.pids").read_text().split()]
            # a SIGKILLed process that initialised MPI leaves its node's shared memory behind
            left = [Path(f"/dev/shm/mpich_shm_{pid:x}_0") for pid in killed]
            if mode == "file":  # Lightning's own asks MPI whether it runs under mpiexec
                assert any(f.exists() for f in left), killed
                for f in left:
                    f.unlink(missing_ok=True)
            else:  # the plugin answers that from the launchers' variables
                assert not any(f.exists() for f in left), killed
            results[mode] = _run({**base, "resume": True, "resume_at": 5}, killed=False)
        ecsnap, file = results["ecsnap"], results["file"]
        assert ecsnap is not None and file is not None
        assert ecsnap["resumed_from"] == f"ecsnap/{c.job}/step-5", ecsnap
        assert ecsnap["step"] == file["step"] == 10
        assert ecsnap["files"] == [], ecsnap  # not one checkpoint file written
        assert len(file["files"]) == 10  # Lightning's own: one per step
        got = torch.load(tmp_path / "ecsnap.pt", weights_only=True)
        want = torch.load(tmp_path / "file.pt", weights_only=True)
        assert_same(got, want)  # the same weights, bit for bit
        # and every step of the resumed run is in ecsnap, as Lightning named it
        import storage

        with storage.connect(c.job, rank=0, world_size=1, host="host0", root=shm_root) as s:
            assert s.steps() == [7, 8, 9, 10]  # --keep 4
    finally:
        assert c.stop() == 0


def test_a_save_returns_once_staged_and_its_failure_is_raised_at_the_next(
    shm_root: Path,
) -> None:
    """#61, item 3: ``save_checkpoint`` returns once the bytes are in the daemon's memory, while
    the step cannot be protected yet (a peer daemon stopped); its protection is waited for at
    the next save, and a save whose protection failed (the storage job died) raises there, so no
    failure is lost."""
    import os
    import signal

    from storage.lightning import SnapshotCheckpointIO

    c = Cluster(shm_root, hosts=8, k=3, m=1, peer_timeout=5.0)
    io = SnapshotCheckpointIO(c.job, root=shm_root, host="host0", timeout=10.0)

    def ckpt(step: int) -> dict[str, Any]:  # every tensor changes: no base to keep first
        w = torch.arange(100_000, dtype=torch.float32) + step
        return {"state_dict": {"w": w}, "global_step": step}

    try:
        io.save_checkpoint(ckpt(1), "epoch=0-step=1.ckpt")
        assert io.latest() == f"ecsnap/{c.job}/step-1"  # waited for: protected
        peer = c.daemon_pid("host1")
        os.kill(peer, signal.SIGSTOP)
        try:
            io.save_checkpoint(ckpt(2), "epoch=0-step=2.ckpt")  # returns
            assert io.store.steps() == [1]  # staged, not protected: host1 cannot join
        finally:
            os.kill(peer, signal.SIGCONT)
        io.save_checkpoint(ckpt(3), "epoch=0-step=3.ckpt")  # 2 waited for
        assert 2 in io.store.steps()
        os.kill(c.daemon_pid("host1"), signal.SIGKILL)  # step 3's protection can never come
        with pytest.raises(storage.StorageError):
            io.save_checkpoint(ckpt(4), "epoch=0-step=4.ckpt")
    finally:
        try:
            io.teardown()
        except storage.StorageError:
            pass
        c.kill()
