"""``ecsnap bench memory``: a daemon's memory over many puts, a crash and a rebuild (#61).

A job of ``--hosts`` virtual hosts (one rank each, in this process) puts ``--puts`` steps whose
states drift in size, as real ones do (a tensor that grows or shrinks by up to 3 % a step, one
that comes and goes, as a Trainer's log history and an optimizer's state do). Halfway, the whole
job is SIGKILLed, one host's directory is wiped, and the relaunch rebuilds its chunks before
serving; the newest step is read back bit for bit on every rank and the puts go on.

Throughout, a sampler thread reads every daemon's private memory (``RssAnon`` from
``/proc/PID/status``, what the OOM killer counts beside shared memory) and the job's shared
memory (the pool's files, and the kept steps with their parity, from ``info``) every
``--every`` seconds. The baseline is the same job measured in the same run at put 50: the goals
are a daemon's private memory after the last put within 5 % of after put 50, the
rebuild's peak within 1.5x of before the crash, and shared memory within 4x of what is kept at
every sample. One JSON line per sample (``kind: sample``) and a summary with the ratios in
``bench/results/memory.jsonl``.

    ecsnap bench memory                       # 1,000 puts on 4 hosts, crash at put 500
    ecsnap bench memory --hosts 8 --k 3 --m 1 --puts 400
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import Recorder, table

__all__ = ["main", "rss_anon"]

BASELINE_PUT = 50  # the put after which the baseline is taken (the job settled, warm)


def rss_anon(pid: int) -> int:
    """A process's private memory (``RssAnon``) in bytes; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """Samples every daemon's RssAnon and the job's shared memory, on a thread of its own."""

    def __init__(self, root: Path, job: str, hosts: int, every: float) -> None:
        self.root, self.job, self.hosts, self.every = root, job, hosts, every
        self.samples: list[dict[str, Any]] = []
        self.phase = "start"
        self.put = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def pids(self) -> dict[str, int]:
        out = {}
        for i in range(self.hosts):
            try:
                health = json.loads((self.root / self.job / f"host{i}" / "health.json").read_text())
                out[f"host{i}"] = int(health["pid"])
            except (OSError, ValueError, KeyError):
                continue
        return out

    def shm_bytes(self) -> int:
        """Bytes of the job's files in shared memory (what ``du`` counts, every host)."""
        total = 0
        for f in (self.root / self.job).rglob("*"):
            try:
                if f.is_file():
                    total += f.stat().st_blocks * 512
            except OSError:
                continue
        return total

    def sample(self) -> dict[str, Any]:
        rss = {h: rss_anon(pid) for h, pid in self.pids().items()}
        s = {
            "t": time.monotonic(),
            "phase": self.phase,
            "put": self.put,
            "rss_anon": rss,
            "shm_bytes": self.shm_bytes(),
        }
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _sizes(rng: random.Random, sizes: list[int], floor: int) -> list[int]:
    return [max(floor, int(n * rng.uniform(0.97, 1.03))) for n in sizes]


def _state(rank: int, step: int, n: int, extra: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    st: dict[str, Any] = {"w": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)}
    if extra:
        st["extra"] = torch.full((extra,), float(step))
    st["step"] = step
    return st


