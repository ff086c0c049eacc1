"""``ecsnap bench train``: what snapshots cost a real training loop, ecsnap against DCP async_save.

The demo's GPT (data parallel over a gloo group of 4 CPU ranks, ZeRO-sharded AdamW, stateful
dataloader) trains for a fixed number of steps in each mode, the modes interleaved per repeat:

- ``none``: no snapshots (the baseline of this repeat);
- ``ecsnap/N``: ``store.put`` of the full training state every N steps (1 and 10), waiting only
  for the previous put's copy before ``optimizer.step()``;
- ``dcp/N``: ``dcp.async_save`` of the same state every N steps to /dev/shm, waiting for the
  previous save to finish before the next one (as DCP requires).

Each repeat runs the modes in turn, starting one mode later than the repeat before: over five
repeats every mode runs once in every place, so that a drift within a repeat does not always
favour the same mode.

Overhead of a mode = its mean step time / the same repeat's ``none`` mean step time - 1 (mean,
not median: the snapshot steps are the cost). The daemons run through every mode, ``none``
included, so what they cost while idle is in the baseline, not in an overhead: it is reported
beside them, as the CPU the daemons used over each ``none`` run, a share of the machine's
cores. Results: JSON lines in ``bench/results/train.jsonl`` with medians and p10/p90 over
repeats; the ratio of ecsnap's overhead to DCP's at each frequency (target: <= 0.25; no verdict
where DCP's overhead is itself below zero in a repeat: noise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from bench._common import Recorder, add_root_option, exit_on_sigterm, run_dir, table
from bench.harness import Cluster, close_all, gloo_ranks

WORLD = 4
REPO = Path(__file__).resolve().parent.parent


def worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from bench.demo_train import GPT, MODEL_SIZES, Windows, average_gradients, corpus

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # DCP's background save runs collectives: on its own group, never the training one's
    ckpt_group = dist.new_group(backend="gloo")
    size = MODEL_SIZES[cfg["model_size"]]
    torch.manual_seed(0)
    model = GPT(size["d"], size["layers"], size["heads"], size["seq"])
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
    data = Windows(corpus(), size["seq"], rank, world)
    batches = [data[i * size["batch"] + j] for i in range(8) for j in range(size["batch"])]
    kind, every = cfg["mode"].split("/") if "/" in cfg["mode"] else (cfg["mode"], "0")
    every_n = int(every)
    store = None
    if kind == "ecsnap":
        import storage

        store = storage.connect(cfg["job"], rank=rank, world_size=world, root=cfg["root"])
    handle: Any = None
    future: Any = None
    params = list(model.parameters())
    times = []
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        i = step % 8
        batch = torch.stack(batches[i * size["batch"] : (i + 1) * size["batch"]])
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        average_gradients(params, world)
        if handle is not None:
            handle.staged.result()  # the last snapshot's copy must be done before the update
        zero.step()
        zero.zero_grad(set_to_none=False)
        if every_n and step % every_n == 0:
            state = {
                "model": model.state_dict(),
                "optim": zero.optim.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step,
            }
            if store is not None:
                handle = store.put(cfg["step0"] + step, state)
            else:
                from torch.distributed.checkpoint.state_dict_saver import async_save

                if future is not None:
                    future.result()  # DCP: one async save in flight at a time
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    future = async_save(
                        {f"rank{rank}": state},  # every rank writes its own (no dedup)
                        checkpoint_id=str(Path(cfg["dcp_dir"]) / f"step-{step}"),
                        process_group=ckpt_group,
                    )
        times.append(time.perf_counter() - t0)
    if future is not None:
        future.result()
    if handle is not None:
        handle.wait(120)
    if store is not None:
        store.close()
    dist.barrier()
    dist.destroy_process_group()
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print(json.dumps({"times": times, "model_bytes": nbytes}), flush=True)


def _run(mode: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return gloo_ranks("bench.train", {**cfg, "mode": mode}, WORLD, f"mode {mode}")


def daemons_cpu(daemons: Cluster) -> float:
    """CPU seconds the daemons of a :class:`~bench.harness.Cluster` have used so far, summed
    over its hosts (their ``info``)."""
    stores = daemons.stores(WORLD)
    try:
        return float(sum(sum(s.info()["cpu"].values()) for s in stores))
    finally:
        close_all(stores)


def run(
    quick: bool = False,
    repeats: int | None = None,
    steps: int | None = None,
    under: Path | None = None,
) -> None:
    from bench._common import summarize

    repeats = repeats or (2 if quick else 5)
    steps = steps or (20 if quick else 40)
    warmup = 5
    model_size = "small" if quick else "medium"
    modes = ["none", "ecsnap/1", "dcp/1", "ecsnap/10", "dcp/10"]
    root, huge = run_dir(under, "ecsnap-train")
    job = "train"
    rec = Recorder(
        "train",
        {
            "quick": quick,
            "world": WORLD,
            "hosts": WORLD,
            "k": 3,
            "m": 1,
            "steps": steps,
            "warmup": warmup,
            "repeats": repeats,
            "model_size": model_size,
            "root": str(root.parent),
            "huge_pages": huge,
        },
    )
    daemons = Cluster(root, hosts=WORLD, k=3, m=1, job=job, log=root / "daemons.log")
    overhead: dict[str, list[float]] = {m: [] for m in modes if m != "none"}
    idle_share: list[float] = []  # the idle daemons' CPU over the ``none`` runs / the cores
    step_s: dict[str, list[float]] = {m: [] for m in modes}
    model_bytes = 0
    try:
        step0 = 0
        for r in range(repeats):
            means = {}
            # each repeat starts one mode later: over as many repeats as modes, every mode runs
            # once in every place (one repeat ran none first at 1170 ms a step, ecsnap/10 later
            # at 1050: a drift within a repeat as large as the overheads)
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                dcp_dir = root / f"dcp-{r}-{mode.replace('/', '-')}"
                cfg = {
                    "job": job,
                    "root": str(root),
                    "steps": steps,
                    "step0": step0,
                    "model_size": model_size,
                    "dcp_dir": str(dcp_dir),
                }
                step0 += steps
                if mode == "none":
                    cpu0, t0 = daemons_cpu(daemons), time.monotonic()
                res = _run(mode, cfg)
                if mode == "none":
                    seconds = time.monotonic() - t0
                    idle_share.append(
                        100.0 * (daemons_cpu(daemons) - cpu0) / (seconds * (os.cpu_count() or 1))
                    )
                shutil.rmtree(dcp_dir, ignore_errors=True)
                model_bytes = res[0]["model_bytes"]
                # the job's step time: the slowest rank's mean after warm-up
                means[mode] = max(statistics.fmean(x["times"][warmup:]) for x in res)
                step_s[mode].append(means[mode])
            for mode in overhead:
                overhead[mode].append(100.0 * (means[mode] / means["none"] - 1.0))
            print(
                f"repeat {r + 1}/{repeats}: "
                + ", ".join(f"{m} {means[m] * 1e3:.1f}ms" for m in modes),
                file=sys.stderr,
            )
    finally:
        daemons.stop(60)
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for mode, s in step_s.items():
        stats = summarize(s)
        rec.add(kind="time", name=f"step_{mode}", unit="s", model_bytes=model_bytes, **stats)
    for mode, s in overhead.items():
        q = sorted(s)
        med = statistics.median(q)
        rec.add(
            kind="overhead",
            name=mode,
            unit="percent",
            median=med,
            p10=q[0] if len(q) < 3 else statistics.quantiles(q, n=10, method="inclusive")[0],
            p90=q[-1] if len(q) < 3 else statistics.quantiles(q, n=10, method="inclusive")[-1],
            samples=q,
        )
        rows.append((mode, med, min(q), max(q)))
    q = sorted(idle_share)
    rec.add(
        kind="idle",
        name="daemons' CPU while training without snapshots",
        unit="percent of the cores",
        median=statistics.median(q),
        samples=q,
        cores=os.cpu_count(),
    )
    rows.append(("(idle daemons' CPU, % of cores)", statistics.median(q), q[0], q[-1]))
    ratios = []
    for n in ("1", "10"):
        e, d = statistics.median(overhead[f"ecsnap/{n}"]), statistics.median(overhead[f"dcp/{n}"])
        value = e / d if d > 0 else float("inf")
        # when DCP's own overhead is below zero in a repeat, it is within the noise: no verdict
        noise = min(overhead[f"dcp/{n}"]) <= 0.0
        met = None if noise else value <= 0.25
        rec.add(
            kind="ratio",
            name=f"ecsnap overhead / DCP async_save overhead, every {n}",
            value=value,
            target="<= 0.25",
            met=met,
            within_noise=noise,
            unit="ratio of median overheads",
        )
        verdict = "noise" if met is None else ("yes" if met else "NO")
        ratios.append((f"every {n} step(s)", value, "<= 0.25", verdict))
    path = rec.write()
    print(table(rows, ["mode", "overhead % (median)", "min", "max"]))
    print()
    print(table(ratios, ["ecsnap / DCP overhead", "value", "target", "met"]))
    print(f"\nwrote {len(rec.records)} records to {path}")


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        prog="ecsnap bench train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small model, 20 steps, 2 repeats")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    add_root_option(p)
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    run(quick=a.quick, repeats=a.repeats, steps=a.steps, under=a.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
