from __future__ import annotations

import zlib

import numpy as np
import pytest

from codec import (
    ChunkSizeMismatchError,
    InvalidParamsError,
    RSCodec,
    checksum,
    chunk_count,
    join,
    padded,
    split,
)
from codec import reference as ref


@pytest.mark.parametrize("n", [0, 1, 3181, 10001, 4096])
def test_checksum_is_crc32_and_streams(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert checksum(data) == zlib.crc32(data.tobytes())
    cut = n // 3
    assert checksum(data[cut:], checksum(data[:cut])) == checksum(data)
    assert checksum(memoryview(data.tobytes())) == checksum(bytearray(data.tobytes()))


def test_checksum_catches_a_flipped_bit() -> None:
    data = bytearray(b"x" * 1000)
    before = checksum(data)
    data[500] ^= 1
    assert checksum(data) != before


@pytest.mark.parametrize(("n", "k", "chunk"), [(0, 3, 8), (1, 3, 8), (17, 3, 8), (24, 3, 8)])
def test_split_pad_encode_join(n: int, k: int, chunk: int) -> None:
    blob = bytes(range(n))
    views = split(blob, k, chunk)
    assert len(views) == k
    assert sum(v.nbytes for v in views) == n
    assert chunk_count(n, chunk) == -(-n // chunk)
    chunks = padded(views, chunk)
    assert all(memoryview(c).nbytes == chunk for c in chunks)
    parity = RSCodec(k, 2).encode(chunks)
    expected = ref.encode(
        k, 2, [bytes(blob[i * chunk : (i + 1) * chunk]).ljust(chunk, b"\0") for i in range(k)]
    )
    for p, e in zip(parity, expected, strict=True):
        np.testing.assert_array_equal(p, e)
    assert bytes(join(chunks, n)) == blob
    out = bytearray(n + 5)
    join(views, n, out)
    assert bytes(out[:n]) == blob


def test_layout_errors() -> None:
    with pytest.raises(InvalidParamsError):
        split(b"x" * 25, 3, 8)
    with pytest.raises(InvalidParamsError):
        chunk_count(5, 0)
    with pytest.raises(ChunkSizeMismatchError):
        padded([b"abc", b"a"], 4)
    with pytest.raises(ChunkSizeMismatchError):
        join([b"ab"], 5)