def run(a: argparse.Namespace) -> dict[str, Any]:
    from bench.harness import Cluster, assert_same, close_all

    root = Path("/dev/shm") / f"ecsnap-bench-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    rng = random.Random(a.seed)
    sizes = [a.nbytes + 4096 * r for r in range(a.hosts)]
    crash_at = a.crash_at or a.puts // 2
    kept: list[int] = []  # the job's kept data and parity bytes, at each put's end
    pool: list[int] = []  # the job's pool bytes (shared memory the daemons hold), likewise
    at_baseline: dict[str, int] = {}
    before_crash: dict[str, int] = {}
    after_rebuild: dict[str, int] = {}
    rebuild_s = 0.0
    cluster = Cluster(root, hosts=a.hosts, k=a.k, m=a.m, extra=["--keep", str(a.keep)])
    stores: list[Any] = []
    states: list[dict[str, Any]] = []
    sampler = Sampler(root, cluster.job, a.hosts, a.every)
    try:
        with sampler:
            stores = cluster.stores(a.hosts, timeout=60)
            for step in range(1, a.puts + 1):
                sizes = _sizes(rng, sizes, a.nbytes // 4)
                extra = [rng.randrange(1_000, 40_000) if rng.random() < 0.3 else 0 for _ in sizes]
                states = [_state(r, step, sizes[r], extra[r]) for r in range(a.hosts)]
                for h in [s.put(step, states[r]) for r, s in enumerate(stores)]:
                    if h.wait(120) != step:
                        raise RuntimeError(f"step {step} was not protected")
                sampler.put = step
                infos = [s.info() for s in stores]
                pool.append(sum(i["pool_bytes"] for i in infos))
                kept.append(sum(i["data_bytes"] + i["parity_bytes"] for i in infos))
                if step == BASELINE_PUT:
                    sampler.phase = "puts"
                    at_baseline = sampler.sample()["rss_anon"]
                if step == crash_at:
                    time.sleep(a.settle)
                    before_crash = sampler.sample()["rss_anon"]
                    close_all(stores)
                    stores = []
                    sampler.phase = "rebuild"
                    cluster.kill()
                    shutil.rmtree(root / cluster.job / f"host{a.wipe}")
                    t0 = time.monotonic()
                    cluster = cluster.relaunch()
                    rebuild_s = time.monotonic() - t0
                    stores = cluster.stores(a.hosts, timeout=60)
                    for r, s in enumerate(stores):
                        assert_same(s.get(step), states[r])
                    after_rebuild = sampler.sample()["rss_anon"]
                    sampler.phase = "puts after"
                if a.progress and step % a.progress == 0:
                    print(f"put {step}/{a.puts}", file=sys.stderr, flush=True)
            time.sleep(a.settle)
            sampler.phase = "end"
            at_end = sampler.sample()["rss_anon"]
            for r, s in enumerate(stores):
                assert_same(s.get(a.puts), states[r])
    finally:
        close_all(stores)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    peak = {
        h: max(s["rss_anon"].get(h, 0) for s in sampler.samples if s["phase"] == "rebuild")
        for h in before_crash
    }
    return {
        "root": str(root),
        "samples": sampler.samples,
        "baseline": at_baseline,
        "end": at_end,
        "before_crash": before_crash,
        "rebuild_peak": peak,
        "after_rebuild": after_rebuild,
        "rebuild_s": rebuild_s,
        "worst_pool_over_kept": max(p / k for p, k in zip(pool, kept, strict=True) if k),
        "pool_end": pool[-1],
        "kept_end": kept[-1],
    }


def compact(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The samples as columns (one record, not a line each): seconds from the first, the put,
    the phase, each host's RssAnon and the job's shared memory."""
    t0 = samples[0]["t"] if samples else 0.0
    hosts = sorted({h for s in samples for h in s["rss_anon"]}, key=lambda h: (len(h), h))
    return {
        "columns": ["t_s", "put", "phase", *(f"rss_anon_{h}" for h in hosts), "shm_bytes"],
        "rows": [
            [round(s["t"] - t0, 2), s["put"], s["phase"]]
            + [s["rss_anon"].get(h, 0) for h in hosts]
            + [s["shm_bytes"]]
            for s in samples
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ecsnap bench memory", description=__doc__)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--puts", type=int, default=1000)
    p.add_argument("--nbytes", type=int, default=2 << 20, help="a rank's state at the start")
    p.add_argument("--crash-at", type=int, default=0, help="the put after which the job is killed")
    p.add_argument("--wipe", type=int, default=1, help="the host whose directory is wiped")
    p.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--settle", type=float, default=3.0, help="idle seconds before a measure")
    p.add_argument("--seed", type=int, default=61)
    p.add_argument("--progress", type=int, default=100)
    a = p.parse_args(argv)
    if a.puts < BASELINE_PUT + 10:
        p.error(f"--puts must be at least {BASELINE_PUT + 10}: the baseline is taken at put 50")
    params = {k: v for k, v in vars(a).items() if k != "progress"}
    rec = Recorder("memory", params)
    out = run(a)
    rec.add(kind="samples", name="memory", unit="bytes", **compact(out["samples"]))
    base = statistics.median(out["baseline"].values())
    end = statistics.median(out["end"].values())
    before = max(out["before_crash"].values())
    peak = max(out["rebuild_peak"].values())
    drift = max(out["end"][h] / out["baseline"][h] for h in out["baseline"])
    grew = max(out["end"][h] - out["baseline"][h] for h in out["baseline"])
    rows = rec.ratios(
        [
            ("rss_end_over_put50_worst_daemon", drift, "<= 1.05"),
            ("rebuild_peak_over_before_crash", peak / before, "<= 1.5"),
            ("shared_memory_over_kept_worst", out["worst_pool_over_kept"], "<= 4"),
        ]
    )
    rec.add(
        kind="summary",
        name="memory",
        unit="bytes",
        rss_put50_median=base,
        rss_end_median=end,
        rss_grew_worst=grew,
        rss_before_crash_worst=before,
        rss_rebuild_peak_worst=peak,
        rss_after_rebuild=out["after_rebuild"],
        rebuild_relaunch_s=out["rebuild_s"],
        pool_end=out["pool_end"],
        kept_end=out["kept_end"],
    )
    path = rec.write()
    print(table(rows, ["ratio", "value", "goal", "met"]))
    mb = 1 << 20
    print(
        f"daemon RssAnon (median): {base / mb:.1f} MB after put {BASELINE_PUT}, "
        f"{end / mb:.1f} MB after put {a.puts} (worst daemon +{grew / mb:.1f} MB); "
        f"rebuild peak {peak / mb:.1f} MB against {before / mb:.1f} MB before the crash; "
        f"{len(out['samples'])} samples; wrote {path}"
    )
    return 0 if all(r[3] != "NO" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
