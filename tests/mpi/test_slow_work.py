"""Slow but healthy work does not end the job (#55, finding 9). Two groups (8 virtual hosts):
host0 is wiped and the relaunch rebuilds its chunks before serving, more slowly than the peer
timeout (a fault holds the rebuild). The other group waits for it at the job's next collective as
long as a rebuild of that size may take at a slow floor rate, instead of ending the job after the
peer timeout (then every relaunch rebuilt again, and ended again: a crash loop)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from bench.harness import Cluster, close_all

PEER_TIMEOUT = 3.0
HOLD = 4.0  # seconds the rebuild is held: past the peer timeout
# seconds a repair while serving is held: past the peer timeout, within what 120 MB moved allow
HOLD_SERVING = 3.5


def _state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randint(0, 255, (40_000_000,), dtype=torch.uint8, generator=g)}


def test_a_rebuild_longer_than_the_peer_timeout_finishes(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1, peer_timeout=PEER_TIMEOUT)
    stores = c.stores(8)
    try:
        for h in [s.put(1, _state(r)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 1
    finally:
        close_all(stores)
        c.kill()
    shutil.rmtree(shm_root / c.job / "host0")
    spec = f"delay@rebuilding:host=host0:nth=1:seconds={HOLD}"
    c = c.relaunch(env={"ECSNAP_FAULTS": spec}, timeout=120.0)
    stores = c.stores(8)
    try:
        log = c.log.read_text()
        assert "injected fault: delay@rebuilding" in log, log[-3000:]  # the fault fired
        assert "rebuilt step 1" in log
        for r, s in enumerate(stores):
            assert torch.equal(s.get(1)["w"], _state(r)["w"])
    finally:
        close_all(stores)
        assert c.stop() == 0


def test_a_repair_a_read_asked_for_longer_than_the_peer_timeout_finishes(shm_root: Path) -> None:
    """While serving: every chunk of rank 0's 40 MB shard on host0 is flipped, and the repair its
    read asks for is held past the peer timeout on host0 (a fault). The other group waits for it
    at the next round as long as a repair of that size may take at the floor rate, and so does
    the reader, instead of the job ending after the peer timeout."""
    import json

    spec = f"delay@rebuilding:host=host0:nth=1:seconds={HOLD_SERVING}"
    c = Cluster(shm_root, hosts=8, k=3, m=1, peer_timeout=PEER_TIMEOUT, env={"ECSNAP_FAULTS": spec})
    stores = c.stores(8)
    try:
        for h in [s.put(1, _state(r)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 1
        host0 = shm_root / c.job / "host0"
        m = json.loads((host0 / "steps" / "1.json").read_text())
        shard = next(sh for sh in m["shards"] if sh["rank"] == 0)
        cb = int(m["step_chunk_bytes"])
        with (host0 / "data" / shard["buffer"]).open("r+b") as f:
            for off in range(7, int(shard["nbytes"]), cb):
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x44]))
        assert torch.equal(stores[0].get(1)["w"], _state(0)["w"])
        assert "injected fault: delay@rebuilding" in c.log.read_text()  # the fault fired
        for r, s in enumerate(stores):
            assert torch.equal(s.get(1)["w"], _state(r)["w"])
        assert stores[0].info()["stats"]["rebuilds"] == 1
    finally:
        close_all(stores)
        assert c.stop() == 0


def test_a_read_the_daemon_holds_past_the_client_timeout_is_waited_for(shm_root: Path) -> None:
    """A request the daemon answers only after the job's work (here a read held 3 s by a fault)
    is given the daemon's peer timeout, not only the Store's (1 s here), so a healthy daemon is
    not reported gone."""
    import storage

    spec = {"ECSNAP_FAULTS": "delay@serving:host=host0:nth=1:seconds=3"}
    c = Cluster(shm_root, hosts=8, k=3, m=1, env=spec, peer_timeout=5.0)
    stores = [
        storage.connect(c.job, rank=r, world_size=8, host=f"host{r}", root=shm_root, timeout=1.0)
        for r in range(8)
    ]
    try:
        small = {r: {"w": torch.full((1000,), float(r))} for r in range(8)}
        for h in [s.put(1, small[r]) for r, s in enumerate(stores)]:
            assert h.wait(30) == 1
        assert torch.equal(stores[0].get(1)["w"], small[0]["w"])
        assert "injected fault: delay@serving" in c.log.read_text()  # the read was held
    finally:
        close_all(stores)
        assert c.stop() == 0


def test_a_rebuild_without_memory_fails_alike_in_its_group_and_runs_again(shm_root: Path) -> None:
    """A host that cannot make the files it rebuilds (here a full /dev/shm, injected once) fails
    the repair on every host of its group alike, instead of leaving its peers waiting for it
    until the job ended (#55, finding 9); the daemons serve, and the step is rebuilt while
    serving."""
    c = Cluster(shm_root, hosts=8, k=3, m=1, peer_timeout=PEER_TIMEOUT)
    stores = c.stores(8)
    small = {r: {"w": torch.full((300_000,), float(r))} for r in range(8)}
    try:
        for h in [s.put(1, small[r]) for r, s in enumerate(stores)]:
            assert h.wait(60) == 1
    finally:
        close_all(stores)
        c.kill()
    shutil.rmtree(shm_root / c.job / "host1")
    c = c.relaunch(env={"ECSNAP_FAULTS": "enospc@alloc:host=host1:nth=1"})
    stores = c.stores(8)
    try:
        log = c.log.read_text()
        assert "injected fault: enospc@alloc" in log, log[-3000:]  # the fault fired
        assert "rebuilding step 1 failed" in log, log[-3000:]
        for r, s in enumerate(stores):
            assert torch.equal(s.get(1)["w"], small[r]["w"])
        assert "rebuilt" in c.log.read_text()
    finally:
        close_all(stores)
        assert c.stop() == 0
