"""What a state dict may hold, and how it becomes one shard: a JSON skeleton plus raw bytes.

A shard is a byte buffer holding every tensor and array leaf at a 64-byte aligned offset, and a
JSON *skeleton* for the structure and the small leaves (numbers, strings, bytes, None). Nothing is
pickled, ever: a value of any other type raises :class:`UnsupportedTypeError` naming its key path,
before a byte is stored.

Supported: nested dict / OrderedDict / list / tuple / torch.Size; torch tensors of every dtype
(bfloat16 and float8 included), any shape, zero-size, non-contiguous (stored contiguous);
numpy arrays and scalars without object fields; int, float (bit-exact), bool, str, bytes, None,
torch.dtype, torch.device. That covers model, optimizer and LR-scheduler state dicts, RNG states
(``torch.get_rng_state()``, numpy's ``bit_generator.state``, ``random.getstate()``) and
torchdata's StatefulDataLoader. Tensors sharing storage are stored once each (sharing is not
restored).
"""

from __future__ import annotations

import base64
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from storage.errors import UnsupportedTypeError
from storage.table import ALIGN, Leaf, pack_table, table_place

__all__ = [
    "Leaf",
    "build",
    "copy_pieces",
    "flatten",
    "pack_table",
    "source_bytes",
    "stage",
    "table_place",
    "unflatten_views",
]

_PARALLEL_MIN = 32 << 20  # below this one thread copies faster than two
_PIECE = 16 << 20


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedTypeError(f"unknown torch dtype {name!r} in a stored shard")
    return dtype


def _np_dtype_descr(dtype: np.dtype[Any]) -> Any:
    return np.lib.format.dtype_to_descr(dtype)


def _np_dtype(descr: Any) -> np.dtype[Any]:
    if isinstance(descr, list):
        descr = [tuple(d) if isinstance(d, list) else d for d in descr]
        descr = [(d[0], _fix(d[1]), *d[2:]) if isinstance(d, tuple) else d for d in descr]
    return np.lib.format.descr_to_dtype(descr)


def _fix(x: Any) -> Any:
    if isinstance(x, list):
        return [tuple(d) if isinstance(d, list) else d for d in x]
    return x


