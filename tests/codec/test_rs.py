from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from codec import (
    ChunkSizeMismatchError,
    CodecError,
    InvalidParamsError,
    RSCodec,
    TooFewChunksError,
)
from codec import reference as ref

from ._buffers import guarded

SMALL_SHAPES = [(k, m) for k in range(1, 10) for m in range(1, 11 - k)]
SIZES = [0, 1, 15, 31, 63, 64, 3181, 10001, (1 << 20) + 7]


def _stripe(k: int, m: int, size: int, seed_: int = 0):
    rng = np.random.default_rng(seed_ * 1000 + k * 31 + m + size)
    data = [guarded(size, rng=rng) for _ in range(k)]
    parity = [guarded(size) for _ in range(m)]
    return data, parity


@pytest.mark.parametrize(("k", "m"), SMALL_SHAPES, ids=lambda v: str(v))
def test_every_erasure_pattern(k: int, m: int) -> None:
    rs = RSCodec(k, m)
    data, parity = _stripe(k, m, 3181)
    rs.encode_into(data, parity)
    expected = ref.encode(k, m, data)
    for p, e in zip(parity, expected, strict=True):
        np.testing.assert_array_equal(p, e)
    chunks = data + parity
    scratch = [guarded(3181) for _ in range(k + m)]
    for lost in range(1, m + 1):
        for erased in itertools.combinations(range(k + m), lost):
            available = {i: chunks[i] for i in range(k + m) if i not in erased}
            out = {i: scratch[i] for i in erased}
            rs.decode_into(available, out)
            for i in erased:
                np.testing.assert_array_equal(out[i], chunks[i], err_msg=f"{k}+{m} lost {erased}")


@pytest.mark.parametrize(("k", "m"), [(10, 4), (12, 4), (16, 4)])
def test_wide_shapes_sampled_patterns(k: int, m: int) -> None:
    rs = RSCodec(k, m)
    data, parity = _stripe(k, m, 10001)
    rs.encode_into(data, parity)
    for p, e in zip(parity, ref.encode(k, m, data), strict=True):
        np.testing.assert_array_equal(p, e)
    chunks = data + parity
    rng = np.random.default_rng(k)
    patterns = list(itertools.combinations(range(k + m), m))
    for idx in rng.choice(len(patterns), size=min(40, len(patterns)), replace=False):
        erased = patterns[idx]
        available = {i: chunks[i] for i in range(k + m) if i not in erased}
        got = rs.decode(available, wanted=erased)
        for i in erased:
            np.testing.assert_array_equal(got[i], chunks[i])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("threads", [1, 2])
def test_sizes_round_trip(size: int, threads: int) -> None:
    k, m = 4, 2
    rs = RSCodec(k, m, threads=threads)
    data, parity = _stripe(k, m, size)
    rs.encode_into(data, parity)
    for p, e in zip(parity, ref.encode(k, m, data), strict=True):
        np.testing.assert_array_equal(p, e)
    available = {1: data[1], 3: data[3], 4: parity[0], 5: parity[1]}
    got = rs.decode(available)
    assert sorted(got) == [0, 2]
    np.testing.assert_array_equal(got[0], data[0])
    np.testing.assert_array_equal(got[2], data[2])


def test_threads_give_same_bytes_as_one_thread() -> None:
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 256, (3 << 20) + 5, dtype=np.uint8) for _ in range(8)]
    one = RSCodec(8, 3).encode(data)
    two = RSCodec(8, 3, threads=2)
    try:
        for a, b in zip(one, two.encode(data), strict=True):
            np.testing.assert_array_equal(a, b)
        # the helper's half ran on another thread, and its CPU time is counted for the caller
        assert two.helper_seconds() > 0
    finally:
        two.close()
    solo = RSCodec(8, 3)
    solo.encode(data)
    assert solo.helper_seconds() == 0


def test_matches_pyeclib_isa_l_rs_cauchy() -> None:
    from pyeclib import ec_iface as pyeclib  # a dependency: its absence is a failure

    rng = np.random.default_rng(3)
    for k, m in [(2, 1), (4, 2), (8, 3), (10, 4)]:
        driver = pyeclib.ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy")
        payload = rng.integers(0, 256, 100_003, dtype=np.uint8).tobytes()
        fragments = driver.encode(payload)
        bodies = [np.frombuffer(f[80:], dtype=np.uint8) for f in fragments]
        parity = RSCodec(k, m).encode(bodies[:k])
        for j in range(m):
            np.testing.assert_array_equal(parity[j], bodies[k + j], err_msg=f"{k}+{m} parity {j}")


