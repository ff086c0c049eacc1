"""Deterministic mixed state dicts, and a bit-exact comparison."""

from __future__ import annotations

import collections
import random
import warnings
from typing import Any

import numpy as np
import torch

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def make_state(rank: int, step: int, scale: int = 1) -> dict[str, Any]:
    """Every kind of leaf a trainer puts: model, optimizer, scheduler, RNGs, dataloader."""
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    torch.manual_seed(rank * 7 + step)
    model = torch.nn.Sequential(
        torch.nn.Linear(16 * scale, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loss = model(torch.randn(8, 16 * scale, generator=g)).square().mean()
    loss.backward()
    opt.step()
    sched.step()
    tensors = {}
    for dt in DTYPES:
        base = torch.randn(5, 7, generator=g) * 10
        tensors[str(dt)] = base.to(dt) if dt != torch.bool else base > 0
    big = torch.randn(300 * scale, 1000 + rank, generator=g)
    shared = torch.arange(40, dtype=torch.float32) + step
    nprng = np.random.default_rng(rank + step)
    pyrng = random.Random(rank * 31 + step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's own deprecation noise
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(list(range(50)), batch_size=4, shuffle=False)
        it = iter(loader)
        for _ in range(step % 5 + 1):
            next(it)
        loader_state = loader.state_dict()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "dtypes": tensors,
        "big": big,
        "bf16": torch.randn(64, 129, generator=g).to(torch.bfloat16),
        "noncontig": big[:, ::3].t(),
        "zero": torch.empty(0, 3, 0),
        "scalar": torch.tensor(3.25),
        "shared": (shared[:10], shared[5:25].view(4, 5)),
        "numpy": {
            "f": nprng.standard_normal((3, 4)),
            "i": np.arange(7, dtype=np.int16),
            "scalar": np.float32(1.5),
        },
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": nprng.bit_generator.state,
            "python": pyrng.getstate(),
        },
        "loader": loader_state,
        "meta": {
            "step": step,
            "rank": rank,
            "lr": 1e-3,
            "nan": float("nan"),
            "name": "x",
            "blob": b"\x00\x01",
            "none": None,
            "flags": [True, False],
            7: "int key",
            "size": torch.Size([2, 3]),
            "dtype": torch.bfloat16,
            "od": collections.OrderedDict(a=1),
        },
    }


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        ca, cb = a.contiguous(), b.contiguous()
        if a.numel():
            assert torch.equal(
                ca.reshape(-1).view(torch.uint8), cb.reshape(-1).view(torch.uint8)
            ), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
