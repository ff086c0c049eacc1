"""The GPU path's logic on the CPU (registration bookkeeping), and on CUDA when there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.errors import StorageError
from storage.gpu import HostRegistry


class RecordingRegistrar:
    """Implements the Registrar interface and keeps what was pinned (no CUDA needed)."""

    def __init__(self, fail: bool = False) -> None:
        self.pinned: dict[int, int] = {}
        self.calls = 0
        self.fail = fail

    def register(self, ptr: int, size: int) -> None:
        self.calls += 1
        if self.fail:
            raise StorageError("cudaHostRegister failed with error 1")
        assert ptr not in self.pinned, "registered twice"
        self.pinned[ptr] = size

    def unregister(self, ptr: int) -> None:
        del self.pinned[ptr]


def test_each_buffer_is_pinned_once_and_unpinned_on_close() -> None:
    reg = RecordingRegistrar()
    registry = HostRegistry(reg)
    a, b = np.zeros(1 << 20, np.uint8), np.zeros(4096, np.uint8)
    for _ in range(5):  # one buffer reused by every step: registered once
        registry.ensure(a)
    registry.ensure(b)
    assert reg.calls == 2 and sorted(reg.pinned.values()) == [4096, 1 << 20]
    registry.forget(b)  # before a remap
    assert list(reg.pinned.values()) == [1 << 20]
    registry.ensure(b)
    assert reg.calls == 3
    registry.close()
    assert reg.pinned == {}


def test_a_failed_registration_is_an_error_and_not_remembered() -> None:
    registry = HostRegistry(RecordingRegistrar(fail=True))
    with pytest.raises(StorageError, match="cudaHostRegister"):
        registry.ensure(np.zeros(4096, np.uint8))
    assert registry.pinned == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_copies_land_in_pinned_memory() -> None:
    from storage.gpu import CudaRegistrar, DeviceCopier
    from storage.state import flatten, unflatten_views

    state = {"w": torch.randn(1000, 1000, device="cuda"), "b": torch.arange(7.0, device="cuda")}
    skeleton, leaves, nbytes = flatten(state)
    host = np.zeros(nbytes, np.uint8)
    copier = DeviceCopier(HostRegistry(CudaRegistrar()))
    events = copier.enqueue(leaves, host)
    for e in events:
        e.synchronize()
    out = unflatten_views(skeleton, [leaf.meta() for leaf in leaves], host)
    assert torch.equal(out["w"], state["w"].cpu()) and torch.equal(out["b"], state["b"].cpu())
    copier.registry.close()
