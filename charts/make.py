"""Regenerate every chart in ``charts/`` from ``bench/results/*.jsonl`` only.

    python charts/make.py            # all charts whose results exist
    python charts/make.py codec      # one

Each chart uses the newest run (``run_id``) in its results file; the fault chart takes each
fault's newest line with the most trials, since a full matrix may be run in parts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
RESULTS = HERE.parent / "bench" / "results"


def newest_run(name: str, full_only: bool = False) -> list[dict[str, Any]]:
    """The records of the newest run in ``name``.jsonl (with ``full_only``: of the newest run
    that was not ``--quick``, if there is one)."""
    path = RESULTS / f"{name}.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if full_only and any(not r.get("params", {}).get("quick") for r in records):
        records = [r for r in records if not r.get("params", {}).get("quick")]
    if not records:
        return []
    last = records[-1]["run_id"]
    return [r for r in records if r["run_id"] == last]


def codec_chart() -> Path | None:
    records = [r for r in newest_run("codec") if r.get("kind") == "throughput"]
    if not records:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    impls = [("ecsnap", 1), ("ecsnap", 2), ("isal_raw", 1), ("pyeclib", 1), ("reference", 1)]
    colors = dict(zip(impls, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, op in zip(axes, ("encode", "decode"), strict=True):
        shapes = sorted({(r["chunk_bytes"], r["k"], r["m"], r["shape"]) for r in records})
        labels = [s[3] for s in shapes]
        width = 0.8 / len(impls)
        for j, (impl, threads) in enumerate(impls):
            by = {
                (r["chunk_bytes"], r["k"], r["m"]): r
                for r in records
                if r["op"] == op and r["impl"] == impl and r["threads"] == threads
            }
            if not by:
                continue
            xs, ys, lo, hi = [], [], [], []
            for x, (c, k, m, _) in enumerate(shapes):
                r = by.get((c, k, m))
                if r is None:
                    continue
                xs.append(x + (j - len(impls) / 2 + 0.5) * width)
                data = k * c / 1e9
                ys.append(r["gbps"])
                lo.append(r["gbps"] - data / r["p90_s"])
                hi.append(data / r["p10_s"] - r["gbps"])
            ax.bar(
                xs,
                ys,
                width,
                yerr=[lo, hi],
                capsize=2,
                label=f"{impl} ({threads} thr)",
                color=colors[(impl, threads)],
            )
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"RS {op}")
        ax.set_ylabel(records[0]["unit"])
        ax.grid(axis="y", alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=8)
    machine = records[0]["machine"]
    fig.suptitle(
        f"codec throughput, median with p10–p90 ({machine['cpu']}, {machine['cores']} "
        f"cores, commit {records[0]['commit']})"
    )
    fig.tight_layout()
    out = HERE / "codec.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def scale_chart() -> Path | None:
    records = [r for r in newest_run("scale") if r.get("kind") == "model"]
    if not records:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    schemes = sorted({r["scheme"] for r in records})
    for name in schemes:
        rows = sorted((r for r in records if r["scheme"] == name), key=lambda r: r["hosts"])
        hosts = [r["hosts"] for r in rows]
        axes[0].plot(hosts, [max(r["p_loss_window"], 1e-12) for r in rows], "o-", label=name)
        axes[1].plot(hosts, [max(r["p_loss_burst_random"], 1e-4) for r in rows], "o-", label=name)
        axes[2].bar(name, rows[0]["memory_per_host"], label=name)
    p = records[0]["params"]
    axes[0].set_title(f"P(state lost), independent failures, {p['window_min']:g} min window")
    axes[1].set_title(f"P(state lost), {p['burst']} hosts at random (floor 1e-4)")
    axes[2].set_title("snapshot memory per host (x blob)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("hosts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("ecsnap bench scale: a model of RS against replication (not a measurement)")
    fig.tight_layout()
    out = HERE / "scale.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _time_bars(name: str, title: str, full_only: bool = True) -> Path | None:
    """Median seconds with p10-p90 whiskers of every timed contender of the newest run."""
    runs = newest_run(name, full_only)
    # the contenders timed again beside the replication phase are there for its drift check only
    records = [
        r for r in runs if r.get("kind") == "time" and not r["name"].endswith("_replication_phase")
    ]
    if not records:
        return None
    records.sort(key=lambda r: r["median_s"])
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(records) + 1.5))
    ys = range(len(records))
    med = [r["median_s"] for r in records]
    err = [
        [r["median_s"] - r["p10_s"] for r in records],
        [r["p90_s"] - r["median_s"] for r in records],
    ]
    colors = [
        "tab:blue"
        if r["name"].startswith("replication")
        else "tab:green"
        if "ecsnap" in r["name"]
        or "persist" in r["name"]
        or "restore" in r["name"]
        or "rebuild" in r["name"]
        else "tab:gray"
        for r in records
    ]
    ax.barh(list(ys), med, xerr=err, capsize=2, color=colors)
    ax.set_yticks(list(ys), [r["name"] for r in records], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (median, p10-p90), log scale")
    ax.grid(axis="x", alpha=0.3)
    params = records[0]["params"]
    size = params.get("state_bytes", 0) / 1e9
    ax.set_title(
        f"{title}: {size:.2f} GB state, {params.get('hosts', '?')} hosts "
        f"(commit {records[0]['commit']})\ngreen: ecsnap; blue: ecsnap's daemons replicating; "
        "gray: the alternatives",
        fontsize=10,
    )
    fig.tight_layout()
    out = HERE / f"{name}.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def store_chart() -> Path | None:
    return _time_bars("store", "ecsnap bench store")


def persist_chart() -> Path | None:
    return _time_bars("persist", "ecsnap bench persist")


def train_chart() -> Path | None:
    records = [r for r in newest_run("train", True) if r.get("kind") == "overhead"]
    if not records:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["name"] for r in records]
    med = [r["median"] for r in records]
    err = [
        [r["median"] - min(r["samples"]) for r in records],
        [max(r["samples"]) - r["median"] for r in records],
    ]
    colors = ["tab:green" if n.startswith("ecsnap") else "tab:gray" for n in names]
    ax.bar(names, med, yerr=err, capsize=4, color=colors)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_ylabel("step time overhead, % (median, min-max over repeats)")
    p = records[0]["params"]
    ax.set_title(
        f"training overhead of snapshots every N steps: {p['world']} ranks, "
        f"{p['model_size']} GPT (commit {records[0]['commit']})",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = HERE / "train.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def control_chart() -> Path | None:
    """The control plane per daemon per step against the number of hosts: measured (bench
    control) and carried to 16,384 hosts (bench scale), beside the control plane before."""
    measured = [r for r in newest_run("control") if r.get("kind") == "cost"]
    if not measured:
        return None
    model = [r for r in newest_run("scale") if r.get("kind") == "control"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [
        ("cpu_s_per_step", "before_cpu_s_per_step", "daemon CPU s per step", 1.0),
        ("gathered_bytes_per_step", None, "bytes gathered per daemon per step", 1.0),
        ("metadata_bytes_per_step", "before_metadata_bytes_per_step", "metadata MB per host", 1e6),
    ]
    for ax, (key, before, title, scale) in zip(axes, panels, strict=True):
        xs = [r["hosts"] for r in measured]
        ax.plot(xs, [r[key] / scale for r in measured], "o-", label="measured (bench control)")
        if model:
            mx = [r["hosts"] for r in model]
            ax.plot(mx, [r[key] / scale for r in model], "--", label="a + b log2 N (bench scale)")
            if before:
                ax.plot(
                    mx,
                    [r[before] / scale for r in model],
                    ":",
                    label="before (linear, measured at 4, 12)",
                )
            if key == "gathered_bytes_per_step":
                ax.plot(
                    mx,
                    [r["reduction_wire_bytes_per_step"] for r in model],
                    ":",
                    label="reductions on the wire",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("hosts")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    run = measured[0]
    fig.suptitle(
        f"control plane, {run['params']['tensors']} tensors per rank, RS(3,1) groups, a snapshot "
        f"every {run['params']['interval_s']:g} s step (run {run['run_id']})"
    )
    fig.tight_layout()
    out = HERE / "control.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def newest_per_fault() -> list[dict[str, Any]]:
    """Each fault's newest line with the most trials (a full matrix may span several runs)."""
    path = RESULTS / "faults.jsonl"
    if not path.exists():
        return []
    best: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, line in enumerate(path.read_text().splitlines()):
        r = json.loads(line) if line.strip() else {}
        if r.get("kind") != "fault":
            continue
        old = best.get(r["name"])
        if old is None or r["trials"] >= old[1]["trials"]:
            best[r["name"]] = (i, r)
    return [r for _, r in sorted(best.values(), key=lambda x: x[0])]  # in the order they ran


