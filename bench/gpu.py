"""``python -m bench.gpu``: the CUDA path on a GPU machine, in a few minutes.

Measures, in one run on one GPU:

- device-to-host copy GB/s of a ~1B-parameter state: into ecsnap's registered shared memory
  (``put`` -> staged) against torch's own pinned-memory copy (``tensor.to("cpu",
  non_blocking=True)`` into ``pin_memory()`` buffers);
- a training loop of a ~1B-parameter GPT-style model: step time with no snapshots, with a
  snapshot every step (``store.guard`` on the optimizer), and the overhead in percent, medians
  and spreads over the measured steps.

It starts 2 virtual hosts (RS(1,1)) itself, writes ``bench/results/gpu.jsonl`` (and a copy under
``$OUT`` when set), and needs nothing from the network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench._common import Recorder, summarize, table


def _model(d: int, layers: int) -> torch.nn.Module:
    blocks = [
        torch.nn.TransformerEncoderLayer(
            d, d // 128, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks)


def _sync_time(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(steps: int, d: int, layers: int, quick: bool) -> None:
    import storage
    from bench.harness import Cluster

    assert torch.cuda.is_available(), "bench.gpu needs a CUDA device"
    dev = torch.device("cuda")
    rec = Recorder(
        "gpu",
        {
            "steps": steps,
            "d": d,
            "layers": layers,
            "quick": quick,
            "device": torch.cuda.get_device_name(dev),
        },
    )
    root = Path("/dev/shm") / f"ecsnap-gpu-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    daemons = Cluster(root, hosts=2, k=1, m=1, job="gpu", log=root / "daemons.log")
    try:
        store = storage.connect("gpu", rank=0, world_size=1, host="host0", root=root)
        torch.manual_seed(0)
        model = _model(d, layers).to(dev)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randn(8, 512, d, device=dev)

        def train_step() -> None:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        for _ in range(3):
            train_step()  # optimizer state exists from here on
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
        # 1. device-to-host bandwidth: ecsnap's registered shared memory vs torch pinned memory
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in _tensors(state)]

        def torch_pinned() -> None:
            for dst, src in zip(pinned, _tensors(state), strict=True):
                dst.copy_(src, non_blocking=True)

        copies: dict[str, list[float]] = {"torch_pinned_copy": [], "ecsnap_put_staged": []}
        for i in range(2 + (3 if quick else 8)):
            t_torch = _sync_time(torch_pinned)
            t0 = time.perf_counter()
            h = store.put(1000 + i, state)
            h.staged.result()
            t_put = time.perf_counter() - t0
            h.wait(120)
            if i >= 2:
                copies["torch_pinned_copy"].append(t_torch)
                copies["ecsnap_put_staged"].append(t_put)
        rows = []
        for name, s in copies.items():
            stats = summarize(s)
            gbps = nbytes / stats["median_s"] / 1e9
            rec.add(kind="d2h", name=name, bytes=nbytes, gbps=gbps, unit="GB/s", **stats)
            rows.append((name, gbps, stats["median_s"]))
        # 2. step time: no snapshots, then a snapshot every step behind the optimizer guard
        hook = None
        step_times: dict[str, list[float]] = {"no_snapshot": [], "snapshot_every_step": []}
        for mode in ("no_snapshot", "snapshot_every_step", "no_snapshot", "snapshot_every_step"):
            if mode == "snapshot_every_step" and hook is None:
                hook = store.guard(opt)
            if mode == "no_snapshot" and hook is not None:
                hook.remove()
                hook = None
            last = None
            for i in range(steps):
                t = _sync_time(train_step)
                if mode == "snapshot_every_step":
                    t0 = time.perf_counter()
                    if last is not None:
                        last.wait(120)  # bound the pipeline to one put in flight
                    last = store.put(2000 + len(step_times[mode]) * 10 + i, state)
                    t += time.perf_counter() - t0
                if i >= 3:
                    step_times[mode].append(t)
            if last is not None:
                last.wait(120)
        for name, s in step_times.items():
            rec.add(kind="step", name=name, params=params, unit="s", **summarize(s))
        base = statistics.median(step_times["no_snapshot"])
        snap = statistics.median(step_times["snapshot_every_step"])
        overhead = (snap / base - 1) * 100
        rec.add(
            kind="ratio",
            name="step-time overhead, snapshot every step",
            value=overhead,
            unit="percent",
            target="<= 1",
            met=overhead <= 1.0,
        )
        ratio = rows[1][1] / rows[0][1]
        rec.add(
            kind="ratio",
            name="ecsnap D2H GB/s / torch pinned copy GB/s",
            value=ratio,
            unit="ratio of medians",
        )
        path = rec.write()
        print(table(rows, ["copy", "GB/s", "median s"]))
        print(
            f"\n{params / 1e9:.2f}B parameters, state {nbytes / 1e9:.1f} GB; step "
            f"{base * 1e3:.1f} ms without snapshots, {snap * 1e3:.1f} ms with one every step: "
            f"overhead {overhead:+.2f} %"
        )
        out = os.environ.get("OUT")
        if out:
            shutil.copy(path, Path(out) / path.name)
        store.close()
    finally:
        daemons.stop(60)
        shutil.rmtree(root, ignore_errors=True)


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20, help="20 x 2048: about 1B parameters")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    run(a.steps, a.d, a.layers, a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
