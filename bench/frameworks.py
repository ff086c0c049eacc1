"""``ecsnap bench frameworks``: what a checkpoint every step costs a Lightning training loop, with
ecsnap's ``SnapshotCheckpointIO`` against Lightning's own checkpoint file, in one run.

One process trains a model of ``--params`` parameters (one square linear layer) with AdamW (so
a checkpoint is about 12 bytes a parameter: weights and two moments), ``ModelCheckpoint(
every_n_train_steps=1, save_top_k=1)``, in three modes, each a fresh process, alternated
``--repeats`` times: ``none`` (no checkpoint), ``file`` (Lightning's own ``.ckpt`` under a temp
directory) and ``ecsnap`` (the daemons of 2 virtual hosts started for the run). The time of each
training step after ``--warmup`` is taken from the loop itself (batch end to batch end). The
figure of merit is each mode's cost over training alone: ``(median(mode) - median(none))``, and
its ratio ecsnap / file (goal: at most 0.5). JSON lines in ``bench/results/frameworks.jsonl``.

    ecsnap bench frameworks                      # 6.25M parameters (a 75 MB checkpoint)
    ecsnap bench frameworks --params 25000000 --steps 40
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import Recorder, table

__all__ = ["main"]

MODES = ("none", "file", "ecsnap")


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One training run in this process; returns its step times."""
    import warnings

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    warnings.filterwarnings("ignore")
    width = int(spec["params"] ** 0.5)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(width, width, bias=False)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            (x,) = batch
            loss: torch.Tensor = self.net(x).square().mean()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.t.append(time.perf_counter())

    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(spec["steps"] * 8, width))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    clock = Clock()
    callbacks: list[Any] = [clock]
    plugins: list[Any] = []
    if spec["mode"] != "none":
        callbacks.append(ModelCheckpoint(dirpath=spec["dir"], every_n_train_steps=1, save_top_k=1))
    if spec["mode"] == "ecsnap":
        from storage.lightning import SnapshotCheckpointIO

        plugins.append(SnapshotCheckpointIO(spec["job"], root=spec["root"], host="host0"))
    trainer = L.Trainer(
        max_steps=spec["steps"],
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=spec["dir"],
    )
    trainer.fit(Net(), loader)
    gaps = [b - a for a, b in zip(clock.t, clock.t[1:], strict=False)]
    return {"step_s": gaps[spec["warmup"] :]}


def _run(spec: dict[str, Any]) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.frameworks", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{spec['mode']} run failed:\n{out.stderr[-3000:]}")
    return list(json.loads(out.stdout.strip().splitlines()[-1])["step_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ecsnap bench frameworks", description=__doc__)
    p.add_argument("--params", type=int, default=6_250_000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return 0
    from bench.harness import Cluster

    root = Path("/dev/shm") / f"ecsnap-bench-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    work = Path(tempfile.mkdtemp(prefix="ecsnap-frameworks-"))
    params = {"params": a.params, "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats}
    rec = Recorder("frameworks", params)
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    cluster = Cluster(root, hosts=2, k=1, m=1, extra=["--keep", "2"])
    try:
        for r in range(a.repeats):
            for mode in MODES:
                d = work / f"{mode}-{r}"
                d.mkdir()
                spec = {
                    "mode": mode,
                    "params": a.params,
                    "steps": a.steps,
                    "warmup": a.warmup,
                    "dir": str(d),
                    "job": cluster.job,
                    "root": str(root),
                }
                # each run of ecsnap starts at step 1 again: the job is emptied between runs
                if mode == "ecsnap" and r:
                    cluster.stop()
                    shutil.rmtree(root / cluster.job, ignore_errors=True)
                    cluster = cluster.relaunch()
                samples[mode] += _run(spec)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows, med = rec.times(samples, lightning="single process")
    base = med["none"]
    cost = {m: med[m] - base for m in ("file", "ecsnap")}
    ratio = cost["ecsnap"] / cost["file"] if cost["file"] > 0 else float("nan")
    rec.add(
        kind="ratio",
        name="ecsnap_cost_over_file_cost",
        unit="x",
        value=ratio,
        goal=0.5,
        step_median_s={m: med[m] for m in MODES},
    )
    path = rec.write()
    print(table(rows, ["mode", "median s", "p10 s", "p90 s"]))
    print(
        f"checkpoint cost per step over training alone: file {cost['file'] * 1e3:.1f} ms, "
        f"ecsnap {cost['ecsnap'] * 1e3:.1f} ms: ecsnap/file = {ratio:.2f} (goal <= 0.5); "
        f"median step without checkpoints {statistics.median(samples['none']) * 1e3:.1f} ms; "
        f"wrote {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
