"""What every benchmark shares: machine facts, timing with medians, JSON lines, a table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(os.environ.get("ECSNAP_BENCH_RESULTS", Path(__file__).parent / "results"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, Any]:
    """Machine, versions and commit: stamped on every JSON line."""
    versions: dict[str, str | None] = {}
    for name in ("torch", "numpy", "isal", "pyeclib", "mpi4py", "mpich"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "arch": platform.machine(),
            "kernel": platform.release(),
        },
        "python": platform.python_version(),
        "versions": versions,
        "commit": _git_commit(),
    }


class Recorder:
    """Collects one run's records and appends them as JSON lines to ``bench/results/NAME.jsonl``."""

    def __init__(self, name: str, params: dict[str, Any]) -> None:
        self.name = name
        self.run_id = uuid.uuid4().hex[:12]
        self.stamp = {
            "bench": name,
            "run_id": self.run_id,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "params": params,
            **environment(),
        }
        self.records: list[dict[str, Any]] = []

    def add(self, **fields: Any) -> dict[str, Any]:
        record = {**self.stamp, **fields}
        self.records.append(record)
        return record

    def times(
        self, samples: dict[str, list[float]], **fields: Any
    ) -> tuple[list[tuple[str, float, float, float]], dict[str, float]]:
        """One ``time`` record per contender (median and spread, seconds); returns table rows
        (name, median, p10, p90) and the medians by name."""
        rows = []
        for name, s in samples.items():
            stats = summarize(s)
            self.add(kind="time", name=name, unit="s", samples=len(s), **fields, **stats)
            rows.append((name, stats["median_s"], stats["p10_s"], stats["p90_s"]))
        return rows, {n: statistics.median(s) for n, s in samples.items()}

    def ratios(self, ratios: Iterable[tuple[str, float, str | None]]) -> list[tuple[Any, ...]]:
        """One ``ratio`` record each; a target reads "<= 1.1" or ">= 8" (None: no target).
        Returns table rows (name, value, target, met)."""
        rows = []
        for name, value, target in ratios:
            met = None
            if target is not None:
                op, bound = target.split()
                met = value <= float(bound) if op == "<=" else value >= float(bound)
            self.add(
                kind="ratio",
                name=name,
                value=value,
                target=target,
                met=met,
                unit="ratio of medians",
            )
            rows.append(
                (name, value, target or "-", "-" if met is None else ("yes" if met else "NO"))
            )
        return rows

    def write(self) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{self.name}.jsonl"
        with path.open("a") as f:
            for r in self.records:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        return path


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread (p10/p90, min) of timing samples in seconds."""
    s = sorted(samples)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return {"median_s": statistics.median(s), "p10_s": q[0], "p90_s": q[-1], "min_s": s[0]}


def interleaved(
    fns: dict[Any, Callable[[], Any]], repeats: int, warmup: int, min_time: float = 0.0
) -> dict[Any, list[float]]:
    """Time each callable ``repeats`` times, round-robin so drift hits all alike; drop warm-ups.

    With ``min_time``, one sample runs a callable back to back until about ``min_time`` seconds
    have passed (its count fixed after the first warm-up) and reports the time per call: short
    calls then measure the steady state, not the timer or the cache state left by the previous one.
    """
    samples: dict[Any, list[float]] = {name: [] for name in fns}
    number: dict[Any, int] = {}
    for i in range(max(warmup, 1) + repeats):
        for name, fn in fns.items():
            n = number.get(name, 1)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dt = (time.perf_counter() - t0) / n
            if name not in number:
                number[name] = max(1, int(min_time / dt)) if dt > 0 else 1
            elif i >= max(warmup, 1):
                samples[name].append(dt)
    return samples


def table(rows: Iterable[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain fixed-width table for the terminal."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def size_label(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def cpu_ticks() -> tuple[int, int]:
    """(stolen, all) ticks of every core so far, from /proc/stat; (0, 0) where it is missing.

    Stolen time is what the hypervisor gave another guest while this VM's cores had work: a
    benchmark records its share over its measured part, since it slows that part by as much
    and varies from hour to hour (24 % in one 10 s window here, none in others).
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return steal, sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the cores' time stolen between two :func:`cpu_ticks` (0 when unknown)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def add_root_option(parser: argparse.ArgumentParser) -> None:
    """``--root DIR``: where a benchmark's shared memory goes instead of /dev/shm."""
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the directory the daemons' shared memory and the run's other files go in (default "
        "/dev/shm); a tmpfs mounted with huge=within_size: see the README's huge pages",
    )


def run_dir(under: Path | None, name: str) -> tuple[Path, str | None]:
    """A fresh 0700 directory ``name-<random>`` for one run under ``under`` (default /dev/shm, or
    the temporary directory where there is none), and the ``huge`` option of the tmpfs it is
    on (:func:`transport.shm.huge_pages`). Refuses an ``under`` that does not exist."""
    from transport import shm

    if under is not None and not under.is_dir():
        raise SystemExit(f"--root {under}: no such directory (mount a tmpfs there first)")
    base = under or Path("/dev/shm")
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    root = base / f"{name}-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    return root, shm.huge_pages(root)


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a CI cancel) into SystemExit so ``finally`` blocks stop the
    daemons a benchmark started; Python's default would kill it on the spot and leak them."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def record_cpu(
    rec: Recorder, scheme: str, cpu: dict[str, list[float]], floor: dict[str, float]
) -> list[tuple[Any, ...]]:
    """One ``cpu`` record per phase (CPU seconds per protected GB: median and spread), and one
    per part of the floor; returns table rows."""
    rows: list[tuple[Any, ...]] = []
    for phase, values in sorted(cpu.items(), key=lambda kv: -statistics.median(kv[1])):
        stats = summarize(values)
        rec.add(
            kind="cpu",
            scheme=scheme,
            phase=phase,
            samples=len(values),
            unit="CPU s per protected GB",
            median=stats["median_s"],
            p10=stats["p10_s"],
            p90=stats["p90_s"],
        )
        rows.append((scheme, phase, stats["median_s"], stats["p10_s"], stats["p90_s"], ""))
    for part, value in floor.items():
        rec.add(kind="cpu_floor", scheme=scheme, part=part, value=value, unit="CPU s per GB")
        rows.append((scheme, f"floor: {part}", value, "", "", "floor"))
    return rows


def put_cpu(
    before: list[dict[str, Any]], after: list[dict[str, Any]], puts: list[dict[str, Any]]
) -> dict[str, float]:
    """CPU seconds of one put of every rank, by phase: the daemons' (``ecsnap_cpu_seconds``
    between an ``info`` before and one after, summed over hosts) and the trainers' processes
    (``trainer``: the rest of their time besides ``stage`` and ``hash``, which the daemons
    report for them); ``total`` is the sum."""
    from storage.cpu import TRAINER

    out: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for phase, seconds in a["cpu"].items():
            out[phase] = out.get(phase, 0.0) + seconds - b["cpu"].get(phase, 0.0)
    trainers = sum(p["cpu"] for p in puts)
    out["trainer"] = max(0.0, trainers - sum(out.get(p, 0.0) for p in TRAINER))
    out["total"] = sum(out.values())
    return out


def add_put_cpu(
    cpu: dict[str, list[float]],
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    puts: list[dict[str, Any]],
    state_bytes: int,
) -> None:
    """Append one put's CPU seconds per protected GB (of a ``state_bytes`` state) to ``cpu``,
    by phase (:func:`put_cpu`)."""
    for phase, seconds in put_cpu(before, after, puts).items():
        cpu.setdefault(phase, []).append(seconds / (state_bytes / 1e9))
