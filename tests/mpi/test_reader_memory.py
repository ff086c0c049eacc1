"""Readers' memory goes back when they do (#55, finding 10). Two groups (8 virtual hosts),
``--keep 1``: an idle reader's lease ends soon after its views go, without another request
(before, only its next request ended it, and the retired step's memory stayed out of the pool);
a shard fetched from another host for a reader that goes before releasing it is removed, and is
counted while it lives."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

import storage
from bench.harness import Cluster, close_all
from tests.mpi.test_warm import _until
from transport import control


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((200_000,), float(step * 10 + rank))}


def test_an_idle_reader_and_a_reader_that_goes_give_their_memory_back(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1, extra=["--keep", "1"])
    stores = c.stores(8)
    reader = storage.connect(c.job, rank=0, world_size=8, host="host0", root=shm_root, timeout=20)
    try:
        for h in [s.put(1, _state(r, 1)) for r, s in enumerate(stores)]:
            assert h.wait(30) == 1
        view = reader.get(1)["w"]
        assert float(view[0]) == 10.0
        for h in [s.put(2, _state(r, 2)) for r, s in enumerate(stores)]:
            assert h.wait(30) == 2  # step 1 retired: its buffer waits for the reader's lease

        def freed_waiting() -> float:  # asked on another connection than the reader's
            return float(stores[0].info()["stats"]["leased_freed_buffers"])

        assert freed_waiting() == 1
        del view
        gc.collect()
        _until("the idle reader's lease to end", lambda: freed_waiting() == 0, 10)
        # a reader on host0 asks for rank 5's shard (held by host5): fetched into a temporary
        # file here; it goes without releasing it
        sock = shm_root / c.job / "host0" / "ctl.sock"
        conn = control.connect(sock, timeout=10)
        reply = conn.request({"op": "hello", "job": c.job, "rank": 0})
        assert reply is not None and reply["ok"]
        reply = conn.request({"op": "get", "step": 2, "rank": 5})
        assert reply is not None and reply["ok"] and reply["temp"], reply
        tmp = Path(reply["path"])
        assert tmp.exists() and tmp.parent.name == "tmp"
        assert stores[0].info()["pool_bytes"] >= tmp.stat().st_size  # counted while it lives
        conn.close()
        _until("the gone reader's fetched file to go", lambda: not tmp.exists(), 10)
    finally:
        close_all([*stores, reader])
        assert c.stop() == 0
