"""``ecsnap bench store --lab``: the store benchmark over hosts that are really apart.

Four lab hosts (network namespaces on a bridge, each its own hostname and /dev/shm, MPI over TCP
only; see :mod:`bench.lab`), every host's link shaped to ``--link-gbit`` (default 2 Gbit/s:
slower than what the two cores here can push over veth, so the links are the bottleneck and the
figures say what a network costs). One trainer rank per host holds a quarter of the state and
connects to its host's daemon through that host's /dev/shm.

Schemes, one after the other on links of the same rate: RS(3,1), RS(2,2), 2-way replication
(RS(1,1)) and RS(3,1) again rebuilding the old way (``--repair star``: the k helpers send their
chunks to the rebuilding host), for the repair-traffic comparison; then 3-way replication
(RS(1,2)) on a lab of 3 hosts (a group is k+m hosts, and 3 does not divide 4) holding 3/4 of the
state, so that every host holds and moves the same blob as in the 4-host schemes.
Each: warm-up puts, idle time for the warmer (:func:`_settle`), then measured puts
(put->protected, the slowest rank), then host losses (the job killed, one host's /dev/shm
emptied, the job relaunched: it rebuilds every kept step of that host before it is healthy; then
that rank's get, checked bit-exact).

Beside every time its **network floor**: the bytes the busiest link must carry one way divided by
the link rate. A put moves ``blob * (1 + (m - 1) / k)`` out of (and into) every host (``blob`` =
a host's quarter of the state); a rebuild moves at least what the host lost (its data and the
parity or replicas it held) into the replacement. The bytes each link carried (veth counters,
both ways) are recorded beside the bytes the daemons' metrics say they sent and received.
Results: JSON lines in ``bench/results/store-lab.jsonl``.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
import uuid
from typing import Any

from bench._common import Recorder, add_put_cpu, cpu_ticks, record_cpu, steal_share, table
from bench._ranks import Workers
from bench.lab import Lab, LabJob, janitor

HOSTS = 4
SCHEMES = [  # (label, k, m, repair)
    ("rs31", 3, 1, "chain"),
    ("rs22", 2, 2, "chain"),
    ("repl2", 1, 1, "chain"),
    ("repl3", 1, 2, "chain"),
    ("rs31_star", 3, 1, "star"),
]


def _hosts(scheme: tuple[str, int, int, str]) -> int:
    """4 hosts, but 3-way replication runs on 3 (a group is k+m hosts and must divide them)."""
    return 3 if scheme[1] + scheme[2] == 3 else HOSTS


def _busiest(before: list[dict[str, int]], after: list[dict[str, int]]) -> int:
    return max(after[i][d] - before[i][d] for i in range(len(after)) for d in after[i])


def _settle(workers: Workers, limit: float = 120.0) -> float:
    """Leave the hosts idle until every warmer has made the files steady state holds (its bytes
    made ahead unchanged for a second); the seconds that took.

    Training computes between snapshots, and the warmer works in that idle time. The benchmark
    puts back to back, so without this the files the warm-up puts left to make are made during
    the measured puts (measured: 0.2-0.8 CPU s per protected GB under ``warm``, varying from
    run to run), and the figures say how fast the warmer catches up, not what a put costs.
    """
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < limit:
        made = [i["stats"]["pool_ahead_bytes"] for i in workers.all({"op": "info"})]
        if made == last:
            break
        last = made
        time.sleep(1.0)
    return time.monotonic() - t0


def _phase(
    lab: Lab,
    rec: Recorder,
    scheme: tuple[str, int, int, str],
    nbytes: int,
    ntensors: int,
    rounds: tuple[int, int, int],
    gbit: float,
) -> dict[str, float]:
    label, k, m, repair = scheme
    warmup, repeats, losses = rounds
    rate = gbit * 1e9 / 8  # bytes per second, one way
    job = f"lab{label}{uuid.uuid4().hex[:4]}"
    extra = ["--k", str(k), "--m", str(m), "--repair", repair, "--keep", "2"]
    daemons = LabJob(lab, job, extra, peer_timeout=120.0)
    n = len(lab.hosts)
    places = [(lab.hosts[i], daemons.root(i)) for i in range(n)]
    workers = None
    med: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # CPU seconds per protected GB, by phase
    steal: list[float] = []  # the share of the cores stolen by the hypervisor, each measured put
    try:
        workers = Workers(job, None, nbytes, ntensors, n, places=places)
        blob = max(r["nbytes"] for r in workers.ready)
        for r in range(warmup + repeats):
            step = r + 1
            if r == warmup:
                idle = _settle(workers)
                print(f"{label}: hosts idle {idle:.1f}s after the warm-up puts", file=sys.stderr)
            info0 = workers.all({"op": "info"})
            link0 = lab.link_bytes()
            ticks0 = cpu_ticks()
            puts = workers.all({"op": "put", "step": step})
            ticks1 = cpu_ticks()
            link1 = lab.link_bytes()
            info1 = workers.all({"op": "info"})
            if r == 0:
                got = workers.all({"op": "get", "step": step, "verify": True})
                if not all(g.get("exact") for g in got):
                    raise AssertionError(f"{label}: get returned different bytes than were put")
            t = max(p["protected"] for p in puts)
            if r >= warmup:
                add_put_cpu(cpu, info0, info1, puts, sum(w["nbytes"] for w in workers.ready))
                samples.setdefault("put_protected", []).append(t)
                steal.append(steal_share(ticks0, ticks1))
                samples.setdefault("put_busiest_link_bytes", []).append(_busiest(link0, link1))
                for i in range(n):
                    samples.setdefault("put_link_from_host_bytes", []).append(
                        link1[i]["from_host"] - link0[i]["from_host"]
                    )
                    samples.setdefault("put_metrics_sent_bytes", []).append(
                        info1[i]["sent_bytes"] - info0[i]["sent_bytes"]
                    )
            print(
                f"{label} put {step}: protected in {t:.3f}s "
                f"({steal_share(ticks0, ticks1):.0%} of the cores stolen)",
                file=sys.stderr,
            )
        last = warmup + repeats
        for i in range(losses):
            lost = 1 + i % (n - 1)
            held = workers.all({"op": "info"})[lost]
            lost_bytes = held["data_bytes"] + held["parity_bytes"]  # every kept step's
            daemons.kill()
            for p in lab.shm(lost).iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            link0 = lab.link_bytes()
            t0 = time.perf_counter()
            daemons = LabJob(lab, job, extra, peer_timeout=120.0)
            t_relaunch = time.perf_counter() - t0
            got = workers.all({"op": "get", "step": last, "verify": True})
            if not all(g.get("exact") for g in got):
                raise AssertionError(f"{label}: get after a rebuild returned different bytes")
            deadline = time.monotonic() + 600
            while (after := workers.all({"op": "info"}))[lost]["health"] != "healthy":
                if time.monotonic() > deadline:
                    raise AssertionError(f"{lab.hosts[lost]} did not become healthy: {after}")
                time.sleep(0.05)
            link1 = lab.link_bytes()
            into = link1[lost]["to_host"] - link0[lost]["to_host"]
            stats = after[lost]["stats"]
            for name, value in (
                ("relaunch_with_rebuild", t_relaunch),
                ("rebuild_newest_step", stats["startup_rebuild_seconds"]),
                ("rebuild_all_steps", stats["rebuild_seconds"]),
                ("get_lost_host", got[lost]["get_touched"]),
                ("rebuild_lost_bytes", lost_bytes),
                ("rebuild_into_replacement_bytes", into),
                ("rebuild_busiest_link_bytes", _busiest(link0, link1)),
            ):
                samples.setdefault(name, []).append(value)
            print(
                f"{label} {lab.hosts[lost]} lost: {lost_bytes / 1e6:.0f} MB rebuilt in "
                f"{stats['rebuild_seconds']:.2f}s, {into / 1e6:.0f} MB into its link "
                f"({into / max(lost_bytes, 1):.2f}x)",
                file=sys.stderr,
            )
        med = {n: statistics.median(v) for n, v in samples.items()}
        rows = record_cpu(rec, label, cpu, {})  # by phase, the largest first
        med["cpu_per_gb"] = statistics.median(cpu["total"])
        print(
            f"{label} CPU s per protected GB: "
            + ", ".join(f"{phase} {s:.3f}" for _, phase, s, *_ in rows if s >= 0.001),
            file=sys.stderr,
        )
        floor_put = blob * (1 + (m - 1) / k) / rate
        floor_rebuild = med.get("rebuild_lost_bytes", 0) / rate
        med["put_floor"] = floor_put
        med["steal"] = statistics.median(steal) if steal else 0.0
        med["rebuild_floor"] = floor_rebuild
        times = {n: v for n, v in samples.items() if not n.endswith("_bytes")}
        rec.times({f"{label}_{n}": v for n, v in times.items()}, scheme=label, k=k, m=m)
        rec.add(
            kind="bytes",
            name=f"{label}_traffic",
            scheme=label,
            k=k,
            m=m,
            repair=repair,
            unit="bytes",
            blob_bytes=blob,
            put_floor_s=floor_put,
            put_steal_share=statistics.median(steal) if steal else None,
            rebuild_floor_s=floor_rebuild,
            **{n: med[n] for n in samples if n.endswith("_bytes")},
        )
    finally:
        if workers is not None:
            workers.close()
        daemons.stop()
        for i in range(n):
            shutil.rmtree(daemons.root(i) / job, ignore_errors=True)
    return med


def run(
    gbit: float = 2.0,
    nbytes: int = 1_500_000_000,
    repeats: int = 5,
    losses: int = 2,
    only: list[str] | None = None,
) -> list[dict[str, Any]]:
    warmup = 3  # keep + 1 puts: from then on every put reuses pre-faulted buffers
    rec = Recorder(
        "store-lab",
        {"hosts": HOSTS, "link_gbit": gbit, "state_bytes": nbytes, "repeats": repeats,
         "losses": losses, "keep": 2},
    )  # fmt: skip
    janitor()
    meds: dict[str, dict[str, float]] = {}
    for hosts in (HOSTS, 3):
        lab = Lab.up(hosts, link_gbit=gbit)
        try:
            for scheme in SCHEMES:
                if (only and scheme[0] not in only) or _hosts(scheme) != hosts:
                    continue
                rounds = (warmup, repeats if scheme[3] == "chain" else 2, losses)
                size = nbytes * hosts // HOSTS  # every host holds the same blob
                meds[scheme[0]] = _phase(lab, rec, scheme, size, 200, rounds, gbit)
        finally:
            lab.down()
    rows = []
    for label, med in meds.items():
        rows.append(
            (
                label,
                med["put_protected"],
                med["put_floor"],
                med["put_protected"] / med["put_floor"],
                med.get("rebuild_all_steps", float("nan")),
                med.get("rebuild_all_steps", float("nan")) / max(med["rebuild_floor"], 1e-9),
                med.get("rebuild_into_replacement_bytes", 0)
                / max(med.get("rebuild_lost_bytes", 1), 1),
                med["put_link_from_host_bytes"] / max(med["put_metrics_sent_bytes"], 1),
                med["cpu_per_gb"],
                f"{med['steal']:.0%}",
            )
        )
    print(
        table(
            rows,
            [
                "scheme",
                "put->protected s",
                "floor s",
                "x floor",
                "rebuild s",
                "x floor",
                "into/lost",
                "link/metrics",
                "CPU s/GB",
                "stolen",
            ],
        )
    )
    ratios: list[tuple[str, float, str | None]] = []
    if "rs31" in meds:
        r = meds["rs31"]
        ratios.append(
            ("rs31_put_protected_over_floor", r["put_protected"] / r["put_floor"], "<= 1.3")
        )
        ratios.append(
            (
                "rs31_rebuild_into_replacement_over_lost",
                r["rebuild_into_replacement_bytes"] / r["rebuild_lost_bytes"],
                "<= 1.4",
            )
        )
        if "repl2" in meds:
            ratios.append(
                (
                    "rs31_rebuild_over_repl2_rebuild",
                    r["rebuild_all_steps"] / meds["repl2"]["rebuild_all_steps"],
                    "<= 1.3",
                )
            )
        if "rs31_star" in meds:
            s = meds["rs31_star"]
            ratios.append(
                (
                    "rs31_chain_rebuild_over_star",
                    r["rebuild_all_steps"] / s["rebuild_all_steps"],
                    None,
                )
            )
            ratios.append(
                (
                    "rs31_star_rebuild_into_replacement_over_lost",
                    s["rebuild_into_replacement_bytes"] / s["rebuild_lost_bytes"],
                    None,
                )
            )
    if "rs22" in meds and "repl3" in meds:
        a, b = meds["rs22"], meds["repl3"]
        ratios.append(
            ("rs22_put_over_repl3_put", a["put_protected"] / b["put_protected"], "<= 0.8")
        )
        ratios.append(
            (
                "rs22_put_bytes_over_repl3_put_bytes",
                a["put_busiest_link_bytes"] / b["put_busiest_link_bytes"],
                None,
            )
        )
    for label, med in meds.items():
        ratios.append(
            (
                f"{label}_put_link_bytes_over_metrics_sent",
                med["put_link_from_host_bytes"] / max(med["put_metrics_sent_bytes"], 1),
                None,
            )
        )
    print(table(rec.ratios(ratios), ["ratio", "value", "target", "met"]))
    path = rec.write()
    print(f"\nwrote {len(rec.records)} records to {path}")
    return rec.records
