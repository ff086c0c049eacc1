"""Chunk checksums: CRC-32 (zlib's polynomial) through the ``isal`` package: 59-79 GB/s of bytes in
L2 here, 16.5 GB/s of bytes read from memory (it runs at memory speed)."""

from __future__ import annotations

from typing import Any

from isal import isal_zlib

__all__ = ["checksum"]


def checksum(buf: Any, start: int = 0) -> int:
    """CRC-32 of ``buf`` (any contiguous buffer), continuing from ``start`` to stream pieces.

    ``checksum(b, checksum(a)) == checksum(a + b)``; equal to ``zlib.crc32``.

    >>> checksum(b"ecsnap") == checksum(b"snap", checksum(b"ec"))
    True
    """
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        buf = memoryview(buf).cast("B")
    return int(isal_zlib.crc32(buf, start))
