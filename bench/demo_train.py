"""The demo's training job, one process per rank (launched by ``ecsnap demo``).

A small GPT-style transformer on bytes of Python's own standard library, data parallel over a
gloo process group with a sharded optimizer (ZeroRedundancyOptimizer: every rank holds a
different slice of the AdamW state), dropout driven by the global RNG, and a stateful
dataloader. Every step's full training state goes to ecsnap; on start it resumes from the newest
step ecsnap can give back. Everything is deterministic, so a resumed run's losses must equal an
uninterrupted run's bit for bit.

Gradients are averaged with one flat all-reduce in a fixed order (not DDP, whose bucket rebuild
could change the summation order between a run and its resumption).
"""

from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MODEL_SIZES = {
    "tiny": {"d": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 4},
    "small": {"d": 128, "layers": 4, "heads": 4, "seq": 64, "batch": 8},
    "medium": {"d": 256, "layers": 6, "heads": 8, "seq": 128, "batch": 8},
}


def corpus(nbytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's own sources, in a fixed order: no download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for name in (
        "textwrap.py",
        "argparse.py",
        "difflib.py",
        "inspect.py",
        "pathlib.py",
        "typing.py",
        "dataclasses.py",
        "functools.py",
        "collections/__init__.py",
    ):
        path = stdlib / name
        if path.exists():
            out += path.read_bytes()
        if len(out) >= nbytes:
            break
    if len(out) < 10_000:
        raise RuntimeError(f"too little text found under {stdlib}")
    return torch.frombuffer(bytearray(out[:nbytes]), dtype=torch.uint8).long()


class Windows(torch.utils.data.Dataset[torch.Tensor]):
    """Rank ``rank``'s share of the corpus: windows of seq+1 bytes, interleaved across ranks."""

    def __init__(self, text: torch.Tensor, seq: int, rank: int, world: int) -> None:
        self.text, self.seq = text, seq
        self.starts = list(range(rank * seq, len(text) - seq - 1, world * seq))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.starts[i]
        return self.text[s : s + self.seq + 1]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        attended: torch.Tensor = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + attended
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        mask: torch.Tensor = self.get_buffer("mask")[:n, :n]
        x = self.tok(idx) + self.pos[:n]
        for b in self.blocks:
            x = b(x, mask)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def average_gradients(params: Sequence[torch.Tensor], world: int) -> None:
    """Average gradients over the group with one flat all-reduce, in a fixed order."""
    grads = torch.cat([_grad(p).reshape(-1) for p in params])
    dist.all_reduce(grads)
    grads /= world
    offset = 0
    for p in params:
        n = p.numel()
        _grad(p).copy_(grads[offset : offset + n].view_as(p))
        offset += n


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # deterministic kernels, and 4 ranks share 2 cores anyway
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torchdata.stateful_dataloader import StatefulDataLoader

    import storage

    dist.init_process_group("gloo", rank=rank, world_size=world)
    size = MODEL_SIZES[cfg["model_size"]]
    torch.manual_seed(cfg["seed"])
    model = GPT(size["d"], size["layers"], size["heads"], size["seq"])
    zero = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3, weight_decay=0.01
    )
    torch.manual_seed(cfg["seed"] * 1000 + rank)  # per-rank dropout stream
    data = Windows(corpus(), size["seq"], rank, world)
    # The loader draws a seed whenever it starts an epoch: from its own generator, so that
    # starting an iterator after a resume does not move the global RNG that dropout uses.
    loader = StatefulDataLoader(
        data,
        batch_size=size["batch"],
        shuffle=False,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    epoch, start = 0, 0
    store = None
    if cfg.get("job"):
        store = storage.connect(
            cfg["job"], rank=rank, world_size=world, root=cfg["root"], timeout=120
        )
    if store is not None and cfg.get("resume"):
        state = None
        try:
            state = store.get()
        except storage.SnapshotUnrecoverableError as exc:
            emit(
                event="unrecoverable",
                rank=rank,
                message=str(exc),
                lost_hosts=exc.lost_hosts,
                ranks=exc.ranks,
                newest=exc.newest_recoverable,
            )
            if exc.newest_recoverable is not None:
                state = store.get(exc.newest_recoverable)
        except storage.StepNotFoundError:
            state = None
        if state is not None:
            model.load_state_dict(state["model"])
            zero.optim.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            loader.load_state_dict(state["loader"])
            epoch, start = state["epoch"], state["step"] + 1
        emit(event="resumed", rank=rank, step=start, from_scratch=state is None)
    it = iter(loader)
    flat_params = list(model.parameters())
    handle = None
    for step in range(start, cfg["steps"]):
        t_step = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            epoch += 1
            it = iter(loader)
            batch = next(it)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        average_gradients(flat_params, world)
        t_wait = 0.0
        if handle is not None:
            t0 = time.perf_counter()
            handle.staged.result()  # the last snapshot must be copied before parameters change
            t_wait = time.perf_counter() - t0
        zero.step()
        zero.zero_grad(set_to_none=False)
        total = loss.detach().clone()
        dist.all_reduce(total)
        mean = float(total) / world
        put_s = protect_s = None
        if store is not None:
            if handle is not None and handle.t_protected is not None:
                protect_s = handle.t_protected - handle.t_put
            t0 = time.perf_counter()
            handle = store.put(
                step,
                {
                    "step": step,
                    "epoch": epoch,
                    "model": model.state_dict(),
                    "optim": zero.optim.state_dict(),
                    "rng": torch.get_rng_state(),
                    "loader": loader.state_dict(),
                },
            )
            put_s = time.perf_counter() - t0 + t_wait
            if step == cfg.get("fail_at"):
                # the demo's failure strikes once this step is protected, so every run shows a
                # resume from memory (what a real failure finds depends on timing)
                handle.wait(120)
        emit(
            event="step",
            rank=rank,
            step=step,
            loss=mean.hex(),
            loss_f=mean,
            put_block_s=put_s,
            protect_s=protect_s,
            step_s=time.perf_counter() - t_step,
        )
    if handle is not None:
        handle.wait(120)
    if store is not None:
        store.close()
    dist.barrier()
    dist.destroy_process_group()
    emit(event="done", rank=rank)
    if not math.isfinite(mean):
        sys.exit(3)


if __name__ == "__main__":
    main()
