"""``torch.distributed.checkpoint`` (DCP) with ecsnap as the storage.

The one-line change for a DCP user, one writer and one reader for every step (and for
``async_save`` a writer per step, which stages into the daemons: see :meth:`SnapshotWriter.stage`)::

    writer, reader = SnapshotWriter(store), SnapshotReader(store)
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=f"{run}/step-{step}")
    dcp.async_save(state_dict, storage_writer=SnapshotWriter(store, step))  # stages into daemons
    dcp.load(state_dict, storage_reader=reader, checkpoint_id=f"{run}/step-{step}")
    dcp.load(state_dict, storage_reader=reader)                             # the newest step

A ``checkpoint_id`` is an int (the step) or a path whose last component ends in the step
(``.../step-120``, ``.../checkpoint-120``, ``epoch=0-step=120.ckpt``; see :mod:`storage.ids`);
nothing is read from or written to the path. Saving a step that is already protected raises
:class:`StepExistsError` and changes nothing, as DCP's ``overwrite=False``.

Each rank's write items become one shard of the step: ``{"dcp": [item descriptors], "t":
{key: tensor}}``, so a DCP checkpoint is an ordinary ecsnap step (erasure-coded, rebuilt after
host loss, listed by ``ecsnap status``). The coordinator's ``finish`` commits it: the step has
one more shard than DCP has ranks, a commit record the coordinator puts last, so a save that
fails on any rank in any hook (even ``finish``) never leaves a protected step, and a load then
finds the previous one. There is no separate metadata file: the reader rebuilds
DCP's :class:`Metadata` from every rank's descriptors (``store.structure`` reads each rank's
tensor table, not its tensors), so loading with another number of ranks (DCP's planner
reshards) reads only the chunks it needs.

``async_save``: the writer is its own :class:`AsyncStager`. ``stage`` puts the state dict's
tensors (a DTensor's local shard, a ShardedTensor's local shards) straight into daemon memory,
one copy, and returns once they are there; the training loop may then change its tensors. The
background save that DCP runs afterwards only plans, commits and waits for the parity.

Non-tensor values are pickled by DCP itself (``torch.save`` into its ``BytesIO`` items, loaded
back with ``torch.load``), as with any DCP storage; ecsnap stores those bytes as a uint8 tensor
and never unpickles anything. The DCP ranks are the store's: each rank connects its own
``Store`` with its rank and the world size of the process group that saves.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from storage import ids
from storage.client import Store
from storage.errors import StepExistsError, StepNotFoundError, StorageError

__all__ = ["SnapshotReader", "SnapshotWriter"]

FORMAT = 2  # 2: a commit record as the last shard


def _step_of(checkpoint_id: Any) -> int | None:
    """The step a DCP ``checkpoint_id`` names (None for None); see :mod:`storage.ids`."""
    return None if checkpoint_id is None else ids.step_of(checkpoint_id)


def _name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise StorageError(f"a stored DCP item names an unknown {kind.__name__} {name!r}")
    return value


def _describe(item: WriteItem, key: str) -> dict[str, Any]:
    """A JSON descriptor of one write item: enough to rebuild DCP's metadata for it."""
    out: dict[str, Any] = {"key": key, "fqn": item.index.fqn, "index": item.index.index}
    if item.type == WriteItemType.BYTE_IO:
        out["type"] = "bytes"
        return out
    td = item.tensor_data
    if td is None:
        raise StorageError(f"DCP write item {item.index.fqn!r} is a tensor without tensor data")
    p = td.properties
    out.update(
        type="tensor",
        offsets=list(td.chunk.offsets),
        sizes=list(td.chunk.sizes),
        size=list(td.size),
        dtype=_name(p.dtype),
        layout=_name(p.layout),
        memory_format=_name(p.memory_format),
        requires_grad=bool(p.requires_grad),
        pin_memory=bool(p.pin_memory),
    )
    return out


