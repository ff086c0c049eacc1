"""Memory made ahead of need has a bound, whatever ``--keep`` says (#55, finding 4).

The warmer once made every one of the ``keep + 1`` files of each size ahead: at ``--keep 1000``
5 steps of 4 MB per rank held 4,927 files and 13.8 GB of shared memory on 4 virtual hosts, and
filled /dev/shm on a longer run. Now it keeps the next two puts' files free, and drops the free
files of sizes no longer wanted past that bound.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from bench.harness import Cluster, close_all

NBYTES = 4 << 20


def _state(rank: int, step: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g)}


def _held(host_dir: Path) -> tuple[int, int]:
    """Files and bytes under a host directory's data/ and parity/."""
    files = [p for sub in ("data", "parity") for p in (host_dir / sub).iterdir()]
    return len(files), sum(p.stat().st_size for p in files)


def _settled(c: Cluster, quiet: float = 3.0, timeout: float = 60.0) -> list[tuple[int, int]]:
    """Every host's files and bytes once they have not changed for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    since = time.monotonic()
    while True:
        now = [_held(c.root / c.job / n) for n in c.host_names]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
        assert time.monotonic() < deadline, f"the warmers did not settle: {now}"
        time.sleep(0.2)


@pytest.mark.parametrize("hosts", [4, 8])
def test_keep_everything_makes_only_the_next_two_puts_ahead(shm_root: Path, hosts: int) -> None:
    c = Cluster(shm_root, hosts=hosts, k=3, m=1, extra=["--keep", "1000"])
    stores = c.stores(hosts)
    try:
        steps = 5
        for step in range(1, steps + 1):
            for h in [s.put(step, _state(r, step, NBYTES)) for r, s in enumerate(stores)]:
                assert h.wait(60) == step
        held = _settled(c)
        info = stores[0].info()
        shard = info["data_bytes"] // steps  # one rank's shard with its table, on host0
        parity = info["parity_bytes"] // steps
        for files, nbytes in held:
            # the kept steps (a shard file and a parity file each), and two puts ahead
            assert files <= 2 * steps + 2 * 2, held
            assert nbytes <= (steps + 2) * (shard + parity) * 1.3, (held, shard, parity)
        assert info["stats"]["warm_files"] >= 2  # made ahead it was, but no more than that
        # sizes change: the free files of the old size go once past the bound
        for step in range(steps + 1, steps + 4):
            for h in [s.put(step, _state(r, step, 2 * NBYTES)) for r, s in enumerate(stores)]:
                assert h.wait(60) == step
        for files, nbytes in _settled(c):
            assert files <= 2 * (steps + 3) + 2 * 2, files
            kept = steps * (shard + parity) + 3 * (2 * shard + 2 * parity)
            assert nbytes <= kept + 2 * (2 * shard + 2 * parity) * 1.3, (nbytes, kept)
        for r, s in enumerate(stores):
            assert torch.equal(s.get(1)["w"], _state(r, 1, NBYTES)["w"])
            assert torch.equal(s.get()["w"], _state(r, steps + 3, 2 * NBYTES)["w"])
    finally:
        close_all(stores)
        assert c.stop() == 0
