"""The alternatives the benchmarks time ecsnap against, run in the benchmark's own process:
the copy floor, ``torch.save``/``torch.load`` to /dev/shm and to disk, and DCP's own writers.

Each returns seconds; files it writes are removed before it returns.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench._ranks import run_fresh

__all__ = [
    "DISK",
    "dcp_async",
    "dcp_save_load",
    "floor_copy",
    "floor_encode_cpu",
    "torch_disk",
    "torch_save_load",
]

DISK = Path(os.environ.get("ECSNAP_BENCH_DISK", tempfile.gettempdir()))


def floor_copy(
    state: dict[str, torch.Tensor], buf: Any, pool: ThreadPoolExecutor
) -> tuple[float, float]:
    """The state copied once into ``buf`` (pre-faulted shared memory) by ``pool``'s threads:
    (seconds, CPU seconds of every thread)."""
    from storage.state import flatten, stage

    _, leaves, nbytes = flatten(state)
    t0 = time.perf_counter()
    cpu = stage(leaves, buf.array[:nbytes], pool)
    return time.perf_counter() - t0, cpu


def floor_encode_cpu(data: Any, k: int, m: int, chunk: int) -> float:
    """CPU seconds of one RS(k, m) encode pass over ``data`` (a uint8 array: stripes of k
    chunks of ``chunk`` bytes, the tail left out), on this thread, as one daemon encodes."""
    import numpy as np

    from codec import RSCodec

    rs = RSCodec(k, m)
    parity = [np.ones(chunk, dtype=np.uint8) for _ in range(m)]  # faulted in before timing
    stripe = k * chunk
    t0 = time.thread_time()
    for o in range(0, data.nbytes - stripe + 1, stripe):
        rs.encode_into([data[o + j * chunk : o + (j + 1) * chunk] for j in range(k)], parity)
    return time.thread_time() - t0


def torch_save_load(
    state: dict[str, torch.Tensor], directory: Path, shards: int
) -> dict[str, float]:
    """torch.save to ``directory`` and torch.load back: in this process (whose heap may or may
    not hand freed pages back without faults), and in a fresh
    process, as a restarted trainer would; then the state in ``shards`` shards, each loaded by its
    own fresh process at once."""
    path = directory / "state.pt"
    t0 = time.perf_counter()
    torch.save(state, path)
    out = {"torch_save_shm": time.perf_counter() - t0}
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    out["torch_load_shm_warm_heap"] = time.perf_counter() - t0
    del loaded
    out["torch_load_shm"] = run_fresh([{"op": "load", "path": str(path)}])[0]["load"]
    path.unlink()
    names = list(state)
    paths = [directory / f"shard{i}.pt" for i in range(shards)]
    for i, shard in enumerate(paths):
        torch.save({n: state[n] for n in names[i::shards]}, shard)
    loads = run_fresh([{"op": "load", "path": str(shard)} for shard in paths])
    out["torch_load_shm_sharded"] = max(r["load"] for r in loads)
    for shard in paths:
        shard.unlink()
    return out


def dcp_async(state: dict[str, torch.Tensor], directory: Path) -> tuple[float, float]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        t0 = time.perf_counter()
        fut: Any = async_save(state, storage_writer=FileSystemWriter(str(directory)))
        t_block = time.perf_counter() - t0
        fut.result()
        t_done = time.perf_counter() - t0
    shutil.rmtree(directory)
    return t_block, t_done


def dcp_save_load(state: dict[str, torch.Tensor], directory: Path) -> tuple[float, float]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    target = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        t0 = time.perf_counter()
        dcp_save(state, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp_load(target, storage_reader=FileSystemReader(str(directory)), no_dist=True)
        t_load = time.perf_counter() - t0
    shutil.rmtree(directory)
    return t_save, t_load


def torch_disk(state: dict[str, torch.Tensor]) -> tuple[float, float]:
    path = DISK / f"ecsnap-torch-{uuid.uuid4().hex[:8]}.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    t_load = time.perf_counter() - t0
    del loaded
    path.unlink()
    return t_save, t_load
