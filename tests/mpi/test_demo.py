"""A short `ecsnap demo` end to end: a host is lost mid-training, the resumed losses are
bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import REPO


@pytest.mark.parametrize("kill", ["host", "2hosts"])
def test_demo_resumes_bit_identically(tmp_path: Path, kill: str) -> None:
    args = [
        sys.executable,
        "-m",
        "storage.cli",
        "demo",
        "--steps",
        "8",
        "--fail-at",
        "4",
        "--kill",
        kill,
        "--model-size",
        "tiny",
        "--workdir",
        str(tmp_path),
    ]
    if kill == "2hosts":
        args += ["--k", "3", "--m", "1"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "demo-result.json").read_text())
    assert result["identical"] and result["killed_at"] == 4, result
    assert "every loss bit-identical to the uninterrupted run" in out.stdout
    # steps counted one way (as stored, from 0), and no address printed that is dead by then
    assert "step 7 of 0-7" in out.stdout and "step 8" not in out.stdout, out.stdout
    assert "http://" not in out.stdout
    # the summary's figures are what the daemons' /metrics said, and name their metrics
    assert "ecsnap_encode_bytes_total / ecsnap_encode_seconds_total" in out.stdout, out.stdout
    assert "ecsnap_stored_bytes by kind" in out.stdout
    if kill == "host":
        # the failure strikes once step 4 is protected: the resume starts right after it
        assert result["resumed_at"] == 5 and result["rebuild_s"] > 0
        assert "at step 5, from the snapshot of step 4" in out.stdout, out.stdout
    else:  # beyond m=1: the clear error, then a restart from scratch, said plainly
        assert "cannot be rebuilt" in out.stdout
        assert result["resumed_at"] == 0
        assert any("restarted from scratch" in n for n in result["notes"])
    assert (tmp_path / "demo.png").stat().st_size > 10_000
