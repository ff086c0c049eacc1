"""Test buffers that end exactly at a PROT_NONE guard page, so a one-byte overrun segfaults."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def guarded(nbytes: int, fill: bytes | None = None, rng: np.random.Generator | None = None):
    """A writable uint8 array of ``nbytes`` placed at the very end of its allocation."""
    page = mmap.PAGESIZE
    body = -(-max(nbytes, 1) // page) * page
    region = mmap.mmap(-1, body + page)
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    del anchor
    if _libc.mprotect(base + body, page, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    # the array's base keeps the mapping (and its guard page) alive exactly as long as needed
    arr = np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=body - nbytes)
    if rng is not None:
        arr[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    elif fill is not None:
        arr[:] = np.frombuffer((fill * (nbytes // max(len(fill), 1) + 1))[:nbytes], np.uint8)
    return arr