@pytest.mark.parametrize("m", [1, 2, 4])
def test_k1_is_replication(m: int) -> None:
    """RS(1, m) keeps m copies: every parity chunk equals the data chunk, any one rebuilds all."""
    rs = RSCodec(1, m, threads=2)
    assert (rs.matrix == 1).all()
    data, parity = _stripe(1, m, (1 << 20) + 7)
    rs.encode_into(data, parity)
    for p in parity:
        np.testing.assert_array_equal(p, data[0])
    chunks = data + parity
    for keep in range(m + 1):
        out = {i: guarded(len(data[0])) for i in range(m + 1) if i != keep}
        rs.decode_into({keep: chunks[keep]}, out)
        for b in out.values():
            np.testing.assert_array_equal(b, data[0])


def test_k1_matches_pyeclib_for_one_copy() -> None:
    """For m = 1 the replication row is Cauchy's own (1 / 1), so pyeclib agrees byte for byte."""
    from pyeclib import ec_iface as pyeclib

    payload = np.random.default_rng(5).integers(0, 256, 4099, dtype=np.uint8).tobytes()
    fragments = pyeclib.ECDriver(k=1, m=1, ec_type="isa_l_rs_cauchy").encode(payload)
    bodies = [np.frombuffer(f[80:], dtype=np.uint8) for f in fragments]
    np.testing.assert_array_equal(RSCodec(1, 1).encode(bodies[:1])[0], bodies[1])


def test_buffer_kinds() -> None:
    rs = RSCodec(3, 2)
    raw = [bytes([i + 1]) * 100 for i in range(3)]
    inputs = [raw[0], bytearray(raw[1]), memoryview(raw[2])]
    parity = [bytearray(100), np.zeros(100, dtype=np.uint8)]
    rs.encode_into(inputs, parity)
    expected = ref.encode(3, 2, raw)
    assert bytes(parity[0]) == expected[0].tobytes()
    np.testing.assert_array_equal(parity[1], expected[1])
    import torch

    t = torch.arange(75, dtype=torch.float32).reshape(3, 25)
    rows = [t[i].numpy() for i in range(3)]
    out = rs.encode(rows)
    np.testing.assert_array_equal(out[0], ref.encode(3, 2, [r.tobytes() for r in rows])[0])


def test_too_few_chunks_fields() -> None:
    rs = RSCodec(4, 2)
    data, parity = _stripe(4, 2, 64)
    rs.encode_into(data, parity)
    with pytest.raises(TooFewChunksError) as info:
        rs.decode({0: data[0], 1: data[1], 4: parity[0]})
    assert (info.value.available, info.value.needed) == (3, 4)
    assert isinstance(info.value, CodecError)


def test_length_mismatch() -> None:
    rs = RSCodec(2, 1)
    with pytest.raises(ChunkSizeMismatchError):
        rs.encode([b"ab", b"abc"])
    with pytest.raises(ChunkSizeMismatchError):
        rs.encode_into([b"ab", b"cd"], [bytearray(3)])
    with pytest.raises(ChunkSizeMismatchError):
        rs.encode([b"ab"])
    with pytest.raises(ChunkSizeMismatchError):
        rs.decode({0: b"ab", 2: b"abc"})
    with pytest.raises(ChunkSizeMismatchError):
        rs.encode_into([b"ab", b"cd"], [b"xy"])  # read-only output
    with pytest.raises(ChunkSizeMismatchError):
        rs.encode([np.zeros((4, 4), np.uint8)[:, 0], b"abcd"])  # not contiguous
    assert issubclass(ChunkSizeMismatchError, ValueError)


@pytest.mark.parametrize(("k", "m"), [(0, 1), (1, 0), (-1, 2), (200, 56), (True, 1)])
def test_invalid_params(k: int, m: int) -> None:
    with pytest.raises(InvalidParamsError):
        RSCodec(k, m)


def test_invalid_index_and_threads() -> None:
    rs = RSCodec(2, 1)
    with pytest.raises(InvalidParamsError):
        rs.decode({0: b"a", 1: b"b"}, wanted=[3])
    with pytest.raises(InvalidParamsError):
        RSCodec(2, 1, threads=0)
    assert issubclass(InvalidParamsError, ValueError)


