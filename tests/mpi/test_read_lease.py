"""A reader is never handed a buffer the next put rewrites (#55, finding 5).

The daemon checked a shard's checksums and only then took the reader's lease; retention could
retire the step in between and give its buffer to the next put, and the reader's copy-on-write
views then showed that put's bytes, silently. ``delay@serving`` holds host0's first local read
3 s right after its checks (the window, widened), while the job puts on with ``--keep 1``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from bench.harness import Cluster, close_all

NBYTES = 1 << 20


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"w": torch.randint(0, 255, (NBYTES,), dtype=torch.uint8, generator=g)}


@pytest.mark.parametrize("hosts", [4, 8])
def test_a_read_keeps_its_bytes_while_retention_gives_buffers_to_later_puts(
    shm_root: Path, hosts: int
) -> None:
    faults = {"ECSNAP_FAULTS": "delay@serving:host=host0:nth=1:seconds=3"}
    c = Cluster(shm_root, hosts=hosts, k=3, m=1, extra=["--keep", "1"], env=faults)
    stores = c.stores(hosts)
    reader = storage.connect(c.job, rank=0, world_size=hosts, host="host0", root=shm_root)
    got: dict[str, Any] = {}
    try:
        for h in [s.put(1, _state(r, 1)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 1

        def read() -> None:
            try:
                got["state"] = reader.get(1)
            except storage.StepNotFoundError as exc:  # retired before it was leased: fine
                got["error"] = exc

        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.5)  # the read is inside the daemon, held after its checks
        step = 2
        for h in [s.put(step, _state(r, step)) for r, s in enumerate(stores)]:
            assert h.wait(60) == step  # step 1 retires (--keep 1): its buffer is freed
        t.join(30)
        assert not t.is_alive()
        assert "injected fault: delay@serving" in c.log.read_text()  # the window was widened
        # later puts take the buffers retention gave back; a leased one must not be among them
        for step in range(3, 8):
            for h in [s.put(step, _state(r, step)) for r, s in enumerate(stores)]:
                assert h.wait(60) == step
        assert "error" not in got, got  # leased before step 2 retired step 1
        assert torch.equal(got["state"]["w"], _state(0, 1)["w"]), "the read shows another put"
        for r, s in enumerate(stores):
            assert torch.equal(s.get()["w"], _state(r, 7)["w"])
    finally:
        got.clear()
        reader.close()
        close_all(stores)
        assert c.stop() == 0