def _as_bytes_tensor(data: Any, fqn: str) -> torch.Tensor:
    if isinstance(data, io.BytesIO):
        raw = data.getvalue()
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        raise StorageError(f"DCP item {fqn!r}: expected bytes, got {type(data).__name__}")
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )


def _detach(data: Any, fqn: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise StorageError(f"DCP item {fqn!r}: expected a tensor, got {type(data).__name__}")
    return data.detach()


class SnapshotWriter(StorageWriter):
    """DCP ``StorageWriter`` (and ``AsyncStager``) that saves steps into the ecsnap daemons.

    ``store`` is this rank's :class:`storage.Store` (its rank is the DCP rank, its world size
    DCP's). One writer serves many saves: each ``dcp.save(..., checkpoint_id=...)`` names its
    step (or ``SnapshotWriter(store, step)`` fixes one). The save returns once the step is
    *protected* (parity stored on peers), as DCP's save returns once written.
    """

    _synchronize_after_execute = False  # stage() returns only when the copy is done

    def __init__(self, store: Store, step: int | None = None) -> None:
        super().__init__()
        self.store = store
        self.step = self._fixed = step
        self._coordinator = False
        self._staged: tuple[int, Any, dict[tuple[str, tuple[int, ...] | None], str]] | None = None
        self._lock = threading.Lock()
        self.staged_steps: list[int] = []  # steps stage() put into daemon memory (async_save)

    # -- AsyncStager ------------------------------------------------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Put ``state_dict`` into daemon memory now (one copy); DCP's background save then only
        plans, commits and waits for the parity. Returns ``state_dict``: its tensors may change
        from here.

        That needs the step before DCP names it: ``async_save`` stages before it hands the
        writer its ``checkpoint_id``. So a writer made for one step (``SnapshotWriter(store,
        step)``) stages into the daemons; one that serves many ids copies the tensors to CPU
        memory as DCP's own stager does, and puts them when the background save writes."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.planner_helpers import _create_write_items

        if self._fixed is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            copy: dict[str, Any] = DefaultStager(StagingOptions(False, False, False, False)).stage(
                state_dict
            )  # type: ignore[assignment]
            return copy
        step = self._require_step()
        flat, _ = flatten_state_dict(state_dict)
        items: list[tuple[WriteItem, Any]] = []
        for fqn, obj in flat.items():
            made = _create_write_items(fqn, obj)
            if hasattr(obj, "to_local"):
                datas: list[Any] = [obj.to_local()]
            elif hasattr(obj, "local_shards"):
                datas = [s.tensor for s in obj.local_shards()]
            elif isinstance(obj, torch.Tensor):
                datas = [obj]
            else:
                buf = io.BytesIO()
                torch.save(obj, buf)  # what DCP's planner does with a non-tensor value
                datas = [buf]
            if len(made) != len(datas):
                raise StorageError(
                    f"DCP item {fqn!r}: {len(made)} write items, {len(datas)} shards"
                )
            items += list(zip(made, datas, strict=True))
        handle, keys = self._put(step, items)
        handle.staged.result()
        with self._lock:
            self._staged = (step, handle, keys)
            self.staged_steps.append(step)
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the bytes are in daemon memory."""

    def close(self) -> None:
        """Nothing to release (the store belongs to the caller)."""

    # -- StorageWriter ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save or load: of the step ``checkpoint_id`` names, else the constructor's."""
        step = _step_of(checkpoint_id)
        self.step = self._fixed if step is None else step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is not None and rank != self.store.rank:
            raise StorageError(
                f"DCP rank {rank} saves through the store of rank {self.store.rank}: connect each "
                "rank's store with its own rank"
            )
        step = self._require_step()
        if self._staged is None and step in self.store.steps():
            raise StepExistsError(
                f"step {step} is already saved (protected): ecsnap steps are written once, as "
                "DCP's overwrite=False; delete it first (store.delete) or save another step"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) != self.store.world_size:
            raise StorageError(
                f"DCP saves with {len(plans)} rank(s), but the stores were connected with "
                f"world_size {self.store.world_size}: connect each rank's store with the world "
                "size of the process group that saves"
            )
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:  # async_save: the bytes went in at stage(); match the plan to them
            step, handle, keys = staged
            if self.step is not None and step != self.step:
                raise StorageError(f"staged step {step} but asked to write step {self.step}")
            chosen = []
            for item in plan.items:
                key = keys.get((item.index.fqn, _offset(item.index.offset)))
                if key is None:
                    raise StorageError(
                        f"DCP plans item {item.index.fqn!r} at {item.index.offset} that stage() "
                        "did not put; SnapshotWriter's staging follows DefaultSavePlanner's "
                        "flattening"
                    )
                chosen.append((item, key))
        else:
            data = [(item, planner.resolve_data(item)) for item in plan.items]
            handle, keys = self._put(self._require_step(), data)
            chosen = [
                (item, keys[(item.index.fqn, _offset(item.index.offset))]) for item in plan.items
            ]
        handle.staged.result()  # protected only once the coordinator's finish commits it
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=_item_bytes(item),
                storage_data={"rank": self.store.rank, "key": key},
            )
            for item, key in chosen
        ]
        if not self._coordinator:
            self.step = self._fixed  # this save's id was for this save (the coordinator: finish)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the step (the coordinator): put its commit record, the last shard, and wait
        until the step is protected. Every rank's descriptors are in its own shard."""
        step = self._require_step()
        world = self.store.world_size
        record = {"format": FORMAT, "dcp_commit": world, "items": sum(len(r) for r in results)}
        try:
            self.store.put(step, record, rank=world, world_size=world + 1).wait()
        finally:
            self.step = self._fixed  # this save's id was for this save

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return ids.valid(checkpoint_id)

    # -- helpers ----------------------------------------------------------------------------------

    def _require_step(self) -> int:
        if self.step is None:
            raise StorageError(
                f"SnapshotWriter needs a step: dcp.save(..., checkpoint_id=...) with {ids.FORMS}, "
                "or SnapshotWriter(store, step)"
            )
        return self.step

    def _put(
        self, step: int, items: Sequence[tuple[WriteItem, Any]]
    ) -> tuple[Any, dict[tuple[str, tuple[int, ...] | None], str]]:
        tensors: dict[str, torch.Tensor] = {}
        descriptors = []
        keys: dict[tuple[str, tuple[int, ...] | None], str] = {}
        for n, (item, data) in enumerate(items):
            key = str(n)
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                tensors[key] = _as_bytes_tensor(data, fqn)
            else:
                tensors[key] = _detach(data, fqn)
            descriptors.append(_describe(item, key))
            keys[(fqn, _offset(item.index.offset))] = key
        state = {"format": FORMAT, "dcp": descriptors, "t": tensors}
        world = self.store.world_size
        return self.store.put(step, state, world_size=world + 1), keys


