"""The Hugging Face Trainer through ecsnap: a tiny GPT-2 (from a config, no download) with a
snapshot every step and no checkpoint folder, SIGKILLed mid-training, resumed through the
Trainer's own ``resume_from_checkpoint`` from the folder ``SnapshotCallback.restore`` writes:
its losses and final weights are bit-identical to the same run resumed from the Trainer's own
checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.harness import REPO, Cluster, assert_same


def _run(spec: dict[str, Any], killed: bool) -> dict[str, Any] | None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.frameworks._hf_run", json.dumps(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if killed:
        assert out.returncode == -9, out.stdout + out.stderr
        return None
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_killed_trainer_resumes_from_ecsnap_as_from_its_own_checkpoint(
    shm_root: Path, tmp_path: Path
) -> None:
    c = Cluster(shm_root, hosts=2, k=1, m=1)
    try:
        results = {}
        for mode in ("ecsnap", "file"):
            work = tmp_path / mode
            base = {"mode": mode, "job": c.job, "root": str(shm_root), "dir": str(work)}
            base |= {"steps": 9, "out": str(tmp_path / f"{mode}.pt")}
            _run({**base, "kill_at": 4}, killed=True)
            if mode == "ecsnap":
                assert not list(work.glob("checkpoint-*"))  # the snapshots wrote no folder
            results[mode] = _run({**base, "resume": True, "resume_at": 4}, killed=False)
        ecsnap, file = results["ecsnap"], results["file"]
        assert ecsnap is not None and file is not None
        assert ecsnap["resumed_from"].endswith("checkpoint-4"), ecsnap
        assert ecsnap["folders"] == [] and ecsnap["losses"] == file["losses"], (ecsnap, file)
        assert len(ecsnap["losses"]) == 5  # steps 5..9, after the resume
        got = torch.load(tmp_path / "ecsnap.pt", weights_only=True)
        want = torch.load(tmp_path / "file.pt", weights_only=True)
        assert_same(got, want)
    finally:
        assert c.stop() == 0
