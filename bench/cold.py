"""``ecsnap bench cold``: the first puts after a start, against steady state in the same job.

A fresh storage job has no shared memory yet: the first ``keep + 1`` puts find no file to reuse,
and fresh pages cost their first touch: 0.4 to 4.1 CPU s per GB on the 2-core VM this was built on,
depending on whether the VM's host still backs the guest pages the kernel hands out (pages freed
seconds before are cheap, others not; the VM's balloon reports free pages to its host). Three
phases, each on 4 virtual hosts with RS(3,1), ``--keep 2`` and one trainer per host holding a
quarter of the state, a put every ``--gap`` seconds (the training step between snapshots; the
trainers sleep, as a GPU job's host CPUs mostly do) and ``--puts`` puts, the last four of which are
the phase's steady state:

- ``fresh``: a new job without ``--reserve``. The first put makes its own files; from then on the
  daemons make the next puts' files in idle time (:mod:`storage.warm`).
- ``reserve``: a new job with ``--reserve`` of ``(keep + 1) x (shard + parity)`` per host, made
  while the trainers build their state (as training loads), waited for before the first put.
- ``restart``: the ``fresh`` job's daemons killed and relaunched without ``--reserve`` (they adopt
  the kept steps), then the same puts: adopted buffers are never reused (a trainer may still map
  them), so this is a start with sizes known from the manifests.

Reported per phase: each put's put->protected over the phase's steady-state median, the bytes the
daemons faulted in inside puts and ahead of them (where the fresh-page time went; the restart's
count only what its daemons did), and inside each put (the part of its files not made ahead when
it came), how many trainers mapped their put's file inside the put (its first use in that
process: not mapped ahead, see :meth:`storage.Store._start_ahead`), the time from the reserve's
start to its end, the warmers' CPU per GB they faulted in (what fresh pages cost the daemons
during the phase), and what a fresh page cost at the phase's end (:func:`fresh_page_cost`, the
job idle and holding its memory): about the CPU each GB a put faulted in inside it cost that put.
Results: JSON lines in ``bench/results/cold.jsonl``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import Recorder, add_root_option, exit_on_sigterm, run_dir, table
from bench._ranks import Workers
from bench.harness import Cluster
from transport import shm

HOSTS = 4
K, M, KEEP = 3, 1, 2


def _cluster(root: Path, job: str, extra: list[str]) -> Cluster:
    return Cluster(
        root,
        hosts=HOSTS,
        k=K,
        m=M,
        job=job,
        extra=["--keep", str(KEEP), *extra],
        peer_timeout=120.0,
        log=root / f"{job}.log",
    )


def _puts(
    workers: Workers, first: int, n: int, gap: float, label: str
) -> tuple[list[float], list[float], list[float], list[int]]:
    """``n`` puts from step ``first``, ``gap`` seconds apart; put->staged and put->protected of
    the slowest rank of each, the bytes each put faulted in itself (summed over the hosts: the
    part of its files that was not made ahead when it came), and how many of its ranks mapped
    their file inside it (its first use in that trainer: not mapped ahead)."""
    staged, protected, faulted, first_maps = [], [], [], []
    before = _bytes(workers)["pool_fresh_bytes"]
    for i in range(n):
        if i:
            time.sleep(gap)
        puts = workers.all({"op": "put", "step": first + i})
        staged.append(max(p["staged"] for p in puts))
        protected.append(max(p["protected"] for p in puts))
        first_maps.append(sum(bool(p["first_map"]) for p in puts))
        after = _bytes(workers)["pool_fresh_bytes"]
        faulted.append(after - before)
        before = after
        print(
            f"{label} put {i + 1}/{n}: staged {staged[-1]:.3f}s protected {protected[-1]:.3f}s, "
            f"{faulted[-1] / 1e9:.3f} GB faulted in inside it, {first_maps[-1]} of "
            f"{len(puts)} ranks mapped their file inside it",
            file=sys.stderr,
        )
    return staged, protected, faulted, first_maps


def _bytes(workers: Workers) -> dict[str, float]:
    """Summed over the hosts: bytes faulted in inside takes and ahead of need, and the CPU the
    warmers spent (``warm_cpu_s``: their thread's, faulting in nearly all of it)."""
    infos = workers.all({"op": "info"})
    out: dict[str, float] = {}
    for key in ("pool_fresh_bytes", "pool_ahead_bytes", "reserve_wasted_bytes", "warm_bytes"):
        out[key] = float(sum(i["stats"][key] for i in infos))
    out["warm_cpu_s"] = float(sum(i["cpu"]["warm"] for i in infos))
    return out


def fresh_page_cost(directory: Path, nbytes: int = 256 << 20) -> float:
    """CPU seconds per GB to make a new file of shared memory in ``directory`` as the pool's
    warmer does (:func:`transport.shm.create`: posix_fallocate; then
    :func:`transport.shm.prefault` on one thread), measured here and now."""
    path = directory / f"fresh-page-probe-{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.thread_time()
        f = shm.create(path, nbytes, prefault_pages=False, exclusive=True)
        try:
            shm.prefault(f.array, threads=1)
            cpu = time.thread_time() - t0
        finally:
            f.close()
    finally:
        path.unlink(missing_ok=True)
    return cpu / (nbytes / 1e9)


def _phase_end(workers: Workers, root: Path) -> dict[str, float]:
    """What a phase's record says of its end: the bytes faulted in (:func:`_bytes`) and what a
    fresh page costs now, the job idle and holding its memory."""
    out = _bytes(workers)
    ahead = out["pool_ahead_bytes"] / 1e9
    # what the daemons' own fresh pages cost them in this phase, beside the probe's at its end
    out["warm_cpu_s_per_gb"] = out["warm_cpu_s"] / ahead if ahead else 0.0
    return {**out, "fresh_page_cpu_s_per_gb": fresh_page_cost(root)}


def _record(
    rec: Recorder,
    phase: str,
    trial: int,
    staged: list[float],
    protected: list[float],
    faulted: list[float],
    first_maps: list[int],
    extra: dict[str, float],
) -> dict[str, Any]:
    steady = statistics.median(protected[-4:])
    steady_staged = statistics.median(staged[-4:])
    return rec.add(
        kind="phase",
        phase=phase,
        trial=trial,
        put_protected_s=protected,
        put_staged_s=staged,
        steady_protected_s=steady,
        steady_staged_s=steady_staged,
        over_steady=[p / steady for p in protected],
        put_faulted_bytes=faulted,
        put_first_maps=first_maps,
        **extra,
    )


def run(
    quick: bool = False,
    nbytes: int | None = None,
    puts: int = 8,
    gap: float = 3.0,
    trials: int | None = None,
    under: Path | None = None,
) -> list[dict[str, Any]]:
    nbytes = nbytes or ((256 << 20) if quick else 1_500_000_000)
    # three: the median of two is their mean, which one slow trial moves as far as it likes
    trials = trials or (1 if quick else 3)
    ntensors = 200
    shard = nbytes // HOSTS
    reserve = (KEEP + 1) * (shard + -(-shard * M // K)) + (64 << 20)  # tables, rounding
    root, huge = run_dir(under, "ecsnap-bench-cold")
    params = {
        "quick": quick,
        "state_bytes": nbytes,
        "hosts": HOSTS,
        "k": K,
        "m": M,
        "keep": KEEP,
        "puts": puts,
        "gap_s": gap,
        "reserve_bytes": reserve,
        "trials": trials,
        "root": str(root.parent),
        "huge_pages": huge,
    }
    rec = Recorder("cold", params)
    print(
        f"cold start: {nbytes / 1e9:.2f} GB over {HOSTS} hosts, RS({K},{M}), keep {KEEP}, "
        f"{puts} puts {gap:.1f}s apart, --reserve {reserve / 1e9:.2f} GB per host; under "
        f"{root.parent} (huge pages: {huge or 'not a tmpfs'})",
        file=sys.stderr,
    )
    try:
        for trial in range(trials):
            # fresh, then restart (the same job relaunched)
            job = f"cold-{trial}"
            daemons = _cluster(root, job, [])
            workers = None
            try:
                workers = Workers(job, root, nbytes, ntensors, HOSTS)
                staged, protected, faulted, maps = _puts(workers, 1, puts, gap, "fresh")
                _record(
                    rec, "fresh", trial, staged, protected, faulted, maps, _phase_end(workers, root)
                )
                daemons.kill()
                daemons = daemons.relaunch()
                time.sleep(gap)
                staged, protected, faulted, maps = _puts(workers, puts + 1, puts, gap, "restart")
                _record(
                    rec,
                    "restart",
                    trial,
                    staged,
                    protected,
                    faulted,
                    maps,
                    _phase_end(workers, root),
                )
            finally:
                if workers is not None:
                    workers.close()
                daemons.stop()
                shutil.rmtree(root / job, ignore_errors=True)
            # reserve: a new job, the reserve made while the trainers build their state
            job = f"cold-reserve-{trial}"
            t0 = time.perf_counter()
            daemons = _cluster(root, job, ["--reserve", str(reserve)])
            workers = None
            try:
                workers = Workers(job, root, nbytes, ntensors, HOSTS)
                while not all(i["stats"]["reserve_bytes"] for i in workers.all({"op": "info"})):
                    time.sleep(0.05)
                t_ready = time.perf_counter() - t0
                staged, protected, faulted, maps = _puts(workers, 1, puts, gap, "reserve")
                _record(
                    rec,
                    "reserve",
                    trial,
                    staged,
                    protected,
                    faulted,
                    maps,
                    {**_phase_end(workers, root), "start_to_reserve_ready_s": t_ready},
                )
            finally:
                if workers is not None:
                    workers.close()
                daemons.stop()
                shutil.rmtree(root / job, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    phases = [r for r in rec.records if r["kind"] == "phase"]

    def med(phase: str, i: int) -> float:
        return float(statistics.median(r["over_steady"][i] for r in phases if r["phase"] == phase))

    ratio_rows = rec.ratios(
        [
            ("reserve: put 1 / steady state", med("reserve", 0), "<= 1.3"),
            ("fresh: put 1 / steady state", med("fresh", 0), None),
            ("fresh: put 2 / steady state", med("fresh", 1), "<= 1.5"),
            ("fresh: put 3 / steady state", med("fresh", 2), "<= 1.5"),
            ("restart: put 1 / steady state", med("restart", 0), None),
            ("restart: put 2 / steady state", med("restart", 1), None),
        ]
    )
    path = rec.write()
    rows = [
        (
            r["phase"],
            r["trial"],
            " ".join(f"{x:.2f}" for x in r["put_protected_s"]),
            r["steady_protected_s"],
            r["pool_fresh_bytes"] / 1e9,
            r["pool_ahead_bytes"] / 1e9,
            " ".join(f"{x / 1e9:.2f}" for x in r["put_faulted_bytes"][:3]),
            " ".join(str(x) for x in r["put_first_maps"][:4]),
            r["warm_cpu_s_per_gb"],
            r["fresh_page_cpu_s_per_gb"],
        )
        for r in phases
    ]
    print(
        table(
            rows,
            [
                "phase",
                "trial",
                "put->protected s",
                "steady s",
                "GB in puts",
                "GB ahead",
                "GB in puts 1-3",
                "maps in puts 1-4",
                "warmers' CPU s/GB",
                "fresh page CPU s/GB at end",
            ],
        )
    )
    print()
    print(table(ratio_rows, ["ratio (this run)", "value", "target", "met"]))
    print(f"\nwrote {len(rec.records)} records to {path}")
    return rec.records


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(
        prog="ecsnap bench cold",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="256 MB state, one trial")
    parser.add_argument("--bytes", type=int, default=None, help="state size (default 1.5 GB)")
    parser.add_argument("--puts", type=int, default=8, help="puts per phase (>= 6)")
    parser.add_argument(
        "--gap", type=float, default=3.0, help="seconds between puts (the training step)"
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="trials of each phase (default 3; the ratios are their medians)",
    )
    add_root_option(parser)
    args = parser.parse_args(argv)
    if args.puts < 6:
        parser.error("--puts must be at least 6 (the last four are steady state)")
    run(
        quick=args.quick,
        nbytes=args.bytes,
        puts=args.puts,
        gap=args.gap,
        trials=args.trials,
        under=args.root,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
