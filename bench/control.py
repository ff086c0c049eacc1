"""``ecsnap bench control``: what the control plane costs each daemon as the job grows.

One run, for each number of virtual hosts N (4, 8, 16 and 32 by default; one trainer rank per
host, each in a process of its own; RS(3,1) groups of 4 hosts at every N, so that each host's
work within its group is the same and only the job-wide part can grow): a model-shaped shard
per rank (a model's and its AdamW state's tensors, 3,000 small tensors), a training step of
``--interval`` seconds (1 by default) with a snapshot at its start, every rank at once. Per
daemon and per step, over the measured steps (idle rounds between snapshots included):

- bytes gathered: the results of the round's collectives this daemon received (the ballot's
  reductions, its group's events, rare events), as the daemon counts them; beside it the
  ballot's size times ceil(log2 N) per round, what a recursive-doubling reduction brings each
  daemon over the wire;
- daemon CPU seconds: user + system time of the daemon process (``/proc/PID/stat``);
- staged->protected: the slowest rank's, median over steps;
- metadata bytes per host per step: its manifest plus the tensor tables of its shards.

Ratios within the run: each figure at 16 hosts (the largest N run, if smaller) against 4 hosts,
targets <= 1.3. JSON lines in ``bench/results/control.jsonl``; ``ecsnap bench scale`` carries
the per-host costs measured here to 16,384 hosts.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import Recorder, exit_on_sigterm, table
from bench._ranks import Workers
from bench.harness import Cluster
from storage.protocol import Ballot

__all__ = ["main", "measure", "run"]

SIZES = [4, 8, 16, 32]
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def measure(
    root: Path, hosts: int, tensors: int, warmup: int, steps: int, interval: float
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of ``interval`` seconds on ``hosts`` virtual hosts, one rank
    per host in a process of its own, every rank putting its shard at the start of each step
    (at once); the per-daemon costs of the last ``steps``."""
    cluster = Cluster(root, hosts=hosts, k=3, m=1, peer_timeout=120.0, timeout=300.0)
    workers = None
    try:
        workers = Workers(cluster.job, root, 0, 1, hosts, model=tensors)
        pids = {name: cluster.daemon_pid(name) for name in cluster.host_names}
        latencies = []
        before: list[dict[str, Any]] = []
        cpu0: dict[str, float] = {}
        t0 = 0.0
        for step in range(1, warmup + steps + 1):
            if step == warmup + 1:
                before = workers.all({"op": "info"})
                cpu0 = {h: _cpu_seconds(p) for h, p in pids.items()}
                t0 = time.perf_counter()
            t_step = time.perf_counter()
            puts = workers.all({"op": "put", "step": step})
            if step > warmup:
                last_staged = max(p["at_staged"] for p in puts)
                latencies.append(max(p["at_protected"] for p in puts) - last_staged)
            time.sleep(max(0.0, interval - (time.perf_counter() - t_step)))  # the step's compute
        wall = time.perf_counter() - t0
        cpu = {h: _cpu_seconds(p) - cpu0[h] for h, p in pids.items()}
        after = workers.all({"op": "info"})
    finally:
        if workers is not None:
            workers.close()
        cluster.stop(60)
        shutil.rmtree(root / cluster.job, ignore_errors=True)
        cluster.log.unlink(missing_ok=True)
    gathered = [
        (a["gathered_bytes"] - b["gathered_bytes"]) / steps
        for a, b in zip(after, before, strict=True)
    ]
    rounds = [(a["rounds"] - b["rounds"]) / steps for a, b in zip(after, before, strict=True)]
    meta = [a["metadata_bytes"] / max(len(a["protected"]), 1) for a in after]
    ballot = Ballot().nbytes
    return {
        "hosts": hosts,
        "tensors_per_rank": tensors,
        "steps": steps,
        "interval_s": interval,
        "wall_s_per_step": wall / steps,
        "gathered_bytes_per_step": statistics.median(gathered),
        "gathered_bytes_per_step_max": max(gathered),
        "gathered_bytes_per_round": statistics.median(
            g / r for g, r in zip(gathered, rounds, strict=True) if r
        ),
        # recursive doubling: each of the log2 N exchanges of a reduction brings the vector
        "reduction_wire_bytes_per_step": statistics.median(rounds)
        * ballot
        * math.ceil(math.log2(hosts)),
        "rounds_per_step": statistics.median(rounds),
        "cpu_s_per_step": statistics.median(cpu.values()) / steps,
        "cpu_s_per_step_max": max(cpu.values()) / steps,
        "staged_to_protected_s": statistics.median(latencies),
        "metadata_bytes_per_step": statistics.median(meta),
        "metadata_bytes_per_step_max": max(meta),
        "ballot_bytes": ballot,
    }


