"""DCP ranks for tests: a gloo process group over the trainer processes, saving and loading
through :mod:`storage.dcp`. Imported by ``_trainer`` for its ``dcp_*`` scenarios."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from storage import Store
from storage.dcp import SnapshotReader, SnapshotWriter


def _init(rank: int, world: int, p: dict[str, Any]) -> Any:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(p["port"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _leave() -> None:
    """Leave the process group. Ranks first wait for each other (unless one is failing), so that
    none tears its gloo connections down while a peer still uses them: that aborted a loading
    rank once ("terminate called without an active exception", SIGABRT)."""
    if sys.exc_info()[0] is None:
        dist.barrier()
    dist.destroy_process_group()


def full_state(version: int) -> dict[str, Any]:
    """The global (unsharded) state of ``version``, the same in every process."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "w": torch.randn(64, 48, generator=g),
        "emb": torch.randn(40, 24, generator=g).to(torch.bfloat16),
        "b": torch.randn(48, generator=g),
        "plain": torch.arange(10, dtype=torch.int64) * version,
        "count": 7 * version,
        "lr": 0.5 / version,
    }


def sharded(mesh: Any, full: dict[str, Any], layout: str) -> dict[str, Any]:
    """A model/optimizer-like nested state dict of DTensors cut as ``layout`` says."""
    w_place = [Shard(0)] if layout == "rows" else [Shard(1)]
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, w_place),
            "emb": distribute_tensor(
                full["emb"], mesh, [Shard(1)] if layout == "rows" else [Shard(0)]
            ),
            "b": distribute_tensor(full["b"], mesh, [Replicate()]),
        },
        "extra": {"plain": full["plain"].clone(), "count": full["count"], "lr": full["lr"]},
    }


def _zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return DTensor.from_local(
            torch.zeros_like(state.to_local()),
            state.device_mesh,
            state.placements,
            shape=state.shape,
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def _check(got: dict[str, Any], full: dict[str, Any]) -> list[str]:
    wrong = []
    for name in ("w", "emb", "b"):
        t = got["model"][name]
        if not torch.equal(
            t.full_tensor().view(torch.uint8) if t.dtype == torch.bfloat16 else t.full_tensor(),
            full[name].view(torch.uint8) if full[name].dtype == torch.bfloat16 else full[name],
        ):
            wrong.append(name)
    if not torch.equal(got["extra"]["plain"], full["plain"]):
        wrong.append("plain")
    if got["extra"]["count"] != full["count"] or got["extra"]["lr"] != full["lr"]:
        wrong.append("scalars")
    return wrong


def dcp_save(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """dcp.save of version 1 as step 1; dcp.async_save of version 2 as step 2, changing the
    tensors right after staging returns (the saved step must not see the change)."""
    mesh = _init(rank, world, p)
    try:
        dcp.save(sharded(mesh, full_state(1), "rows"), storage_writer=SnapshotWriter(store, 1))
        state = sharded(mesh, full_state(2), "rows")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # DCP's own deprecations
            writer = SnapshotWriter(store, 2)
            fut = dcp.async_save(state, storage_writer=writer)
        # SnapshotWriter is its own stager: this rank's bytes are in daemon memory already
        staged_at_return = writer.staged_steps == [2]
        state["model"]["w"].to_local().fill_(-1.0)  # training goes on: must not reach step 2
        state["extra"]["plain"].fill_(-1)
        fut.result()
        steps = store.steps()
    finally:
        _leave()
    return {"steps": steps, "staged_at_return": staged_at_return}


def dcp_load(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """Load every step of ``steps`` into this world's DTensors (cut as ``layout``) and compare."""
    mesh = _init(rank, world, p)
    wrong: dict[str, list[str]] = {}
    try:
        for step in p["steps"]:
            target = _zeros_like(sharded(mesh, full_state(step), p["layout"]))
            target["extra"]["count"] = 0
            target["extra"]["lr"] = 0.0
            reader = SnapshotReader(store, step if p.get("explicit", True) else None)
            dcp.load(target, storage_reader=reader)
            bad = _check(target, full_state(step))
            if bad:
                wrong[str(step)] = bad
    finally:
        _leave()
    return {"wrong": wrong}


def _fsdp_model(mesh: Any) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _full(state: dict[str, Any]) -> dict[str, list[float]]:
    """Every tensor of the model+optimizer state, unsharded (a collective), as JSON numbers."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    out = {}
    for k, v in sorted(flat.items()):
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            out[k] = v.float().reshape(-1).tolist()
    return out


def fsdp_save(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 (fully_shard) model and AdamW state after two steps, dcp.save'd as ``step``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = _init(rank, world, p)
    try:
        model, opt = _fsdp_model(mesh)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            model(torch.randn(4, 16, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.save(state, storage_writer=SnapshotWriter(store, p["step"]))
        expect = _full(state)
    finally:
        _leave()
    return {"expect": expect if rank == 0 else None}


def fsdp_load(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """A fresh FSDP2 model and optimizer on this world, loaded from the newest step; compare."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _init(rank, world, p)
    try:
        model, opt = _fsdp_model(mesh)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()  # optimizer state exists, with values that must all be replaced
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=SnapshotReader(store))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = _full(
            {"model": get_state_dict(model, opt)[0], "optim": get_state_dict(model, opt)[1]}
        )
    finally:
        _leave()
    expect = p["expect"]
    wrong = sorted(k for k in expect if got.get(k) != expect[k])
    return {"wrong": wrong, "compared": len(expect)}
