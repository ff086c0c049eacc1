"""``ecsnap bench incremental``: snapshots of fine-tuning that cost what changed.

The demo's GPT (``bench.demo_train.GPT``, here with d=1024 and 4 layers: 50 M parameters) on
4 CPU ranks, 4 virtual hosts, RS(3,1). Every rank trains the same replica on the same batches
(data parallel without the all-reduce, which changes nothing here) and puts the quarter of the
state it owns (its tensors and their optimizer state; tensors given out by bytes, as DCP's dedup
gives out replicated ones: :func:`_quarter`), a snapshot every step:

- ``lora``: the base weights frozen, rank-8 adapters on both linears of every MLP, AdamW on the
  adapters only (about 98 % of the bytes never change);
- ``full``: the same model fully fine-tuned with AdamW (every byte changes every step).

For each, in the same run (each mode in a storage job of its own): ``incremental`` (unchanged
tensors stored as references, the default), ``whole`` (``incremental=False``: every byte
copied, encoded and sent as before), and ``dcp`` (``torch.distributed.checkpoint.async_save``
to /dev/shm, until written). Measured per step: put→protected (DCP: until written), bytes
copied, hashed, encoded and sent; at the end of a mode, memory held (data + parity on every
host), against one whole step's. Twice: with ``--keep 2`` and ``--keep 8``. The first steps of
each mode are warm-up. With ``--keep 2`` also ``fixed``: the LoRA training, but each rank puts
1 kB, so its put→protected is what every put costs here whatever it holds (the requests, the
rounds that stage, encode, protect and acknowledge it), and whole / fixed is the most any
incremental put could gain on this machine. Also, for one stripe whose data changed in one
chunk: parity by ``ec_encode_data_update`` of the change against a new encode, and the bytes
each moves.

Targets: 98 % frozen: put→protected >= 10x faster than whole, memory with --keep 8 <= 1.3x one
whole step, bytes sent per step <= 5 % of whole's; nothing frozen: incremental <= 1.05x whole.
JSON lines in ``bench/results/incremental.jsonl``; chart: ``python charts/make.py incremental``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from bench._common import Recorder, exit_on_sigterm, interleaved, summarize, table
from bench.harness import gloo_ranks

WORLD = 4
REPO = Path(__file__).resolve().parent.parent
MODELS = {
    "quick": {"d": 256, "layers": 2, "heads": 4, "seq": 16, "batch": 2},
    "full": {"d": 1024, "layers": 4, "heads": 8, "seq": 32, "batch": 2},
}
RANK = 8  # the adapters' rank
WARMUP = 3  # steps of each mode left out of the medians


def _lora(model: Any, rank: int) -> None:
    """Freeze ``model`` and give both linears of every MLP a rank-``rank`` adapter."""
    import torch
    from torch import nn

    class LoRA(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.base(x) + (x @ self.a.t()) @ self.b.t()
            return out

    model.requires_grad_(False)
    for block in model.blocks:
        block.mlp[0] = LoRA(block.mlp[0])
        block.mlp[2] = LoRA(block.mlp[2])


def _quarter(sd: dict[str, Any], world: int) -> list[set[str]]:
    """Which rank puts each tensor of the replicated model: the largest first, each to the rank
    with the fewest bytes so far, as DCP's dedup of replicated tensors assigns them. Each rank
    then puts about a quarter of the bytes. (Every 4th key instead gave one rank 152 of the 205
    MB of the LoRA state and two ranks about 1 MB: the slowest rank's put measured one rank
    hashing and copying three quarters of the state.)"""
    load = [0] * world
    out: list[set[str]] = [set() for _ in range(world)]
    for key in sorted(sd, key=lambda k: (-sd[k].nbytes, k)):
        r = load.index(min(load))
        out[r].add(key)
        load[r] += sd[key].nbytes
    return out


def worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from bench.demo_train import GPT, Windows, corpus

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    size = cfg["size"]
    torch.manual_seed(0)
    model = GPT(size["d"], size["layers"], size["heads"], size["seq"])
    if cfg["tune"] == "lora":
        _lora(model, RANK)
    names: dict[Any, str] = {p: n for n, p in model.named_parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    keys = list(model.state_dict())
    mine = _quarter(model.state_dict(), world)[rank]
    data = Windows(corpus(), size["seq"], 0, 1)
    batches = [
        torch.stack([data[i * size["batch"] + j] for j in range(size["batch"])]) for i in range(8)
    ]
    store = None
    # DCP's background save runs collectives: on its own group, never the training one's
    ckpt_group = dist.new_group(backend="gloo") if cfg["mode"] == "dcp" else None
    if cfg["mode"] != "dcp":
        import storage

        store = storage.connect(
            cfg["job"],
            rank=rank,
            world_size=world,
            root=cfg["root"],
            incremental=cfg["mode"] == "incremental",
        )
    steps = []
    for step in range(cfg["steps"]):
        batch = batches[step % 8]
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        sd = model.state_dict()
        optim: dict[str, Any] = {names[p]: s for p, s in opt.state.items() if names[p] in mine}
        owned = {k: sd[k] for k in keys if k in mine}
        state = {"model": owned, "optim": optim, "step": step}
        if cfg["mode"] == "fixed":  # the same training, a put of 1 kB: what any put costs here
            state = {"step": step, "x": torch.full((256,), float(step))}
            owned, optim = {"x": state["x"]}, {}
        leaf_bytes = sum(t.nbytes for t in owned.values()) + sum(
            t.nbytes for s in optim.values() for t in s.values()
        )
        dist.barrier()
        row: dict[str, Any] = {"step": step, "state_bytes": leaf_bytes}
        if store is not None:
            before = store.info()
            h = store.put(cfg["step0"] + step, state)
            h.wait(300)
            after = store.info()
            plan = h.plan
            assert h.t_protected is not None
            row.update(
                seconds=h.t_protected - h.t_put,
                copied=plan.own_bytes if plan is not None else leaf_bytes,
                referred=plan.ref_bytes if plan is not None else 0,
                hashed=plan.hashed_bytes if plan is not None else 0,
                encoded=after["stats"]["encode_bytes"] - before["stats"]["encode_bytes"],
                sent=after["sent_bytes"] - before["sent_bytes"],
            )
        else:
            from torch.distributed.checkpoint.state_dict_saver import async_save

            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                future: Any = async_save(
                    {f"rank{rank}": state},
                    checkpoint_id=str(Path(cfg["dcp_dir"]) / f"step-{step}"),
                    process_group=ckpt_group,
                )
            future.result()
            row["seconds"] = time.perf_counter() - t0
        steps.append(row)
        dist.barrier()
    out: dict[str, Any] = {"steps": steps}
    if store is not None:
        info = store.info()
        st = store.status(cfg["step0"] + cfg["steps"] - 1)
        out.update(
            held=info["data_bytes"] + info["parity_bytes"],
            last_step_bytes=st.data_bytes + st.parity_bytes,
        )
        store.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def _run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return gloo_ranks("bench.incremental", cfg, WORLD, f"{cfg['tune']}/{cfg['mode']}", 3600)


def _update_vs_encode(rec: Recorder, repeats: int) -> list[tuple[Any, ...]]:
    """One RS(3,1) stripe of 1 MiB chunks whose first chunk changed: parity by a new encode of
    the stripe, against ``ec_encode_data_update`` of the change (old XOR new) alone."""
    import numpy as np

    from codec import RSCodec

    cb, k = 1 << 20, 3
    rs = RSCodec(k, 1)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, cb, dtype=np.uint8) for _ in range(k)]
    new = data[0].copy()
    new[: cb // 4] ^= 1
    parity = rs.encode(data)
    delta = np.empty(cb, dtype=np.uint8)

    def encode() -> None:
        rs.encode_into([new, data[1], data[2]], parity)

    def update() -> None:
        np.bitwise_xor(data[0], new, out=delta)
        rs.update(0, delta, parity)

    samples = interleaved({"new encode": encode, "update": update}, repeats, 3, min_time=0.05)
    _, med = rec.times(samples, op="parity of a stripe with one changed chunk", chunk=cb, k=k)
    rec.add(kind="bytes", name="moved to the parity holder, new encode", value=k * cb)
    rec.add(kind="bytes", name="moved to the parity holder, update", value=cb)
    return [
        ("new encode", med["new encode"] * 1e3, k * cb / 1e6),
        ("ec_encode_data_update", med["update"] * 1e3, cb / 1e6),
    ]


def run(quick: bool = False) -> None:
    from bench.harness import Cluster

    size = MODELS["quick" if quick else "full"]
    keeps = (2, 8)
    root = Path("/dev/shm") / f"ecsnap-incr-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    rec = Recorder(
        "incremental",
        {"quick": quick, "world": WORLD, "hosts": 4, "k": 3, "m": 1, "size": size, "rank": RANK},
    )
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        for keep in keeps:
            for tune in ("lora", "full"):
                modes = ["incremental", "whole"]
                if keep == keeps[0]:  # DCP, and (LoRA) the cost of any put: once is enough
                    modes += ["dcp", "fixed"] if tune == "lora" else ["dcp"]
                for mode in modes:
                    # a storage job of its own: what the last mode held (and the files made
                    # ahead for its sizes) is not in this one's memory
                    job = f"{tune}-{mode}-{keep}"
                    daemons = None
                    if mode != "dcp":
                        extra = ["--keep", str(keep)]
                        daemons = Cluster(
                            root, hosts=4, k=3, m=1, job=job, extra=extra, log=root / "d.log"
                        )
                    dcp_dir = root / f"dcp-{tune}"
                    cfg = {
                        "job": job,
                        "root": str(root),
                        "steps": keep + WARMUP + 3,
                        "step0": 0,
                        "size": size,
                        "tune": tune,
                        "mode": mode,
                        "dcp_dir": str(dcp_dir),
                    }
                    t0 = time.monotonic()
                    try:
                        results[(tune, mode, keep)] = _run(cfg)
                    finally:
                        if daemons is not None:
                            daemons.stop(60)
                        shutil.rmtree(root / job, ignore_errors=True)
                        shutil.rmtree(dcp_dir, ignore_errors=True)
                    print(
                        f"keep {keep} {tune}/{mode}: {time.monotonic() - t0:.0f} s", file=sys.stderr
                    )
    except BaseException:
        log = root / "d.log"
        if log.exists():  # the daemons' side of what went wrong, before it is removed
            print("".join(log.read_text().splitlines(True)[-40:]), file=sys.stderr)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows: list[tuple[Any, ...]] = []
    med: dict[tuple[str, str, int], dict[str, float]] = {}
    for (tune, mode, keep), ranks in results.items():
        n = len(ranks[0]["steps"])
        per_step: dict[str, list[float]] = {}
        for i in range(WARMUP, n):
            # the job's step: the slowest rank's time, every rank's bytes
            rows_i = [r["steps"][i] for r in ranks]
            per_step.setdefault("seconds", []).append(max(x["seconds"] for x in rows_i))
            for field in ("copied", "referred", "hashed", "encoded", "sent", "state_bytes"):
                if field in rows_i[0]:
                    per_step.setdefault(field, []).append(sum(x[field] for x in rows_i))
        m = {f: statistics.median(v) for f, v in per_step.items()}
        if "held" in ranks[0]:
            m["held"] = sum(r["held"] for r in ranks)
            m["last_step"] = ranks[0]["last_step_bytes"]
        med[(tune, mode, keep)] = m
        stats = summarize(per_step["seconds"])
        rec.add(
            kind="time",
            name=f"{tune}/{mode}/keep{keep}",
            what="put→protected" if mode != "dcp" else "async_save until written",
            unit="s",
            tune=tune,
            mode=mode,
            keep=keep,
            samples=len(per_step["seconds"]),
            **stats,
            **{f"{f}_bytes_median": v for f, v in m.items() if f != "seconds"},
        )
        rows.append(
            (
                f"{tune}/{mode}/keep{keep}",
                stats["median_s"] * 1e3,
                stats["p10_s"] * 1e3,
                stats["p90_s"] * 1e3,
                m.get("copied", 0) / 1e6,
                m.get("encoded", 0) / 1e6,
                m.get("sent", 0) / 1e6,
                m.get("held", 0) / 1e6,
            )
        )
    full_step = med[("lora", "whole", 8)]["last_step"]
    ratios = [
        (
            "lora: put→protected, whole / incremental (keep 8)",
            med[("lora", "whole", 8)]["seconds"] / med[("lora", "incremental", 8)]["seconds"],
            ">= 10",
        ),
        (
            "lora: put→protected, whole / incremental (keep 2)",
            med[("lora", "whole", 2)]["seconds"] / med[("lora", "incremental", 2)]["seconds"],
            ">= 10",
        ),
        (
            "lora: memory held with --keep 8 / one whole step (data + parity)",
            med[("lora", "incremental", 8)]["held"] / full_step,
            "<= 1.3",
        ),
        (
            "lora: memory held with --keep 2 / one whole step (data + parity)",
            med[("lora", "incremental", 2)]["held"] / full_step,
            None,
        ),
        (
            "lora: whole snapshots, memory with --keep 8 / one whole step",
            med[("lora", "whole", 8)]["held"] / full_step,
            None,
        ),
        (
            "lora: bytes sent per step, incremental / whole (keep 8)",
            med[("lora", "incremental", 8)]["sent"] / med[("lora", "whole", 8)]["sent"],
            "<= 0.05",
        ),
        (
            "lora: frozen fraction of the state's bytes (referred / state)",
            med[("lora", "incremental", 8)]["referred"]
            / med[("lora", "incremental", 8)]["state_bytes"],
            None,
        ),
        (
            "full: put→protected, incremental / whole (keep 8)",
            med[("full", "incremental", 8)]["seconds"] / med[("full", "whole", 8)]["seconds"],
            "<= 1.05",
        ),
        (
            "full: put→protected, incremental / whole (keep 2)",
            med[("full", "incremental", 2)]["seconds"] / med[("full", "whole", 2)]["seconds"],
            "<= 1.05",
        ),
        (
            "lora: DCP async_save until written / incremental put→protected (keep 2)",
            med[("lora", "dcp", 2)]["seconds"] / med[("lora", "incremental", 2)]["seconds"],
            None,
        ),
        (
            "full: DCP async_save until written / whole put→protected (keep 2)",
            med[("full", "dcp", 2)]["seconds"] / med[("full", "whole", 2)]["seconds"],
            None,
        ),
        (
            # the most any incremental put could gain here: nothing to hash, copy or send
            "lora: put→protected, whole / a put of 1 kB per rank (keep 2)",
            med[("lora", "whole", 2)]["seconds"] / med[("lora", "fixed", 2)]["seconds"],
            None,
        ),
        (
            "lora: put→protected, incremental / a put of 1 kB per rank (keep 2)",
            med[("lora", "incremental", 2)]["seconds"] / med[("lora", "fixed", 2)]["seconds"],
            None,
        ),
    ]
    ratio_rows = rec.ratios(ratios)
    update_rows = _update_vs_encode(rec, 5 if quick else 15)
    path = rec.write()
    print(
        table(
            rows,
            ["mode", "ms (median)", "p10", "p90", "MB copied", "MB encoded", "MB sent", "MB held"],
        )
    )
    print()
    print(table(ratio_rows, ["ratio", "value", "target", "met"]))
    print()
    print(table(update_rows, ["parity of a stripe, 1 of 3 chunks changed", "ms", "MB moved"]))
    print(f"\nwrote {len(rec.records)} records to {path}")


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(
        prog="ecsnap bench incremental",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a small model (a minute)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    run(quick=a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
