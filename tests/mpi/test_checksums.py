"""Bytes are used only with their checksums checked (#55, finding 8). Real daemons, two groups
(8 virtual hosts), a persistent tier: a bit flipped in memory after a step was protected is not
written to disk under a checksum of its own (the write is refused, the read repairs the bytes);
a disk manifest that was changed fails its checksum and is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import storage
from bench.harness import Cluster, close_all
from tests.mpi.test_warm import _until


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1009 + step)
    return {"w": torch.randn(40_000, generator=g)}


def test_a_bit_flipped_in_memory_is_not_persisted_and_a_changed_disk_manifest_is_named(
    shm_root: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "persist"
    args = ["--persist-dir", str(disk), "--persist-every", "1", "--persist-keep", "5"]
    args += ["--keep", "2"]
    # host0's disk writer waits 4 s before it checks and writes step 1: the flip lands first
    faults = {"ECSNAP_FAULTS": "delay@persisting:host=host0:nth=1:seconds=4"}
    c = Cluster(shm_root, hosts=8, k=3, m=1, extra=args, env=faults)
    stores = c.stores(8)
    try:
        for h in [s.put(1, _state(r, 1)) for r, s in enumerate(stores)]:
            assert h.wait(30) == 1
        host0 = shm_root / c.job / "host0"
        m = json.loads((host0 / "steps" / "1.json").read_text())
        shard = next(sh for sh in m["shards"] if sh["rank"] == 0)
        f = host0 / "data" / shard["buffer"]
        raw = bytearray(f.read_bytes())
        raw[100] ^= 0x10
        f.write_bytes(bytes(raw))
        _until("host0's refusal", lambda: "was not persisted" in c.log.read_text(), 30)
        log = c.log.read_text()
        assert "injected fault: delay@persisting" in log  # the fault fired
        assert "fails its checksum here; not persisted" in log, log[-3000:]
        assert not (disk / c.job / "step-1").exists()
        assert torch.equal(stores[0].get(1)["w"], _state(0, 1)["w"])  # repaired from the group
        # later steps are persisted as usual; a changed value in a disk manifest is named
        for step in (2, 3, 4):
            for h in [s.put(step, _state(r, step)) for r, s in enumerate(stores)]:
                assert h.wait(30) == step
        man = disk / c.job / "step-2" / "manifest.json"
        _until("step 2 on disk", man.exists, 30)
        assert stores[0].status(2).state == "persisted"  # memory retired it (--keep 2)
        text = man.read_text()
        assert '"world_size":8' in text and '"checksum":' in text
        man.write_text(text.replace('"world_size":8', '"world_size":9'))
        with pytest.raises(storage.StorageError, match="fails its CRC-32 checksum"):
            stores[0].get(2)
    finally:
        close_all(stores)
        assert c.stop() == 0