class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.offset = 0

    def _leaf(self, leaf: Leaf) -> int:
        self.leaves.append(leaf)
        self.offset = -(-(self.offset + leaf.nbytes) // ALIGN) * ALIGN
        return len(self.leaves) - 1

    def node(self, value: Any, path: str) -> Any:
        t = type(value)
        if value is None:
            return {"n": 0}
        if t is bool:
            return {"b": value}
        if t is int:
            return {"i": value}
        if t is float:
            return {"f": value.hex()}
        if t is str:
            return {"s": value}
        if t is bytes or t is bytearray:
            return {"y": base64.b64encode(value).decode(), "ba": t is bytearray}
        if isinstance(value, torch.Tensor):
            return {"T": self._tensor(value, path)}
        if t is np.ndarray:
            return {"N": self._array(value, path)}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                raise UnsupportedTypeError(f"{path}: numpy scalar of object dtype", path)
            return {"ns": [_np_dtype_descr(arr.dtype), base64.b64encode(arr.tobytes()).decode()]}
        if isinstance(value, torch.dtype):
            return {"dt": str(value)}
        if isinstance(value, torch.device):
            return {"dev": str(value)}
        if t is torch.Size:
            return {"size": list(value)}
        if t is dict or t is collections.OrderedDict:
            items = []
            for key, item in value.items():
                key_node = self.key(key, path)
                items.append([key_node, self.node(item, f"{path}[{key!r}]")])
            return {"od" if t is collections.OrderedDict else "d": items}
        if t is list:
            return {"l": [self.node(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if t is tuple:
            return {"t": [self.node(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        raise UnsupportedTypeError(
            f"{path or 'state'}: values of type {t.__module__}.{t.__qualname__} are not stored "
            "(ecsnap never pickles); convert it to tensors, arrays, numbers, strings or "
            "containers of them",
            path or "state",
        )

    def key(self, key: Any, path: str) -> Any:
        if key is None or type(key) in (bool, int, float, str, bytes):
            return self.node(key, path)
        if type(key) is tuple:
            return {"t": [self.key(k, path) for k in key]}
        raise UnsupportedTypeError(
            f"{path}: dict key {key!r} of type {type(key).__name__}", path or "state"
        )

    def _tensor(self, t: torch.Tensor, path: str) -> int:
        if t.layout != torch.strided:
            raise UnsupportedTypeError(f"{path}: {t.layout} tensors are not stored", path)
        if t.is_quantized:
            raise UnsupportedTypeError(f"{path}: quantized tensors are not stored", path)
        if t.device.type == "meta":
            raise UnsupportedTypeError(f"{path}: meta tensors hold no data", path)
        leaf = Leaf(
            kind="torch",
            dtype=str(t.dtype),
            shape=list(t.shape),
            offset=self.offset,
            nbytes=t.numel() * t.element_size(),
            source=t,
            requires_grad=bool(t.requires_grad),
            device=str(t.device),
        )
        return self._leaf(leaf)

    def _array(self, a: np.ndarray[Any, Any], path: str) -> int:
        if a.dtype.hasobject:
            raise UnsupportedTypeError(f"{path}: numpy arrays of object dtype are not stored", path)
        leaf = Leaf(
            kind="numpy",
            dtype=_np_dtype_descr(a.dtype),
            shape=list(a.shape),
            offset=self.offset,
            nbytes=a.nbytes,
            source=a,
        )
        return self._leaf(leaf)


def flatten(state: Any) -> tuple[Any, list[Leaf], int]:
    """(skeleton, leaves, shard bytes) of ``state``; raises :class:`UnsupportedTypeError`."""
    f = _Flattener()
    skeleton = f.node(state, "")
    return skeleton, f.leaves, f.offset


def _source_bytes(leaf: Leaf) -> np.ndarray[Any, Any]:
    """A flat uint8 numpy view of a leaf's bytes (a contiguous copy only where needed)."""
    src = leaf.source
    if isinstance(src, torch.Tensor):
        t = src.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel() == 0:
            return np.zeros(0, dtype=np.uint8)
        return t.reshape(-1).view(torch.uint8).numpy()
    arr = np.ascontiguousarray(src)
    return arr.reshape(-1).view(np.uint8)


def copy_pieces(
    jobs: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]], pool: ThreadPoolExecutor | None
) -> float:
    """``np.copyto(dst, src)`` for every pair, big ones cut in pieces over ``pool``'s threads;
    returns the CPU seconds the copies took, every thread's (``ecsnap_cpu_seconds{phase=stage}``).

    numpy drops the GIL for plain copies, so two threads use both cores.
    """
    total = sum(src.nbytes for _, src in jobs)
    if pool is None or total < _PARALLEL_MIN:
        t0 = time.thread_time()
        for dst, src in jobs:
            np.copyto(dst, src)
        return time.thread_time() - t0
    futures = []
    for dst, src in jobs:
        n = src.nbytes
        for o in range(0, n, _PIECE):
            e = min(n, o + _PIECE)
            futures.append(pool.submit(_copy, dst[o:e], src[o:e]))
    return sum(f.result() for f in futures)


def _copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> float:
    t0 = time.thread_time()
    np.copyto(dst, src)
    return time.thread_time() - t0


def source_bytes(leaf: Leaf) -> np.ndarray[Any, Any] | None:
    """A leaf's bytes as a flat uint8 view (see :func:`_source_bytes`); None for a CUDA leaf."""
    return None if leaf.device.startswith("cuda") else _source_bytes(leaf)


def stage(
    leaves: list[Leaf],
    dest: np.ndarray[Any, Any],
    pool: ThreadPoolExecutor | None,
    *,
    skip_cuda: bool = False,
    sources: list[np.ndarray[Any, Any] | None] | None = None,
) -> float:
    """Copy every leaf into ``dest`` (the shard's shared-memory view) at its offset; a leaf
    marked ``ref`` lies in the base step's shard already and is not copied. Returns the copies'
    CPU seconds.

    With ``skip_cuda``, CUDA leaves are left to :class:`storage.gpu.DeviceCopier`. ``sources``
    are the leaves' bytes if the caller has them already (:func:`source_bytes`).
    """
    jobs = []
    for i, leaf in enumerate(leaves):
        if skip_cuda and leaf.device.startswith("cuda"):
            continue
        if leaf.nbytes and not leaf.ref:
            src = sources[i] if sources is not None else None
            if src is None:
                src = _source_bytes(leaf)
            jobs.append((dest[leaf.offset : leaf.offset + leaf.nbytes], src))
    return copy_pieces(jobs, pool)


def unflatten_views(
    skeleton: Any, leaf_meta: list[dict[str, Any]], buffer: Any, base: Any = None
) -> Any:
    """Rebuild the state with tensors and arrays that are views of ``buffer`` (no copy).

    ``buffer`` is a writable buffer object (a private mapping of the shard); every view keeps it
    alive, so it lives exactly as long as the returned tensors do. Leaves marked ``ref`` are
    views of ``base``, the mapping of the base step's shard.
    """
    made: list[Any] = []
    whole = buffer
    for meta in leaf_meta:
        leaf = Leaf.from_meta(meta)
        buffer = whole
        if leaf.ref:
            if base is None:
                raise UnsupportedTypeError("a leaf refers to a base step's shard not given")
            buffer = base
        if leaf.kind == "torch":
            dtype = _torch_dtype(leaf.dtype)
            if leaf.nbytes == 0:
                t = torch.empty(leaf.shape, dtype=dtype)
            else:
                raw = torch.frombuffer(
                    buffer, dtype=torch.uint8, count=leaf.nbytes, offset=leaf.offset
                )
                t = raw.view(dtype).reshape(leaf.shape)
            if leaf.requires_grad:
                t.requires_grad_(True)
            made.append(t)
        else:
            dt = _np_dtype(leaf.dtype)
            count = int(np.prod(leaf.shape)) if leaf.shape else 1
            if leaf.nbytes == 0:
                made.append(np.empty(leaf.shape, dtype=dt))
            else:
                made.append(
                    np.frombuffer(buffer, dtype=dt, count=count, offset=leaf.offset).reshape(
                        leaf.shape
                    )
                )
    return _build(skeleton, made)


def build(skeleton: Any, made: list[Any]) -> Any:
    """The nested structure of ``skeleton`` with leaf i replaced by ``made[i]``."""
    return _build(skeleton, made)


def _build(node: Any, made: list[Any]) -> Any:
    (tag, value), *_ = node.items()
    if tag == "n":
        return None
    if tag in ("b", "i", "s"):
        return value
    if tag == "f":
        return float.fromhex(value)
    if tag == "y":
        raw = base64.b64decode(value)
        return bytearray(raw) if node.get("ba") else raw
    if tag in ("T", "N"):
        return made[value]
    if tag == "ns":
        dtype = _np_dtype(value[0])
        return np.frombuffer(base64.b64decode(value[1]), dtype=dtype)[0]
    if tag == "dt":
        return _torch_dtype(value)
    if tag == "dev":
        return torch.device(value)
    if tag == "size":
        return torch.Size(value)
    if tag == "d":
        return {_build(k, made): _build(v, made) for k, v in value}
    if tag == "od":
        return collections.OrderedDict((_build(k, made), _build(v, made)) for k, v in value)
    if tag == "l":
        return [_build(v, made) for v in value]
    if tag == "t":
        return tuple(_build(v, made) for v in value)
    raise UnsupportedTypeError(f"unknown skeleton tag {tag!r} in a stored shard")