def _offset(offset: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if offset is None else tuple(int(o) for o in offset)


def _item_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None:
        return 0
    n = 1
    for s in td.chunk.sizes:
        n *= int(s)
    return n * torch.empty(0, dtype=td.properties.dtype).element_size()


class SnapshotReader(StorageReader):
    """DCP ``StorageReader`` over ecsnap steps: the one ``checkpoint_id`` names, or the one given
    to the constructor, or else the newest protected one. One reader serves many loads.

    Works with any number of loading ranks: DCP's planner picks the chunks each rank needs and
    this reader takes them from the rank that stored them, its own first (local memory), else
    through the daemons (fetched from whichever host holds it, rebuilt if its host was lost).
    """

    def __init__(self, store: Store, step: int | None = None) -> None:
        super().__init__()
        self.store = store
        self.step = self._fixed = step
        self._reading: int | None = None  # the step the current load reads
        self._where: dict[tuple[str, tuple[int, ...] | None], list[tuple[int, str]]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new load: of the step ``checkpoint_id`` names, else the constructor's (or the
        newest); what the last load found is forgotten."""
        step = _step_of(checkpoint_id)
        self.step = self._fixed if step is None else step
        self._where = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        step = self.step if self.step is not None else self.store.latest_step()
        if step is None:
            raise StepNotFoundError("no protected step to load from", None)
        world = self.store.status(step).world_size - 1  # the last shard is the commit record
        _, record = self.store.structure(step, rank=world) if world >= 0 else (step, None)
        if not isinstance(record, dict) or record.get("dcp_commit") != world:
            raise StorageError(
                f"step {step} was not saved through SnapshotWriter (no DCP commit record); "
                "read it with store.get()"
            )
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        self._where = {}
        for rank in range(world):
            step, tree = self.store.structure(step, rank=rank)
            if not isinstance(tree, dict) or "dcp" not in tree:
                raise StorageError(
                    f"step {step} rank {rank} was not saved through SnapshotWriter (no DCP "
                    "descriptors); read it with store.get()"
                )
            if tree.get("format") != FORMAT:
                raise StorageError(f"step {step}: DCP format {tree.get('format')} is not {FORMAT}")
            for d in tree["dcp"]:
                fqn = d["fqn"]
                where: tuple[str, tuple[int, ...] | None]
                if d["type"] == "bytes":
                    md.setdefault(fqn, BytesStorageMetadata())
                    where = (fqn, None)
                    index = MetadataIndex(fqn)
                else:
                    offsets = torch.Size(d["offsets"])
                    props = TensorProperties(
                        dtype=_torch_attr(d["dtype"], torch.dtype),
                        layout=_torch_attr(d["layout"], torch.layout),
                        requires_grad=d["requires_grad"],
                        memory_format=_torch_attr(d["memory_format"], torch.memory_format),
                        pin_memory=d["pin_memory"],
                    )
                    tmd = md.get(fqn)
                    if tmd is None:
                        tmd = md[fqn] = TensorStorageMetadata(props, torch.Size(d["size"]), [])
                    elif not isinstance(tmd, TensorStorageMetadata):
                        raise StorageError(f"step {step}: {fqn!r} stored as bytes and as a tensor")
                    where = (fqn, tuple(offsets))
                    if where not in self._where:
                        tmd.chunks.append(ChunkStorageMetadata(offsets, torch.Size(d["sizes"])))
                    index = MetadataIndex(fqn, offsets)
                self._where.setdefault(where, []).append((rank, d["key"]))
                storage.setdefault(index, {"rank": rank, "key": d["key"]})
        self._reading = step
        return Metadata(
            state_dict_metadata=md,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(step)),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Index where each item lies for the step the (broadcast) metadata names."""
        named = metadata.storage_meta.checkpoint_id if metadata.storage_meta else None
        step = int(str(named)) if named is not None else self._reading
        if step != self._reading or not self._where:  # read on another rank: index it here too
            requested, self.step = self.step, step
            try:
                self.read_metadata()
            finally:
                self.step = requested

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_rank: dict[int, list[tuple[Any, str]]] = {}
        for item in plan.items:
            si = item.storage_index
            holders = self._where.get((si.fqn, _offset(si.offset)))
            if not holders:
                raise StorageError(f"step {self._reading} holds no item {si.fqn!r} at {si.offset}")
            rank, key = next(((r, k) for r, k in holders if r == self.store.rank), holders[0])
            by_rank.setdefault(rank, []).append((item, key))
        for rank, wanted in sorted(by_rank.items()):
            tensors = self.store.get(self._reading, rank=rank)["t"]
            for item, key in wanted:
                src = tensors[key]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(src.numpy().tobytes()))
                    continue
                for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    src = src.narrow(dim, o, n)
                target = planner.resolve_tensor(item).detach()
                if target.size() != src.size():
                    raise StorageError(
                        f"{item.dest_index.fqn!r}: stored chunk {tuple(src.size())} does not fit "
                        f"{tuple(target.size())}"
                    )
                target.copy_(src)
                planner.commit_tensor(item, target)
            del tensors  # the views go: the daemon may reuse that memory
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return ids.valid(checkpoint_id)
