"""Lightning through ecsnap: a real training run, checkpointing every step with
``SnapshotCheckpointIO``, SIGKILLed mid-training and resumed from ecsnap, ends with the same
weights, bit for bit, as the same run resumed from Lightning's own checkpoint file; on one
process and with DDP on two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.harness import REPO, Cluster, assert_same


def _run(spec: dict[str, Any], killed: bool) -> dict[str, Any] | None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.frameworks._lightning_run", json.dumps(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
