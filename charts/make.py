"""Regenerate every chart in ``charts/`` from ``bench/results/*.jsonl`` only.

    python charts/make.py            # all charts whose results exist
    python charts/make.py codec      # one

Each chart uses the newest run (``run_id``) in its results file.
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


def newest_run(name: str) -> list[dict[str, Any]]:
    path = RESULTS / f"{name}.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
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


CHARTS = {"codec": codec_chart, "scale": scale_chart}


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
