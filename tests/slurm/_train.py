"""The trainer the Slurm test runs in place of the README's ``train.py`` (under torchrun, one per
node): reads the newest step if there is one (checked bit for bit against what its rank put),
puts steps, then waits for the test and puts once more, recording what it saw in
``$ECSNAP_TEST_OUT/rank<R>-<phase>.json``, and exits when the test says it read them."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

import storage


def state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank * 7919 + step)
    return {"w": torch.randn(300_000, generator=g), "step": step}


def main() -> int:
    out = Path(os.environ["ECSNAP_TEST_OUT"])
    phase = os.environ["ECSNAP_TEST_PHASE"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rec: dict[str, Any] = {"rank": rank, "world": world, "host": socket.gethostname()}
    rec["pid"] = os.getpid()
    path = out / f"rank{rank}-{phase}.json"

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.rename(path)

    store = storage.connect(timeout=120)
    latest = store.latest_step()
    rec["found"] = latest
    if latest is not None:
        got = store.get(latest)
        want = state(rank, latest)
        rec["exact"] = bool(torch.equal(got["w"], want["w"])) and got["step"] == latest
    first = (latest or 0) + 1
    steps = list(range(first, first + int(os.environ.get("ECSNAP_TEST_STEPS", "3"))))
    for step in steps:
        store.put(step, state(rank, step)).wait(120)
    rec["protected"] = steps
    save()
    go = out / f"go-{phase}"
    deadline = time.monotonic() + 300
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    store.timeout = 5.0  # what is said once the storage job is gone comes sooner
    try:
        store.put(steps[-1] + 1, state(rank, steps[-1] + 1)).wait(120)
        rec["after"] = "protected"
    except storage.StorageError as exc:
        rec["after"] = f"{type(exc).__name__}: {exc}"
    save()
    # exit once the test has read every rank's record: a trainer that exits first makes
    # torchrun end the others' before they write theirs
    done = out / f"done-{phase}"
    deadline = time.monotonic() + 120
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return 0 if rec["after"] == "protected" else 1


if __name__ == "__main__":
    sys.exit(main())
