"""``ecsnap bench descriptors``: a daemon's file descriptors against the steps it keeps.

For each ``--keep`` K, a job of ``--hosts`` virtual hosts (one rank each, in this process) is
launched under a soft ``ulimit -n`` of ``--soft`` (the hard limit left as it is) and puts K + 5
steps (``--steps`` overrides), each rank a small state of ``--nbytes`` (``--vary``: a size that
differs at every step, as a DCP run of many small differently shaped checkpoints has). After the
puts, and again after ``--idle`` seconds, it records each daemon's open descriptors and threads
(``/proc/PID/fd``, ``/proc/PID/status``), the files of its pool, whether every daemon still
answers (``ecsnap status``), and reads the newest step back bit for bit.

A descriptor per mapped file made the count grow with K and with the sizes seen, until the
daemon ran out and went half-alive; with mappings that hold none it depends on the connections
and peers only. One JSON line per K in ``bench/results/descriptors.jsonl``; the run stops at
the first step not protected, and says which.

    ecsnap bench descriptors --keep 10,100,1000 --soft 1024
    ecsnap bench descriptors --keep 100000 --steps 60 --vary --soft 4096
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import Recorder

__all__ = ["main", "measure"]


def _daemon(root: Path, job: str, host: str) -> dict[str, Any]:
    """Descriptors, threads and pool files of one virtual host's daemon (from /proc)."""
    d = root / job / host
    pid = int(json.loads((d / "health.json").read_text())["pid"])
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
    files = sum(1 for sub in ("data", "parity") for _ in (d / sub).iterdir())
    return {"fds": fds, "threads": threads, "files": files}


def _state(rank: int, step: int, nbytes: int, vary: bool) -> dict[str, Any]:
    import torch

    n = nbytes + (step * 4096 + rank * 64 if vary else 0)  # every step a size of its own
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"w": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g), "step": step}


def measure(
    keep: int, hosts: int, steps: int, nbytes: int, vary: bool, soft: int, idle: float
) -> dict[str, Any]:
    """One job at ``--keep keep``; see the module docstring."""
    import storage
    from bench.harness import Cluster, assert_same, close_all
    from storage import status

    was = resource.getrlimit(resource.RLIMIT_NOFILE)
    root = Path(tempfile.mkdtemp(prefix="ecsnap-bench-fds-", dir="/dev/shm"))
    stores: list[Any] = []
    cluster = None
    out: dict[str, Any] = {"keep": keep, "hosts": hosts, "steps": steps, "protected": 0}
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, was[1]), was[1]))  # inherited
        cluster = Cluster(root, hosts=hosts, extra=["--keep", str(keep)], peer_timeout=60)
        stores = cluster.stores(hosts, timeout=60)
        t0 = time.monotonic()
        for step in range(1, steps + 1):
            handles = [s.put(step, _state(r, step, nbytes, vary)) for r, s in enumerate(stores)]
            try:
                for h in handles:
                    h.wait(60)
            except (storage.StorageError, TimeoutError) as exc:
                out["failed"] = f"step {step}: {type(exc).__name__}: {exc}"
                break
            out["protected"] = step
        out["put_seconds"] = time.monotonic() - t0
        names = cluster.host_names

        def sample() -> dict[str, Any]:
            per = [_daemon(root, cluster.job, n) for n in names]
            answers = [h.get("daemon", "up") for h in status.gather(cluster.job, root)]
            return {
                "fds": [p["fds"] for p in per],
                "threads": [p["threads"] for p in per],
                "files": [p["files"] for p in per],
                "daemons": answers,
            }

        out["after_puts"] = sample()
        time.sleep(idle)
        out["after_idle"] = sample()
        newest = out["protected"]
        if newest:
            for r, s in enumerate(stores):
                assert_same(s.get(newest), _state(r, newest, nbytes, vary))
            out["read_back"] = newest
        return out
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, was)
        close_all(stores)
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ecsnap bench descriptors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--keep", default="10,100,1000", help="comma-separated --keep values")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=0, help="steps to put (default: keep + 5)")
    p.add_argument("--nbytes", type=int, default=64 << 10, help="bytes per rank per step")
    p.add_argument("--vary", action="store_true", help="a different size at every step")
    p.add_argument("--soft", type=int, default=1024, help="the soft ulimit -n the job gets")
    p.add_argument("--idle", type=float, default=10.0, help="seconds idle before the last look")
    a = p.parse_args(argv)
    keeps = [int(k) for k in a.keep.split(",") if k]
    rec = Recorder("descriptors", vars(a))
    print(
        f"{'keep':>7} {'steps':>6} {'protected':>9} {'fds per daemon (median, max)':>30} "
        f"{'files':>7} daemons"
    )
    for keep in keeps:
        steps = a.steps or keep + 5
        r = measure(keep, a.hosts, steps, a.nbytes, a.vary, a.soft, a.idle)
        rec.add(kind="descriptors", **r)
        last = r["after_idle"]
        print(
            f"{keep:>7} {steps:>6} {r['protected']:>9} "
            f"{statistics.median(last['fds']):>22.0f}, {max(last['fds']):>5} "
            f"{max(last['files']):>7} {','.join(sorted(set(last['daemons'])))}"
            + (f"  FAILED {r['failed']}" if "failed" in r else "")
        )
    print(f"results: {rec.write()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