def test_decode_table_cache_and_parity_wanted() -> None:
    rs = RSCodec(5, 3)
    data, parity = _stripe(5, 3, 1000)
    rs.encode_into(data, parity)
    avail = {0: data[0], 2: data[2], 3: data[3], 5: parity[0], 7: parity[2]}
    first = rs.decode(avail, wanted=[1, 4, 6])
    second = rs.decode(avail, wanted=[1, 4, 6])
    for i, want in ((1, data[1]), (4, data[4]), (6, parity[1])):
        np.testing.assert_array_equal(first[i], want)
        np.testing.assert_array_equal(second[i], want)
    assert len(rs._decode_cache) == 1


@seed(20261129)
@settings(max_examples=60, deadline=None)
@given(
    km=st.sampled_from([(1, 1), (2, 1), (3, 2), (4, 4), (6, 3), (9, 1)]),
    size=st.integers(0, 5000),
    data_seed=st.integers(0, 2**32 - 1),
    erase_seed=st.integers(0, 2**32 - 1),
)
def test_hypothesis_round_trip(km: tuple[int, int], size: int, data_seed: int, erase_seed: int):
    k, m = km
    rng = np.random.default_rng(data_seed)
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
    rs = RSCodec(k, m)
    chunks = data + rs.encode(data)
    erased = set(np.random.default_rng(erase_seed).permutation(k + m)[:m].tolist())
    got = rs.decode({i: c for i, c in enumerate(chunks) if i not in erased}, wanted=erased)
    for i in erased:
        np.testing.assert_array_equal(got[i], chunks[i])


@pytest.mark.parametrize("k,m", [(1, 2), (2, 2), (3, 1), (4, 2), (6, 3)])
def test_repair_row_spread_over_helpers_rebuilds_every_chunk(k: int, m: int) -> None:
    """A chain repair: each helper scales its chunk by its coefficient and adds it to the partial
    sum it received; the last sum is the lost chunk, for every target and any k sources in any
    order (sampled for the wide shapes)."""
    rs = RSCodec(k, m)
    rng = np.random.default_rng(k * 10 + m)
    size = 4096 + 33
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
    chunks = data + rs.encode(data)
    n = k + m
    for target in range(n):
        others = [i for i in range(n) if i != target]
        combos = list(itertools.combinations(others, k))
        for sources in combos[:: max(1, len(combos) // 8)]:
            order = list(rng.permutation(sources))
            row = rs.repair_row(order, target)
            assert row.shape == (k,)
            acc = None
            for coeff, i in zip(row, order, strict=True):
                out = np.empty(size, dtype=np.uint8)
                rs.scale_add(int(coeff), chunks[i], out, acc)
                acc = out
            assert acc is not None and np.array_equal(acc, chunks[target]), (target, order)


def test_repair_row_and_scale_add_reject_bad_input() -> None:
    rs = RSCodec(3, 1)
    with pytest.raises(InvalidParamsError, match="distinct sources without the target"):
        rs.repair_row([0, 1, 1], 3)
    with pytest.raises(InvalidParamsError, match="distinct sources without the target"):
        rs.repair_row([0, 1, 2], 2)
    with pytest.raises(InvalidParamsError, match="outside"):
        rs.repair_row([0, 1, 9], 3)
    with pytest.raises(InvalidParamsError, match=r"0\.\.255"):
        rs.scale_add(256, bytes(8), bytearray(8))
    with pytest.raises(ChunkSizeMismatchError):
        rs.scale_add(3, bytes(8), bytearray(9))
    # coefficient 1 with nothing to add is a copy; 0 gives zeros
    out = bytearray(8)
    rs.scale_add(1, bytes(range(8)), out)
    assert bytes(out) == bytes(range(8))
    rs.scale_add(0, bytes(range(8)), out, bytes(8))
    assert bytes(out) == bytes(8)


@pytest.mark.parametrize(("k", "m"), [(3, 1), (2, 2), (6, 3)])
def test_update_with_a_delta_equals_a_new_encode(k: int, m: int) -> None:
    """ec_encode_data_update: parity updated by the change of some chunks is the parity of
    the changed stripe, bit for bit."""
    rng = np.random.default_rng(k * 10 + m)
    rs = RSCodec(k, m)
    data = [rng.integers(0, 256, 4096 + 64, dtype=np.uint8) for _ in range(k)]
    parity = rs.encode(data)
    for i in range(0, k, 2):  # every other chunk changes, in part
        new = data[i].copy()
        new[100:900] = rng.integers(0, 256, 800, dtype=np.uint8)
        rs.update(i, np.bitwise_xor(data[i], new), parity)
        data[i] = new
    assert all(np.array_equal(a, b) for a, b in zip(parity, rs.encode(data), strict=True))
    with pytest.raises(InvalidParamsError):
        rs.update(k, data[0], parity)
