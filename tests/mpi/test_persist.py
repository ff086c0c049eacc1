"""The persistent tier: background writes of every Nth protected step, safetensors + JSON that
read back without ecsnap, retention, the fallback chain memory -> peers -> disk, and a wiped
allocation brought back from disk."""

from __future__ import annotations

import json
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench.harness import Cluster, make_state
from storage.status import gather, render

from ._trainer import trainers


def _wait_on_disk(root: Path, job: str, steps: list[int], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        have = sorted(
            int(p.name[5:]) for p in (root / job).glob("step-*") if (p / "manifest.json").exists()
        )
        if have == steps or time.monotonic() > deadline:
            return have
        time.sleep(0.1)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _flat_tensors(state: Any, path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flat_tensors(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_flat_tensors(v, f"{path}.{i}" if path else str(i)))
    elif isinstance(state, torch.Tensor):
        out[path] = state
    return out


def test_persist_retention_restore_and_fallback(shm_root: Path, tmp_path: Path) -> None:
    disk = tmp_path / "persist"
    args = ["--persist-dir", str(disk), "--persist-every", "2", "--persist-keep", "2"]
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=args)
    try:
        trainers(c, "put", world=4, per_host=1, params={"steps": [1, 2, 3, 4, 5, 6]})
        assert _wait_on_disk(disk, c.job, [4, 6]) == [4, 6]  # 2 was persisted, then pruned
        step6 = disk / c.job / "step-6"
        assert not list((disk / c.job).glob(".partial-*"))
        manifest = json.loads((step6 / "manifest.json").read_text())
        assert manifest["world_size"] == 4 and sorted(manifest["ranks"]) == ["0", "1", "2", "3"]
        for f in step6.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        # readable without ecsnap: safetensors gives every tensor under its path in the state
        for r in range(4):
            got = load_file(str(step6 / f"rank-{r}.safetensors"))
            want = {
                k: v
                for k, v in _flat_tensors(make_state(r, 6, every_kind=True)).items()
                if v.dtype != torch.complex64
            }
            for name, t in want.items():
                assert _bits(got[name]) == _bits(t), name
        # every host's memory wiped: the relaunched daemons put step 6 back from disk
        c.kill()
        for h in range(4):
            shutil.rmtree(shm_root / c.job / f"host{h}")
        c = Cluster(shm_root, hosts=4, k=3, m=1, extra=args, job=c.job)
        res = trainers(c, "check", world=4, per_host=1, params={"steps": [6, 4], "get_none": True})
        for r in res:
            assert r["errors"] == {} and r["get_none"] == 6 and r["latest"] == 6, r
            assert r["status"] == {"4": "persisted", "6": "protected"}, r["status"]
        assert sum(r["info"]["stats"]["restored_steps"] for r in res) == 4  # once per daemon
        assert sum(r["info"]["stats"]["disk_reads"] for r in res) == 4 * 4  # step 4: from disk
        text = render(c.job, gather(c.job, shm_root))
        assert f"persistent tier {disk}: steps 4, 6" in text, text
        # a corrupted file on disk is caught by its checksum, named, and nothing else is lost
        f4 = disk / c.job / "step-4" / "rank-2.safetensors"
        raw = bytearray(f4.read_bytes())
        raw[-5] ^= 0xFF
        f4.write_bytes(bytes(raw))
        res = trainers(c, "check", world=4, per_host=1, params={"steps": [4, 6], "ranks": [2]})
        for r in res:
            assert list(r["errors"]) == ["4/2"], r["errors"]
            err = r["errors"]["4/2"]
            assert err["type"] == "PersistError" and "CRC-32" in err["msg"], err
        # more than m hosts lost: memory cannot rebuild step 6, the persistent tier can
        c.kill()
        for h in (1, 2):
            shutil.rmtree(shm_root / c.job / f"host{h}")
        c = Cluster(shm_root, hosts=4, k=3, m=1, extra=args, job=c.job)
        res = trainers(c, "check", world=4, per_host=1, params={"steps": [6], "get_none": True})
        assert all(r["errors"] == {} and r["get_none"] == 6 for r in res), res
    finally:
        assert c.stop() == 0
