"""Errors raised by :mod:`codec`.

Every error derives from :class:`CodecError`; the specific ones also subclass the builtin they
mean, so ``except ValueError`` keeps working for callers that do not know this package.
"""

from __future__ import annotations

__all__ = [
    "ChunkSizeMismatchError",
    "CodecError",
    "InvalidParamsError",
    "LibraryNotFoundError",
    "TooFewChunksError",
]


class CodecError(Exception):
    """Root of every error raised by the codec."""


class InvalidParamsError(CodecError, ValueError):
    """``RSCodec(k, m)`` with k < 1, m < 1 or k + m > 255, or a bad chunk index or thread count.

    Raised by the constructor and by ``decode``/``decode_into`` for an index outside 0..k+m-1.
    """


class ChunkSizeMismatchError(CodecError, ValueError):
    """The buffers of one call are not all the same length, or not as many as the codec needs.

    Raised by ``encode``, ``encode_into``, ``decode`` and ``decode_into`` before ISA-L is called
    (ISA-L checks nothing and would read or write out of bounds).
    """


class TooFewChunksError(CodecError):
    """``decode`` was given fewer than k distinct chunks: the stripe cannot be rebuilt.

    ``available`` is how many chunks were given, ``needed`` is k.
    """

    def __init__(self, available: int, needed: int) -> None:
        super().__init__(
            f"{available} chunk(s) available, {needed} needed to decode: more than m chunks of "
            "this stripe are lost; recover from an older step or the persistent tier"
        )
        self.available = available
        self.needed = needed


class LibraryNotFoundError(CodecError, ImportError):
    """Neither the pyeclib wheel's ISA-L nor a system ``libisal.so.2`` could be loaded."""
