"""A stand-in training rank for tests of ``bench.harness.gloo_ranks`` that joins a real
``torch.distributed.TCPStore`` on MASTER_PORT (rank 0 serves it), as ``init_process_group``
does, and prints what every rank wrote there."""

from __future__ import annotations

import json
import os
from datetime import timedelta

if __name__ == "__main__":
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=timedelta(seconds=60),
    )
    store.set(f"rank{rank}", str(os.getpid()))
    seen = sorted(int(store.get(f"rank{r}").decode()) for r in range(world))
    print(json.dumps({"rank": rank, "port": int(os.environ["MASTER_PORT"]), "pids": seen}))
