"""The Hugging Face Trainer through ecsnap: a tiny GPT-2 (from a config, no download) with a
snapshot every step and no checkpoint folder, SIGKILLed mid-training, resumed through the
Trainer's own ``resume_from_checkpoint`` from the folder ``SnapshotCallback.restore`` writes:
its losses and final weights are bit-identical to the same run resumed from the Trainer's own
checkpoint, and its losses to a run never interrupted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench import forks
from bench.harness import Cluster, assert_same


def _run(spec: dict[str, Any], killed: bool) -> dict[str, Any] | None:
    out = forks.run("tests.frameworks._hf_run", [json.dumps(spec)], timeout=300)
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

        def spec(mode: str) -> dict[str, Any]:
            work = tmp_path / mode
            base = {"mode": mode, "job": c.job, "root": str(shm_root), "dir": str(work)}
            return base | {"steps": 9, "out": str(tmp_path / f"{mode}.pt")}

        _run({**spec("ecsnap"), "kill_at": 4}, killed=True)
        assert not list((tmp_path / "ecsnap").glob("checkpoint-*"))  # snapshots wrote no folder
        ecsnap = _run({**spec("ecsnap"), "resume": True}, killed=False)
        assert ecsnap is not None
        # the newest protected snapshot: step 4's, or step 3's when the kill struck while step
        # 4's was still being copied (puts are asynchronous; the next optimizer step waits)
        resumed_at = int(ecsnap["resumed_from"].rsplit("-", 1)[1])
        assert resumed_at in (3, 4), ecsnap
        # the only folder: the one restore() wrote for the Trainer to resume from
        assert ecsnap["folders"] == [f"checkpoint-{resumed_at}"], ecsnap
        _run({**spec("file"), "kill_at": 4}, killed=True)
        file = _run({**spec("file"), "resume": True, "resume_at": resumed_at}, killed=False)
        assert file is not None
        # the log: the restored history of steps 1..N, then the steps after the resume
        assert ecsnap["losses"] == file["losses"] and len(ecsnap["losses"]) == 9, (ecsnap, file)
        whole = _run({**spec("whole"), "mode": "none"}, killed=False)  # never interrupted
        assert whole is not None
        assert ecsnap["losses"] == whole["losses"], (ecsnap, whole)
        got = torch.load(tmp_path / "ecsnap.pt", weights_only=True)
        want = torch.load(tmp_path / "file.pt", weights_only=True)
        assert_same(got, want)
    finally:
        assert c.stop() == 0
