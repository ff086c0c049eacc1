"""ecsnap's codec: systematic Reed–Solomon over GF(2^8) by ISA-L, checksums and chunk layout.

Pure computation: no I/O, no processes, and no import of ``transport`` or ``storage``.

>>> from codec import RSCodec
>>> rs = RSCodec(2, 1)
>>> p = rs.encode([b"ab", b"cd"])
>>> bytes(rs.decode({1: b"cd", 2: p[0]})[0])
b'ab'
"""

from codec.checksum import checksum
from codec.errors import (
    ChunkSizeMismatchError,
    CodecError,
    InvalidParamsError,
    LibraryNotFoundError,
    TooFewChunksError,
)
from codec.layout import chunk_count, join, padded, split
from codec.rs import Buffer, RSCodec

__all__ = [
    "Buffer",
    "ChunkSizeMismatchError",
    "CodecError",
    "InvalidParamsError",
    "LibraryNotFoundError",
    "RSCodec",
    "TooFewChunksError",
    "checksum",
    "chunk_count",
    "join",
    "padded",
    "split",
]
