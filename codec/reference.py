"""A slow, obviously correct numpy implementation of the same RS(k, m) code: the test oracle.

GF(2^8) with the polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11d), as ISA-L. The generator is the
identity on top of the Cauchy rows ``1 / (i ^ j)`` for i in k..k+m-1, j in 0..k-1, which is what
ISA-L's ``gf_gen_cauchy1_matrix`` builds, except for k = 1, where every parity row is 1: RS(1, m) is
(m+1)-way replication, each parity chunk a copy of the data chunk. Decoding inverts a k x k
submatrix by Gauss–Jordan elimination. 0.1–0.4 GB/s: for tests, never for data paths.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from codec.errors import ChunkSizeMismatchError, InvalidParamsError, TooFewChunksError

__all__ = ["cauchy_matrix", "decode", "encode", "gf_inv", "gf_mul", "invert"]

U8 = npt.NDArray[np.uint8]


def _build_tables() -> tuple[U8, U8, U8]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.uint8)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= 0x11D
    exp[255:510] = exp[:255]
    a = np.arange(256)
    la = log[a].astype(np.int64)
    mul = exp[(la[:, None] + la[None, :]) % 255].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    return exp, log, mul


_EXP, _LOG, MUL_TABLE = _build_tables()


def gf_mul(a: int, b: int) -> int:
    """Product of two GF(2^8) elements."""
    return int(MUL_TABLE[a, b])


def gf_inv(a: int) -> int:
    """Multiplicative inverse in GF(2^8); ``ZeroDivisionError`` for 0."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(_EXP[(255 - int(_LOG[a])) % 255])


def cauchy_matrix(k: int, m: int) -> U8:
    """The (k+m) x k systematic Cauchy generator matrix (all parity rows 1 for k = 1)."""
    if k < 1 or m < 1 or k + m > 255:
        raise InvalidParamsError(f"invalid k={k}, m={m}")
    out = np.zeros((k + m, k), dtype=np.uint8)
    out[:k] = np.eye(k, dtype=np.uint8)
    if k == 1:
        out[1:] = 1
        return out
    for i in range(k, k + m):
        for j in range(k):
            out[i, j] = gf_inv(i ^ j)
    return out


def invert(matrix: U8) -> U8:
    """Inverse of a square GF(2^8) matrix by Gauss–Jordan; ``ValueError`` if singular."""
    n = matrix.shape[0]
    a = matrix.astype(np.uint8).copy()
    inv = np.eye(n, dtype=np.uint8)
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r, col]), None)
        if pivot is None:
            raise ValueError("singular matrix")
        a[[col, pivot]] = a[[pivot, col]]
        inv[[col, pivot]] = inv[[pivot, col]]
        scale = gf_inv(int(a[col, col]))
        a[col] = MUL_TABLE[scale][a[col]]
        inv[col] = MUL_TABLE[scale][inv[col]]
        for r in range(n):
            if r != col and a[r, col]:
                f = int(a[r, col])
                a[r] ^= MUL_TABLE[f][a[col]]
                inv[r] ^= MUL_TABLE[f][inv[col]]
    return inv


def _combine(rows: U8, chunks: Sequence[U8]) -> list[U8]:
    out = []
    for row in rows:
        acc = np.zeros(chunks[0].shape[0] if chunks else 0, dtype=np.uint8)
        for coeff, chunk in zip(row, chunks, strict=True):
            if coeff:
                acc ^= MUL_TABLE[int(coeff)][chunk]
        out.append(acc)
    return out


def _u8(buf: Any) -> U8:
    return np.frombuffer(buf, dtype=np.uint8)


def encode(k: int, m: int, data: Sequence[Any]) -> list[U8]:
    """The m parity chunks of k equal-length data chunks."""
    chunks = [_u8(b) for b in data]
    if len(chunks) != k or len({c.shape[0] for c in chunks}) > 1:
        raise ChunkSizeMismatchError("need k data chunks of one length")
    return _combine(cauchy_matrix(k, m)[k:], chunks)


def decode(
    k: int, m: int, available: Mapping[int, Any], wanted: Iterable[int] | None = None
) -> dict[int, U8]:
    """Rebuild ``wanted`` (default: missing data indexes) from any k available chunks."""
    if len(available) < k:
        raise TooFewChunksError(len(available), k)
    if wanted is None:
        wanted = [i for i in range(k) if i not in available]
    wanted = sorted(set(wanted))
    chosen = sorted(available)[:k]
    gen = cauchy_matrix(k, m)
    inv = invert(gen[chosen])
    rows = np.zeros((len(wanted), k), dtype=np.uint8)
    for r, index in enumerate(wanted):
        for col in range(k):
            acc = 0
            for j in range(k):
                acc ^= gf_mul(int(gen[index, j]), int(inv[j, col]))
            rows[r, col] = acc
    result = _combine(rows, [_u8(available[i]) for i in chosen])
    return dict(zip(wanted, result, strict=True))