def run(
    sizes: list[int], tensors: int, warmup: int, steps: int, interval: float
) -> list[dict[str, Any]]:
    rec = Recorder(
        "control",
        {
            "sizes": sizes,
            "tensors": tensors,
            "warmup": warmup,
            "steps": steps,
            "interval_s": interval,
            "k": 3,
            "m": 1,
        },
    )
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"ecsnap-control-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    results = {}
    try:
        for n in sizes:
            print(f"{n} hosts ...", file=sys.stderr, flush=True)
            r = measure(root, n, tensors, warmup, steps, interval)
            results[n] = r
            rec.add(kind="cost", name=f"{n} hosts", unit="per daemon per step", **r)
            print(
                f"{n} hosts: gathered {r['gathered_bytes_per_step']:.0f} B, CPU "
                f"{r['cpu_s_per_step'] * 1e3:.1f} ms, staged->protected "
                f"{r['staged_to_protected_s'] * 1e3:.1f} ms, metadata "
                f"{r['metadata_bytes_per_step']:.0f} B per step",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    low = results[min(results)]
    high = results[16] if 16 in results else results[max(results)]
    span = f"{high['hosts']} / {low['hosts']} hosts"
    ratios = [
        (
            f"daemon CPU per step, {span}",
            high["cpu_s_per_step"] / low["cpu_s_per_step"],
            "<= 1.3",
        ),
        (
            f"bytes gathered per daemon per step, {span}",
            high["gathered_bytes_per_step"] / low["gathered_bytes_per_step"],
            "<= 1.3",
        ),
        (
            f"metadata bytes per host per step, {span}",
            high["metadata_bytes_per_step"] / low["metadata_bytes_per_step"],
            "<= 1.3",
        ),
        (
            f"staged->protected, {span}",
            high["staged_to_protected_s"] / low["staged_to_protected_s"],
            None,
        ),
    ]
    out = rec.ratios(ratios)
    path = rec.write()
    print(
        table(
            [
                (
                    r["hosts"],
                    r["gathered_bytes_per_step"],
                    r["reduction_wire_bytes_per_step"],
                    r["rounds_per_step"],
                    r["cpu_s_per_step"] * 1e3,
                    r["staged_to_protected_s"] * 1e3,
                    r["metadata_bytes_per_step"],
                )
                for r in results.values()
            ],
            [
                "hosts",
                "gathered B/step",
                "reduction wire B/step",
                "rounds/step",
                "daemon CPU ms/step",
                "staged->protected ms",
                "metadata B/step",
            ],
        )
    )
    print()
    print(table(out, ["ratio (this run)", "value", "target", "met"]))
    print(f"\nwrote {len(rec.records)} records to {path}")
    return rec.records


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        prog="ecsnap bench control",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, nargs="+", default=SIZES, help="virtual host counts")
    p.add_argument("--tensors", type=int, default=3000, help="tensors per rank's shard")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds per training step (put at its start)"
    )
    p.add_argument("--quick", action="store_true", help="4 and 8 hosts, 4 steps")
    a = p.parse_args(argv)
    if a.quick:
        run([4, 8], a.tensors, 2, 4, a.interval)
    else:
        run(a.hosts, a.tensors, a.warmup, a.steps, a.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
