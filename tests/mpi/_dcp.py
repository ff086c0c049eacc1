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


# -- checkpoint ids, overwrite, and faults ---------------------------------------------------------


def _version(state: dict[str, Any]) -> int:
    return int(state["extra"]["count"]) // 7


def _load_checked(mesh: Any, reader: SnapshotReader, version: int, cid: Any = None) -> list[str]:
    target = _zeros_like(sharded(mesh, full_state(version), "cols"))
    target["extra"]["count"] = 0
    target["extra"]["lr"] = 0.0
    dcp.load(target, storage_reader=reader, checkpoint_id=cid)
    return _check(target, full_state(version))


def dcp_ids(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """One writer and one reader for every step, named by path-like checkpoint ids; a save of an
    id already protected refused, changing nothing; an id that names no step refused by form."""
    mesh = _init(rank, world, p)
    out: dict[str, Any] = {"wrong": {}}
    writer, reader = SnapshotWriter(store), SnapshotReader(store)
    ids = {10: "/runs/x/step-10", 20: "ckpt/checkpoint-20/", 30: "ckpts/epoch=0-step=30.ckpt"}
    try:
        for step, cid in ids.items():
            state = sharded(mesh, full_state(step), "rows")
            if step == 30:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    dcp.async_save(state, storage_writer=writer, checkpoint_id=cid).result()
            else:
                dcp.save(state, storage_writer=writer, checkpoint_id=cid)
        out["steps"] = store.steps()
        for step, cid in ids.items():
            bad = _load_checked(mesh, reader, step, cid)
            if bad:
                out["wrong"][cid] = bad
        out["newest"] = _load_checked(mesh, reader, 30)  # no id: the newest step
        try:  # saving step 20 again: refused, and step 20 is what it was
            dcp.save(sharded(mesh, full_state(99), "rows"), storage_writer=writer, checkpoint_id=20)
            out["overwrite"] = "accepted"
        except BaseException as exc:  # DCP wraps it in its CheckpointException(BaseException)
            if isinstance(exc, KeyboardInterrupt):
                raise
            out["overwrite"] = str(exc)
        out["after_overwrite"] = _load_checked(mesh, reader, 20, ids[20])
        try:
            dcp.save(
                sharded(mesh, full_state(1), "rows"), storage_writer=writer, checkpoint_id="latest"
            )
            out["bad_id"] = "accepted"
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            out["bad_id"] = str(exc)
        out["valid"] = [
            SnapshotWriter.validate_checkpoint_id(c) for c in ("a/step-3", "model.pt", "latest")
        ]
    finally:
        _leave()
    return out


def dcp_no_dist(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """dcp.save / dcp.load with no_dist=True (one process, no process group), as step 55."""
    full = full_state(5)
    state = {"w": full["w"].clone(), "extra": {"plain": full["plain"].clone(), "s": "text"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled"
        dcp.save(
            state, storage_writer=SnapshotWriter(store), checkpoint_id="run/step-55", no_dist=True
        )
        target = {
            "w": torch.zeros_like(full["w"]),
            "extra": {"plain": torch.zeros(10, dtype=torch.int64), "s": ""},
        }
        dcp.load(
            target, storage_reader=SnapshotReader(store), checkpoint_id="run/step-55", no_dist=True
        )
    same = torch.equal(target["w"], full["w"]) and torch.equal(
        target["extra"]["plain"], full["plain"]
    )
    return {"same": same and target["extra"]["s"] == "text", "steps": store.steps()}


_HOOKS = (
    "set_up_storage_writer",
    "prepare_local_plan",
    "prepare_global_plan",
    "write_data",
    "finish",
)


class FaultyWriter(SnapshotWriter):
    """A SnapshotWriter that raises in one hook on one rank (DCP's FaultyStorageWriter pattern)."""

    def __init__(self, store: Store, hook: str, on_rank: int) -> None:
        super().__init__(store)
        self.hook, self.on_rank = hook, on_rank

    def _fault(self, hook: str) -> None:
        if hook == self.hook and self.store.rank == self.on_rank:
            raise RuntimeError(f"injected fault in {hook} on rank {self.on_rank}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._fault("set_up_storage_writer")
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        self._fault("prepare_local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        self._fault("prepare_global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._fault("write_data")
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        self._fault("finish")
        super().finish(metadata, results)


def dcp_faulty(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """A save that fails on one rank in one hook never leaves a protected step; a load then
    finds the previous one (step 101, newer than what other scenarios saved), and the next save
    works."""
    mesh = _init(rank, world, p)
    out: dict[str, Any] = {"raised": {}, "named": {}, "protected": {}, "wrong": {}}
    reader = SnapshotReader(store)
    try:
        dcp.save(
            sharded(mesh, full_state(101), "rows"),
            storage_writer=SnapshotWriter(store),
            checkpoint_id=101,
        )
        for i, hook in enumerate(_HOOKS):
            step = 102 + i
            on_rank = 0 if hook in ("prepare_global_plan", "finish") else world - 1
            try:
                dcp.save(
                    sharded(mesh, full_state(step), "rows"),
                    storage_writer=FaultyWriter(store, hook, on_rank),
                    checkpoint_id=step,
                )
                out["raised"][hook] = False
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                out["raised"][hook] = True
                if rank == on_rank:
                    out["named"][hook] = "injected fault" in str(exc)
            dist.barrier()
            out["protected"][hook] = step in store.steps()
            bad = _load_checked(mesh, reader, 101)  # the newest protected step: still 101
            if bad:
                out["wrong"][hook] = bad
        dcp.save(
            sharded(mesh, full_state(109), "rows"),
            storage_writer=SnapshotWriter(store),
            checkpoint_id=109,
        )
        out["after"] = _load_checked(mesh, reader, 109)
        out["steps"] = store.steps()
    finally:
        _leave()
    return out


# -- resharding: ShardedTensor specs, DTensor placements on 1-D and 2-D meshes ---------------------


def _full_2d(version: int) -> torch.Tensor:
    return torch.randn(10, 6, generator=torch.Generator().manual_seed(version)) * version


def _sharded_tensor(kind: str, full: torch.Tensor, world: int) -> Any:
    """``full`` as a ShardedTensor: chunked by rows (10 rows over 4 ranks: 3, 3, 3, 1, uneven),
    by columns, or by an enumerable spec of uneven blocks on three of the ranks."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    places = [f"rank:{r}/cpu" for r in range(world)]
    if kind == "rows":
        spec: Any = ChunkShardingSpec(dim=0, placements=places)
    elif kind == "cols":
        spec = ChunkShardingSpec(dim=1, placements=places)
    else:
        spec = EnumerableShardingSpec(
            [
                ShardMetadata([0, 0], [7, 2], places[0]),
                ShardMetadata([0, 2], [7, 4], places[1]),
                ShardMetadata([7, 0], [3, 6], places[2 % world]),
            ]
        )
    st = sharded_tensor.empty(spec, *full.shape)
    for shard in st.local_shards():
        (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[r : r + n, c : c + m])
    return st


def _st_equal(st: Any, full: torch.Tensor) -> bool:
    for shard in st.local_shards():
        (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(shard.tensor, full[r : r + n, c : c + m]):
            return False
    return True


def dcp_sharded(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """ShardedTensors saved under one sharding spec and loaded under another (chunk and
    enumerable specs, uneven shards, row-wise <-> column-wise), a ShardedTensor loaded as a
    plain tensor and a plain tensor loaded as a ShardedTensor."""
    _init(rank, world, p)
    wrong = []
    writer, reader = SnapshotWriter(store), SnapshotReader(store)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor's deprecation
            step = 100
            for saved, loaded in (
                ("rows", "cols"),
                ("cols", "rows"),
                ("rows", "enum"),
                ("enum", "cols"),
                ("rows", "plain"),
                ("plain", "rows"),
            ):
                step += 1
                full = _full_2d(step)
                src = full.clone() if saved == "plain" else _sharded_tensor(saved, full, world)
                dcp.save({"st": src}, storage_writer=writer, checkpoint_id=step)
                zero = torch.zeros_like(full)
                dst = zero if loaded == "plain" else _sharded_tensor(loaded, zero, world)
                target = {"st": dst}
                dcp.load(target, storage_reader=reader, checkpoint_id=step)
                got = target["st"]
                ok = torch.equal(got, full) if loaded == "plain" else _st_equal(got, full)
                if not ok:
                    wrong.append(f"{saved}->{loaded}")
    finally:
        _leave()
    return {"wrong": wrong}


def dcp_dtensor(store: Store, rank: int, world: int, p: dict[str, Any]) -> dict[str, Any]:
    """DTensors across {Replicate, Shard(0)} placements on a 1-D mesh of 4 ranks and a 2x2 mesh,
    saved with one placement and loaded with another, with bytes and str values beside them."""
    _init(rank, world, p)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    cases = [
        (mesh1, [Shard(0)], [Replicate()]),
        (mesh1, [Replicate()], [Shard(0)]),
        (mesh2, [Shard(0), Replicate()], [Replicate(), Shard(0)]),
        (mesh2, [Shard(0), Shard(0)], [Replicate(), Replicate()]),
        (mesh2, [Replicate(), Shard(0)], [Shard(0), Shard(0)]),
    ]
    wrong = []
    writer, reader = SnapshotWriter(store), SnapshotReader(store)
    try:
        for i, (mesh, saved, loaded) in enumerate(cases):
            step = 200 + i
            full = torch.randn(12, 5, generator=torch.Generator().manual_seed(step))
            state = {
                "t": distribute_tensor(full, mesh, saved),
                "note": f"case {i}",
                "blob": bytes([i, 0, 255]),
            }
            dcp.save(state, storage_writer=writer, checkpoint_id=f"run/step-{step}")
            target = {
                "t": distribute_tensor(torch.zeros_like(full), mesh, loaded),
                "note": "",
                "blob": b"",
            }
            dcp.load(target, storage_reader=reader, checkpoint_id=f"run/step-{step}")
            if not torch.equal(target["t"].full_tensor(), full):
                wrong.append(f"case {i}: tensor")
            if target["note"] != f"case {i}" or target["blob"] != bytes([i, 0, 255]):
                wrong.append(f"case {i}: {target['note']!r} {target['blob']!r}")
    finally:
        _leave()
    return {"wrong": wrong}
