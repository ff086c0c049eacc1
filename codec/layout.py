"""Cutting a blob into fixed-size chunks and joining it back, with virtual zero padding.

A blob of n bytes striped over k data chunks of ``chunk_bytes`` each needs
``k * chunk_bytes >= n``. The bytes past n are zeros that are never stored or sent: :func:`split`
returns views that are short (or empty) at the end, and :func:`padded` turns them into equal-length
buffers for the codec by copying only the one partial chunk into a caller-owned scratch buffer and
pointing empty chunks at one shared, read-only zero buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from codec.errors import ChunkSizeMismatchError, InvalidParamsError

__all__ = ["chunk_count", "join", "padded", "split", "zeros"]

_ZEROS: dict[int, npt.NDArray[np.uint8]] = {}


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks of ``chunk_bytes`` hold ``nbytes`` (0 for an empty blob)."""
    if chunk_bytes < 1:
        raise InvalidParamsError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if nbytes < 0:
        raise InvalidParamsError(f"nbytes must be >= 0, got {nbytes}")
    return -(-nbytes // chunk_bytes)


def zeros(chunk_bytes: int) -> npt.NDArray[np.uint8]:
    """A shared read-only zero buffer of ``chunk_bytes``: the virtual pad."""
    z = _ZEROS.get(chunk_bytes)
    if z is None:
        z = np.zeros(chunk_bytes, dtype=np.uint8)
        z.flags.writeable = False
        _ZEROS[chunk_bytes] = z
    return z


def split(blob: Any, k: int, chunk_bytes: int) -> list[memoryview]:
    """k views of ``blob``, chunk i covering bytes ``[i*chunk_bytes, (i+1)*chunk_bytes)``.

    Views past the end of the blob are short or empty; nothing is copied. Raises
    :class:`InvalidParamsError` when the blob does not fit in k chunks.
    """
    view = memoryview(blob).cast("B")
    if chunk_count(view.nbytes, chunk_bytes) > k:
        raise InvalidParamsError(
            f"a blob of {view.nbytes} bytes does not fit in {k} chunks of {chunk_bytes} bytes"
        )
    return [view[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(k)]


def padded(chunks: Sequence[Any], chunk_bytes: int, scratch: Any | None = None) -> list[Any]:
    """Equal-length buffers for the codec from chunks that may be short at the end.

    Full chunks are returned as they are; empty ones become :func:`zeros`; a partial chunk is
    copied into ``scratch`` (at least ``chunk_bytes``, overwritten; allocated if None) with its
    tail zeroed. At most one chunk may be partial.
    """
    out: list[Any] = []
    used_scratch = False
    for c in chunks:
        n = memoryview(c).nbytes
        if n == chunk_bytes:
            out.append(c)
        elif n == 0:
            out.append(zeros(chunk_bytes))
        elif n < chunk_bytes:
            if used_scratch:
                raise ChunkSizeMismatchError("more than one partial chunk; only the last may be")
            used_scratch = True
            buf = np.zeros(chunk_bytes, dtype=np.uint8) if scratch is None else scratch
            arr = np.frombuffer(buf, dtype=np.uint8, count=chunk_bytes)
            arr[:n] = np.frombuffer(c, dtype=np.uint8)
            arr[n:] = 0
            out.append(arr)
        else:
            raise ChunkSizeMismatchError(f"chunk of {n} bytes exceeds chunk_bytes={chunk_bytes}")
    return out


def join(chunks: Sequence[Any], nbytes: int, out: Any | None = None) -> Any:
    """Concatenate chunks and cut the virtual pad: the first ``nbytes`` bytes.

    Writes into ``out`` (at least ``nbytes``) if given, else returns a new ``bytearray``.
    """
    target = bytearray(nbytes) if out is None else out
    dst = memoryview(target).cast("B")
    if dst.nbytes < nbytes:
        raise ChunkSizeMismatchError(f"out holds {dst.nbytes} bytes, {nbytes} needed")
    pos = 0
    for c in chunks:
        if pos >= nbytes:
            break
        src = memoryview(c).cast("B")
        take = min(src.nbytes, nbytes - pos)
        dst[pos : pos + take] = src[:take]
        pos += take
    if pos < nbytes:
        raise ChunkSizeMismatchError(f"chunks hold {pos} bytes, {nbytes} needed")
    return target
