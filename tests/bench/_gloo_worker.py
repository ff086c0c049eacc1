"""A stand-in training rank for tests of ``bench.harness.gloo_ranks``: rank 1 fails at once,
rank 2 would run for a minute, the others print a line and exit."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if rank == 1:
        sys.exit(3)
    if rank == 2:
        time.sleep(60)
    print(json.dumps({"rank": rank, "pid": os.getpid()}), flush=True)
