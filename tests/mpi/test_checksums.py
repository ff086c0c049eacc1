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


def test_a_repair_checks_what_it_reads_and_rebuilds_a_bad_source_too(shm_root: Path) -> None:
    """Three RS(2,2) groups (12 virtual hosts). Rank 0's chunks on host0 are flipped, and so is
    every chunk host1 holds (its shards and its parity): the read of rank 0 asks its group for a
    repair whose stripes all have a chunk on host1. The repair finds host1's bad sources by
    their checksums and rebuilds them too, from the two good chunks of each stripe: rank 0 reads
    back bit-exact (before, the rebuilt chunk failed its checksum and the read failed)."""
    c = Cluster(shm_root, hosts=12, k=2, m=2, extra=["--keep", "2"])
    stores = c.stores(12)
    try:
        for h in [s.put(1, _state(r, 1)) for r, s in enumerate(stores)]:
            assert h.wait(30) == 1
        job = shm_root / c.job
        m0 = json.loads((job / "host0" / "steps" / "1.json").read_text())
        assert m0["groups"][m0["group"]]["slots"] == [0, 1, 2, 3]
        cb = int(m0["step_chunk_bytes"])
        shard = next(sh for sh in m0["shards"] if sh["rank"] == 0)
        flips = [(job / "host0" / "data" / shard["buffer"], 17)]
        for f in sorted((job / "host1" / "data").glob("r*")) + sorted(
            (job / "host1" / "parity").glob("p*")
        ):
            flips += [(f, off + 5) for off in range(0, f.stat().st_size, cb)]
        for f, off in flips:
            raw = bytearray(f.read_bytes())
            raw[off] ^= 0x21
            f.write_bytes(bytes(raw))
        assert torch.equal(stores[0].get(1)["w"], _state(0, 1)["w"])
        log = c.log.read_text()
        assert "on host1 that its repair would read fail their checksums" in log, log[-3000:]
        assert "rebuilt chunks fail their checksums" not in log
        # host1 ends its part of the repair just after host0 answers the read
        _until("host1 counts the repair", lambda: stores[1].info()["stats"]["rebuilds"] >= 1, 30)
        stats = stores[1].info()["stats"]
        assert stats["checksum_failures"] >= 1 and stats["rebuilds"] == 1, stats
        # host1's chunks in other stripes are still bad: its own read repairs those
        for r in (1, 2, 3, 0, 1):
            assert torch.equal(stores[r].get(1)["w"], _state(r, 1)["w"])
        rebuilds = stores[1].info()["stats"]["rebuilds"]
        for r in (0, 1, 2, 3):
            assert torch.equal(stores[r].get(1)["w"], _state(r, 1)["w"])
        assert stores[1].info()["stats"]["rebuilds"] == rebuilds  # every chunk good again
    finally:
        close_all(stores)
        assert c.stop() == 0