def faults_chart() -> Path | None:
    records = newest_per_fault()
    if not records:
        return None
    fig, ax = plt.subplots(figsize=(11, 4))
    names = [r["name"] for r in records]
    x = range(len(names))
    ax.bar([i - 0.3 for i in x], [r["trials"] for r in records], 0.3, label="trials")
    ax.bar(list(x), [r["faults_fired"] for r in records], 0.3, label="injected faults fired")
    ax.bar(
        [i + 0.3 for i in x],
        [r["lost"] for r in records],
        0.3,
        label="violations (lost)",
        color="tab:red",
    )
    ax.set_xticks(list(x), names, rotation=40, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        f"fault matrix (runs {', '.join(sorted({r['run_id'] for r in records}))}): every "
        "protected step read back bit-exact after every fault",
        fontsize=10,
    )
    fig.tight_layout()
    out = HERE / "faults.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def incremental_chart() -> Path | None:
    """Per tune (LoRA, full fine-tune) and mode: put->protected, bytes sent per step, and memory
    held with --keep 2 and 8, each against whole snapshots of the same state."""
    records = [
        r for r in newest_run("incremental", True) if r.get("kind") == "time" and "tune" in r
    ]
    if not records:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [r["name"] for r in records]
    colors = [
        {"incremental": "tab:green", "whole": "tab:blue", "dcp": "tab:gray", "fixed": "tab:orange"}[
            r["mode"]
        ]
        for r in records
    ]
    ys = list(range(len(records)))
    med = [r["median_s"] * 1e3 for r in records]
    err = [
        [(r["median_s"] - r["p10_s"]) * 1e3 for r in records],
        [(r["p90_s"] - r["median_s"]) * 1e3 for r in records],
    ]
    axes[0].barh(ys, med, xerr=err, capsize=2, color=colors)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("ms per snapshot (median, p10-p90): put->protected; DCP until written")
    axes[0].set_yticks(ys, labels, fontsize=8)
    ours = [i for i, r in enumerate(records) if r["mode"] != "dcp"]  # DCP: no daemons
    sent = [records[i]["sent_bytes_median"] / 1e6 for i in ours]
    axes[1].barh(ours, sent, color=[colors[i] for i in ours])
    axes[1].set_xscale("log")
    axes[1].set_xlabel("MB sent per step between daemons (median)")
    axes[1].set_yticks(ys, [""] * len(ys))
    held = [records[i]["held_bytes_median"] / 1e6 for i in ours]
    axes[2].barh(ours, held, color=[colors[i] for i in ours])
    axes[2].set_xlabel("MB held in memory after the run (data + parity, every host)")
    axes[2].set_yticks(ys, [""] * len(ys))
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    p = records[0]["params"]
    fig.suptitle(
        f"snapshots that cost what changed: GPT d={p['size']['d']} x {p['size']['layers']} layers, "
        f"{p['world']} ranks, RS({p['k']},{p['m']}), a snapshot every step "
        f"(commit {records[0]['commit']})\ngreen: incremental (default); blue: whole; "
        "gray: DCP async_save; orange: a put of 1 kB per rank (what any put costs here)",
        fontsize=10,
    )
    fig.tight_layout()
    out = HERE / "incremental.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


CHARTS = {
    "codec": codec_chart,
    "control": control_chart,
    "scale": scale_chart,
    "store": store_chart,
    "persist": persist_chart,
    "train": train_chart,
    "incremental": incremental_chart,
    "faults": faults_chart,
}


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CHARTS)
    for name in names:
        if name not in CHARTS:
            print(f"unknown chart {name!r}; known: {', '.join(CHARTS)}", file=sys.stderr)
            return 2
        out = CHARTS[name]()
        print(f"{name}: {out if out else 'no results yet in bench/results/'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
