"""GPU snapshots: device-to-host copies into pinned shared memory on a side stream.

The daemon's shared-memory buffers are reused across steps, so each is registered as pinned
memory (``cudaHostRegister``) once, the first time a CUDA tensor is copied into it, and stays
registered until the Store closes. A ``put`` with CUDA tensors then:

1. records an event on the producing (current) stream;
2. on a dedicated copy stream, waits for that event (on the GPU) and copies every CUDA tensor
   with ``non_blocking=True`` straight into the shard's pinned shared memory;
3. records a ``copy_done`` event; a background thread waits for it and only then tells the daemon
   the shard is staged.

The training stream is never synchronised with the host. :meth:`storage.Store.guard` adds an
optimizer step pre-hook that makes the current stream wait for the last put's ``copy_done`` (a
stream wait, not a host sync), so the optimizer never overwrites parameters still being copied.

The registration bookkeeping works on the CPU (``Registrar`` is the only CUDA-specific part).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import torch

from storage.errors import StorageError
from storage.state import _torch_dtype
from storage.table import Leaf

__all__ = ["CudaRegistrar", "DeviceCopier", "HostRegistry", "Registrar", "to_device"]


class Registrar(Protocol):
    """Pins and unpins host memory ranges (cudaHostRegister / cudaHostUnregister)."""

    def register(self, ptr: int, size: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaRegistrar:
    """The real one, through torch's binding of the CUDA runtime."""

    def __init__(self) -> None:
        self.cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def register(self, ptr: int, size: int) -> None:
        err = self.cudart.cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise StorageError(f"cudaHostRegister of {size} bytes failed with error {int(err)}")

    def unregister(self, ptr: int) -> None:
        self.cudart.cudaHostUnregister(ptr)


class HostRegistry:
    """Which shared-memory mappings are pinned: each registered once, unpinned on close.

    Thread-safe. Keys are the mapping's address and size, so a buffer reused for a later step
    is not registered again; a buffer that was closed and re-mapped elsewhere is.
    """

    def __init__(self, registrar: Registrar) -> None:
        self.registrar = registrar
        self.pinned: dict[tuple[int, int], int] = {}  # (address, size) -> times asked
        self._lock = threading.Lock()

    def ensure(self, array: np.ndarray[Any, Any]) -> int:
        """Pin the memory of ``array`` (a whole mapping) unless already pinned; its address."""
        ptr = int(array.__array_interface__["data"][0])
        key = (ptr, int(array.nbytes))
        with self._lock:
            if key not in self.pinned:
                self.registrar.register(ptr, key[1])
                self.pinned[key] = 0
            self.pinned[key] += 1
        return ptr

    def forget(self, array: np.ndarray[Any, Any]) -> None:
        """Unpin one mapping (before it is unmapped)."""
        key = (int(array.__array_interface__["data"][0]), int(array.nbytes))
        with self._lock:
            if self.pinned.pop(key, None) is not None:
                self.registrar.unregister(key[0])

    def close(self) -> None:
        with self._lock:
            keys, self.pinned = list(self.pinned), {}
        for ptr, _size in keys:
            self.registrar.unregister(ptr)


class DeviceCopier:
    """Enqueues device-to-host copies of CUDA leaves on one side stream per device."""

    def __init__(self, registry: HostRegistry) -> None:
        self.registry = registry
        self.streams: dict[int, Any] = {}

    def stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        s = self.streams.get(index)
        if s is None:
            s = self.streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return s

    def enqueue(self, leaves: list[Leaf], mapping: np.ndarray[Any, Any]) -> list[Any]:
        """Copy the CUDA ``leaves`` into ``mapping`` (the shard's whole shared-memory buffer)
        asynchronously; returns one event per device, complete when its copies are done."""
        cuda = [leaf for leaf in leaves if leaf.nbytes and leaf.device.startswith("cuda")]
        if not cuda:
            return []
        self.registry.ensure(mapping)
        host = torch.from_numpy(mapping)
        done = []
        by_device: dict[str, list[Leaf]] = {}
        for leaf in cuda:
            by_device.setdefault(leaf.device, []).append(leaf)
        for dev_name, group in by_device.items():
            device = torch.device(dev_name)
            produced = torch.cuda.Event()  # type: ignore[no-untyped-call]
            produced.record(torch.cuda.current_stream(device))
            side = self.stream(device)
            with torch.cuda.stream(side):
                side.wait_event(produced)
                for leaf in group:
                    src = leaf.source.detach()
                    if not src.is_contiguous():
                        src = src.contiguous()
                    dst = host[leaf.offset : leaf.offset + leaf.nbytes]
                    dst.view(_torch_dtype(leaf.dtype)).view(src.shape).copy_(src, non_blocking=True)
                    # the source must outlive the copy even if the caller drops it
                    src.record_stream(side)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(side)
                done.append(event)
        return done


def to_device(obj: Any, device: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.to(device, non_blocking=True)
        return t.requires_grad_(True) if obj.requires_grad else t
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(to_device(v, device) for v in obj)
    return obj
