"""``ecsnap bench scale``: what placement buys at 64 to 16384 hosts, where we cannot run it.

A model, not a measurement. Hosts are grouped as ecsnap groups them (k+m consecutive slots);
RS(k, m) is set against 2- and 3-way replication (each host's snapshot copied to the next
host(s), the scheme of Gemini and NVIDIA's local checkpointing). For each scheme and size:

- memory per host and bytes sent per host per snapshot, in units of the host's blob;
- the probability that in-memory state is lost, for independent failures during the window in
  which the job is down and rebuilding (per-host failure rate from OPT-175B's logbook: about
  1.5 % of instances per day), and for a burst that takes out B hosts at once: a rack whose
  hosts hold B consecutive slots, the same rack when slots were dealt round-robin across racks
  (rank order of ``mpirun``), or B hosts at random (Monte Carlo, fixed seed);
- expected training time lost per day at a snapshot interval: each failure costs half an
  interval when memory survives, and half a persistent-checkpoint interval when it does not.

The control plane's per-daemon costs measured by the last ``ecsnap bench control`` run (bytes
gathered, daemon CPU and metadata per step, at 4 to 32 virtual hosts) are carried to 16,384
hosts: each is fitted as ``a + b log2 N`` over the measured sizes (a reduction's cost grows as
log2 N; everything else a daemon does per step is its group's, of fixed size), beside the wire
bytes of the ballot's reductions (its size x log2 N per round). For contrast, the control plane
before (every rank's tensor table gathered by every daemon each step) grew linearly: measured at
4 and 12 virtual hosts with 3,000 tensors per rank, 0.59 and 1.43 s of daemon CPU and 1.7 and
5.1 MB of metadata per host per step; that line is extrapolated the same way, linearly.

The memory and network columns are checked against the bytes the daemons counted in the last
``ecsnap bench store`` run (``bench/results/store.jsonl``), RS(k, m) and, where that run had it,
2-way replication by the same daemons, and the match is printed. (The daemons replicate within
groups of R hosts, as Gemini's group placement; the loss model here is the ring, which loses a
little more often for the same memory.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
from typing import Any

from bench._common import RESULTS, Recorder, table

__all__ = ["control_model", "fit_log2", "main", "p_loss_burst", "p_loss_independent", "run"]

SIZES = [64, 256, 1024, 4096, 16384]
DAILY_FAILURE = 0.015  # fraction of hosts failing per day (OPT-175B logbook, order of magnitude)


def schemes(k: int, m: int) -> list[dict[str, Any]]:
    return [
        {"name": f"RS({k},{m})", "kind": "ec", "k": k, "m": m},
        {"name": "2-way replication", "kind": "rep", "r": 2},
        {"name": "3-way replication", "kind": "rep", "r": 3},
    ]


def memory_per_host(s: dict[str, Any]) -> float:
    """Snapshot memory per host in units of its blob (its own data included)."""
    return 1 + s["m"] / s["k"] if s["kind"] == "ec" else float(s["r"])


def sent_per_host(s: dict[str, Any]) -> float:
    """Bytes sent per host per snapshot, in units of its blob (the placement's exchange)."""
    return 1 + (s["m"] - 1) / s["k"] if s["kind"] == "ec" else float(s["r"] - 1)


def p_loss_independent(s: dict[str, Any], hosts: int, q: float) -> float:
    """P(some snapshot is lost) when each host fails independently with probability q."""
    if s["kind"] == "ec":
        n = s["k"] + s["m"]
        groups, rest = divmod(hosts, n)

        def lose(size: int) -> float:
            keep = sum(
                math.comb(size, i) * q**i * (1 - q) ** (size - i)
                for i in range(min(s["m"], size) + 1)
            )
            return max(0.0, 1 - keep)

        survive = (1 - lose(n)) ** groups * ((1 - lose(rest)) if rest > s["m"] else 1.0)
        return float(1 - survive)
    # ring replication: a host's data dies with the host and its r-1 successors
    return float(1 - (1 - q ** s["r"]) ** hosts)


def lost_by_burst(s: dict[str, Any], failed: set[int], hosts: int) -> bool:
    if s["kind"] == "ec":
        n = s["k"] + s["m"]
        per_group: dict[int, int] = {}
        for h in failed:
            per_group[h // n] = per_group.get(h // n, 0) + 1
        return any(c > s["m"] for c in per_group.values())
    return any(all((h + j) % hosts in failed for j in range(s["r"])) for h in failed)


def p_loss_burst(
    s: dict[str, Any], hosts: int, burst: int, mode: str, trials: int, rng: random.Random
) -> float:
    """P(loss) for a burst of ``burst`` hosts: a rack whose hosts hold consecutive slots
    (``rack``), a rack when slots were dealt round-robin across racks (``rack-spread``), or
    hosts at random (``random``)."""
    racks = max(hosts // burst, 1)
    lost = 0
    for _ in range(trials):
        if mode == "rack":
            start = rng.randrange(hosts)
            failed = {(start + i) % hosts for i in range(burst)}
        elif mode == "rack-spread":
            r = rng.randrange(racks)
            failed = {h for h in range(hosts) if h % racks == r}
        else:
            failed = set(rng.sample(range(hosts), burst))
        lost += lost_by_burst(s, failed, hosts)
    return lost / trials


def measured_ratios() -> dict[str, dict[str, float]]:
    """Per scheme of the last bench store run ("RS(k,m)", "2-way", ...): redundancy held and
    bytes sent per host over blob, worst host, as the daemons counted them."""
    path = RESULTS / "store.jsonl"
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = [r for r in recs if r.get("kind") == "bytes"]
    if not runs:
        return {}
    last = runs[-1]["run_id"]
    out: dict[str, dict[str, float]] = {}
    for r in runs:
        if r["run_id"] != last:
            continue
        p = r["params"]
        name = r.get("scheme", f"RS({p['k']},{p['m']})")  # runs before replication had one
        got = out.setdefault(name, {"parity_over_blob": 0.0, "sent_over_blob": 0.0})
        got["parity_over_blob"] = max(got["parity_over_blob"], r["parity_over_blob"])
        got["sent_over_blob"] = max(got["sent_over_blob"], r["sent_over_blob"])
    return out


# the control plane before the flat one, as measured (issue #19): N -> per daemon per step
BEFORE = {"cpu_s": {4: 0.59, 12: 1.43}, "metadata_bytes": {4: 1.7e6, 12: 5.1e6}}


def fit_log2(points: dict[int, float]) -> tuple[float, float]:
    """Least squares (a, b) of ``y = a + b log2 N`` over ``points`` (N -> y)."""
    xs = [math.log2(n) for n in points]
    ys = list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _linear(points: dict[int, float], n: int) -> float:
    (n0, y0), (n1, y1) = sorted(points.items())
    return y0 + (y1 - y0) * (n - n0) / (n1 - n0)


def control_costs() -> list[dict[str, Any]]:
    """The per-size cost records of the newest ``bench control`` run (empty if none)."""
    path = RESULTS / "control.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    costs = [r for r in recs if r.get("kind") == "cost"]
    if not costs:
        return []
    last = costs[-1]["run_id"]
    return [r for r in costs if r["run_id"] == last]


def control_model(costs: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """The measured per-daemon costs carried to ``sizes`` hosts (see the module docstring)."""
    fields = {
        "cpu_s_per_step": "cpu_s_per_step",
        "gathered_bytes_per_step": "gathered_bytes_per_step",
        "metadata_bytes_per_step": "metadata_bytes_per_step",
    }
    fits = {
        name: fit_log2({int(c["hosts"]): float(c[key]) for c in costs})
        for name, key in fields.items()
    }
    ballot = float(costs[0]["ballot_bytes"])
    rounds = sum(float(c["rounds_per_step"]) for c in costs) / len(costs)
    out = []
    for n in sizes:
        row: dict[str, Any] = {"hosts": n}
        for name, (a, b) in fits.items():
            row[name] = a + b * math.log2(n)
        row["reduction_wire_bytes_per_step"] = rounds * ballot * math.ceil(math.log2(n))
        row["before_cpu_s_per_step"] = _linear(BEFORE["cpu_s"], n)
        row["before_metadata_bytes_per_step"] = _linear(BEFORE["metadata_bytes"], n)
        out.append(row)
    return out


def run(
    k: int, m: int, window_min: float, interval_s: float, persist_h: float, burst: int, trials: int
) -> list[dict[str, Any]]:
    rec = Recorder(
        "scale",
        {
            "k": k,
            "m": m,
            "window_min": window_min,
            "interval_s": interval_s,
            "persist_interval_h": persist_h,
            "burst": burst,
            "trials": trials,
            "daily_failure": DAILY_FAILURE,
        },
    )
    rng = random.Random(20261129)
    q = 1 - math.exp(-DAILY_FAILURE * window_min / (24 * 60))
    rows = []
    for hosts in SIZES:
        failures_per_day = hosts * DAILY_FAILURE
        for s in schemes(k, m):
            p_ind = p_loss_independent(s, hosts, q)
            p_rack = p_loss_burst(s, hosts, burst, "rack", trials, rng)
            p_spread = p_loss_burst(s, hosts, burst, "rack-spread", min(trials, 200), rng)
            p_rand = p_loss_burst(s, hosts, burst, "random", trials, rng)
            # a failure loses half a snapshot interval, or half a persistent interval when the
            # in-memory state does not survive the window that follows it
            lost_h = failures_per_day * ((1 - p_ind) * interval_s / 7200 + p_ind * persist_h / 2)
            rec.add(
                kind="model",
                hosts=hosts,
                scheme=s["name"],
                memory_per_host=memory_per_host(s),
                sent_per_host=sent_per_host(s),
                p_loss_window=p_ind,
                p_loss_burst_rack=p_rack,
                p_loss_burst_rack_spread=p_spread,
                p_loss_burst_random=p_rand,
                failures_per_day=failures_per_day,
                lost_hours_per_day=lost_h,
                unit="blob multiples, probabilities, hours",
            )
            rows.append(
                (
                    hosts,
                    s["name"],
                    memory_per_host(s),
                    sent_per_host(s),
                    p_ind,
                    p_rack,
                    p_spread,
                    p_rand,
                    lost_h,
                )
            )
    meas = measured_ratios()
    for s in schemes(k, m):
        measured = meas.get(s["name"].replace(" replication", ""))
        if measured is None:
            continue
        match = {
            "parity_model": memory_per_host(s) - 1,
            "parity_measured": measured["parity_over_blob"],
            "sent_model": sent_per_host(s),
            "sent_measured": measured["sent_over_blob"],
        }
        rec.add(
            kind="check",
            scheme=s["name"],
            **match,
            unit="blob multiples",
            parity_error=match["parity_measured"] / match["parity_model"] - 1,
            sent_error=match["sent_measured"] / match["sent_model"] - 1,
        )
    costs = control_costs()
    model: list[dict[str, Any]] = []
    ran = sorted(int(c["hosts"]) for c in costs)
    if costs:
        model = control_model(costs, sorted({*ran, *SIZES}))
        for row in model:
            rec.add(
                kind="control",
                measured=row["hosts"] in ran,
                unit="per daemon per step: s, bytes",
                control_run=costs[0]["run_id"],
                **row,
            )
    path = rec.write()
    print(
        table(
            rows,
            [
                "hosts",
                "scheme",
                "memory/host",
                "sent/host",
                f"P(loss) {window_min:g} min",
                f"P(loss) rack of {burst}",
                "... slots across racks",
                f"P(loss) {burst} random",
                "lost h/day",
            ],
        )
    )
    checks = [r for r in rec.records if r["kind"] == "check"]
    for c in checks:
        print(
            f"\ncheck against the daemons' byte counters (bench store, {c['scheme']}): redundancy "
            f"{c['parity_measured']:.4f} x blob measured vs {c['parity_model']:.4f} modelled "
            f"({c['parity_error']:+.2%}); sent {c['sent_measured']:.4f} vs "
            f"{c['sent_model']:.4f} ({c['sent_error']:+.2%})"
        )
    if not checks:
        print(f"\n(no bench store run with RS({k},{m}) to check the byte model against)")
    if model:
        print(
            f"\ncontrol plane per daemon per step, fitted a + b log2 N over the bench control run "
            f"at {ran} hosts, against the control plane before (linear):"
        )
        print(
            table(
                [
                    (
                        r["hosts"],
                        r["cpu_s_per_step"] * 1e3,
                        r["gathered_bytes_per_step"],
                        r["reduction_wire_bytes_per_step"],
                        r["metadata_bytes_per_step"],
                        r["before_cpu_s_per_step"],
                        r["before_metadata_bytes_per_step"],
                    )
                    for r in model
                ],
                [
                    "hosts",
                    "daemon CPU ms",
                    "gathered B",
                    "reduction wire B",
                    "metadata B/host",
                    "before: CPU s",
                    "before: metadata B",
                ],
            )
        )
    else:
        print("\n(no bench control run to carry the control plane's costs from)")
    print(f"wrote {len(rec.records)} records to {path}")
    return rec.records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ecsnap bench scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--m", type=int, default=1)
    p.add_argument(
        "--window-min",
        type=float,
        default=10.0,
        help="minutes from a failure until redundancy is whole again",
    )
    p.add_argument("--interval-s", type=float, default=60.0, help="snapshot interval")
    p.add_argument("--persist-h", type=float, default=3.0, help="persistent checkpoint interval")
    p.add_argument("--burst", type=int, default=8, help="hosts lost together in a burst")
    p.add_argument("--trials", type=int, default=2000)
    a = p.parse_args(argv)
    run(a.k, a.m, a.window_min, a.interval_s, a.persist_h, a.burst, a.trials)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
