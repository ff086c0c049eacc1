"""Systematic Reed–Solomon RS(k, m) over GF(2^8), computed by ISA-L.

Chunk indexes 0..k-1 are data, k..k+m-1 parity. The generator is ISA-L's Cauchy matrix
(``gf_gen_cauchy1_matrix``), the same one liberasurecode's ``isa_l_rs_cauchy`` uses, so the parity
is byte-identical to pyeclib's. Every square submatrix of a Cauchy matrix is invertible, so any k
chunks decode; ISA-L's Vandermonde generator does not have that property and is not used.

RS(1, m) is (m+1)-way replication: its parity rows are all 1, so every parity chunk is a copy of
the data chunk (Cauchy would scale copies 2..m by ``1 / i``, which protects no better and costs a
multiply), and encode and decode are plain copies. For m = 1 this is Cauchy's own row; for k = 1,
m > 1 the parity differs from pyeclib's. The daemons use it as the replication baseline.

Two phases, as in ISA-L itself: tables are built once (encode tables per codec, decode tables per
erasure pattern, both cached), then each call is one ``ec_encode_data`` over prebuilt pointer
arrays per thread.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from codec._isal import IsaL, library
from codec.errors import ChunkSizeMismatchError, CodecError, InvalidParamsError, TooFewChunksError

__all__ = ["Buffer", "RSCodec"]

#: Anything with the (C-contiguous) buffer protocol: bytes, bytearray, memoryview, numpy, mmap.
Buffer: TypeAlias = Any

U8Array: TypeAlias = npt.NDArray[np.uint8]

_PIECE_ALIGN = 64  # ISA-L's widest vectors; pieces start on this boundary
_MIN_PIECE = 256 * 1024  # below this a thread hand-off costs more than it saves
_PTR_CACHE_MAX = 512


def as_u8(buf: Buffer, *, writable: bool = False, what: str = "buffer") -> U8Array:
    """A flat uint8 numpy view of ``buf`` without copying; raise ``ValueError`` if impossible."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ChunkSizeMismatchError(f"{what} is not C-contiguous; pass a contiguous copy")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise ChunkSizeMismatchError(
                f"{what} ({type(buf).__name__}) is not a contiguous buffer: {exc}"
            ) from exc
    if writable and not arr.flags.writeable:
        raise ChunkSizeMismatchError(f"{what} is read-only; output buffers must be writable")
    return arr


def _pointers(bufs: Sequence[Buffer], writable: bool, what: str) -> tuple[tuple[int, ...], int]:
    """Addresses of ``bufs`` and their common length; the hot path of every call (~0.5 µs each).

    ``c_char.from_buffer`` is the cheapest way to a writable contiguous buffer's address; read-only
    and empty buffers take the numpy route.
    """
    addrs: list[int] = []
    length = -1
    for i, b in enumerate(bufs):
        try:
            n = b.nbytes if type(b) is np.ndarray else memoryview(b).nbytes
        except TypeError as exc:
            raise ChunkSizeMismatchError(f"{what} chunk {i} has no buffer interface") from exc
        if length < 0:
            length = n
        elif n != length:
            raise ChunkSizeMismatchError(
                f"{what} chunks must all be one length: chunk {i} is {n} bytes, not {length}"
            )
        try:
            addrs.append(ctypes.addressof(ctypes.c_char.from_buffer(b)))
        except (TypeError, ValueError):
            arr = as_u8(b, writable=writable, what=f"{what} chunk {i}")
            addrs.append(int(arr.__array_interface__["data"][0]))
    return tuple(addrs), max(length, 0)


class _Plan:
    """Per-thread pieces of one call: (length, src pointer array, dst pointer array)."""

    __slots__ = ("pieces",)

    def __init__(self, src: tuple[int, ...], dst: tuple[int, ...], length: int, threads: int):
        self.pieces: list[tuple[int, ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]]]
        self.pieces = []
        n = threads if length >= threads * _MIN_PIECE else 1
        step = -(-length // n)
        step = -(-step // _PIECE_ALIGN) * _PIECE_ALIGN
        offset = 0
        while offset < length:
            size = min(step, length - offset)
            s = (ctypes.c_void_p * len(src))(*[a + offset for a in src])
            d = (ctypes.c_void_p * len(dst))(*[a + offset for a in dst])
            self.pieces.append((size, s, d))
            offset += size


class RSCodec:
    """Reed–Solomon RS(k, m): k data chunks, m parity chunks, any k of the k+m rebuild the rest.

    ``threads > 1`` splits each call's chunk length over a thread pool (ctypes drops the GIL while
    ISA-L runs). A codec is safe to share between threads; its tables are immutable once built.

    >>> rs = RSCodec(4, 2)
    >>> data = [bytes([i]) * 1000 for i in range(4)]
    >>> parity = rs.encode(data)
    >>> rs.decode({1: data[1], 2: data[2], 4: parity[0], 5: parity[1]})[0].tobytes() == data[0]
    True

    Raises :class:`InvalidParamsError` for k < 1, m < 1, k + m > 255 or threads < 1, and
    :class:`LibraryNotFoundError` if ISA-L cannot be loaded.
    """

    def __init__(self, k: int, m: int, *, threads: int = 1) -> None:
        for name, value in (("k", k), ("m", m), ("threads", threads)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidParamsError(f"{name} must be an int, got {type(value).__name__}")
        if k < 1 or m < 1:
            raise InvalidParamsError(f"k and m must be >= 1, got k={k}, m={m}")
        if k + m > 255:
            raise InvalidParamsError(f"k + m must be <= 255 for GF(2^8), got {k + m}")
        if threads < 1:
            raise InvalidParamsError(f"threads must be >= 1, got {threads}")
        self.k = k
        self.m = m
        self.threads = threads
        self._lib: IsaL = library()
        n = k + m
        self._matrix = np.zeros(n * k, dtype=np.uint8)
        self._lib.gf_gen_cauchy1_matrix(_u8ptr(self._matrix), n, k)
        if k == 1:
            self._matrix[1:] = 1  # replication: every parity chunk is a copy
        self._encode_tables = self._tables(self._matrix[k * k :], m)
        self._decode_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], U8Array] = {}
        self._scale_tables: dict[tuple[int, bool], U8Array] = {}
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...], int], _Plan] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._helper_cpu = 0.0

    def __repr__(self) -> str:
        return f"RSCodec(k={self.k}, m={self.m}, threads={self.threads})"

    @property
    def matrix(self) -> U8Array:
        """The (k+m) x k generator matrix: identity on top of the Cauchy rows (a read-only copy).

        For k = 1 the parity rows are all 1 (replication)."""
        out = self._matrix.reshape(self.k + self.m, self.k).copy()
        out.flags.writeable = False
        return out

    # -- public calls ------------------------------------------------------------------------

    def encode(self, data: Sequence[Buffer]) -> list[U8Array]:
        """Return the m parity chunks of the k data chunks ``data`` as new uint8 arrays."""
        length = self._check_len(data, self.k, "data")
        parity = [np.empty(length, dtype=np.uint8) for _ in range(self.m)]
        self.encode_into(data, parity)
        return parity

    def encode_into(self, data: Sequence[Buffer], parity: Sequence[Buffer]) -> None:
        """Write the m parity chunks of ``data`` into ``parity``, zero-copy.

        The caller owns every buffer; ``parity`` is overwritten and must not overlap ``data``.
        Raises :class:`ChunkSizeMismatchError` unless there are k data and m parity buffers, all
        the same length.
        """
        if len(data) != self.k or len(parity) != self.m:
            raise ChunkSizeMismatchError(
                f"expected {self.k} data and {self.m} parity chunks, got {len(data)} and "
                f"{len(parity)}"
            )
        src, length = _pointers(data, False, "data")
        dst, plength = _pointers(parity, True, "parity")
        if plength != length:
            raise ChunkSizeMismatchError(
                f"parity chunks are {plength} bytes but data chunks are {length}"
            )
        if self.k == 1:
            self._copy(data[0], parity)
            return
        self._run(self._encode_tables, src, dst, length)

    def update(self, index: int, delta: Buffer, parity: Sequence[Buffer]) -> None:
        """Bring ``parity`` up to date after data chunk ``index`` changed by ``delta`` (its old
        bytes XOR its new ones), with ISA-L's ``ec_encode_data_update``: one pass over the
        changed chunk instead of a new encode of all k. Linear, so updates of several chunks
        apply in any order."""
        if not 0 <= index < self.k:
            raise InvalidParamsError(f"data chunk index outside 0..{self.k - 1}: {index}")
        (src,), length = _pointers([delta], False, "delta")
        dst, plength = _pointers(parity, True, "parity")
        if len(parity) != self.m or plength != length:
            raise ChunkSizeMismatchError(
                f"expected {self.m} parity chunks of {length} bytes, got {len(parity)} of {plength}"
            )
        if length:
            dst_p = (ctypes.c_void_p * len(dst))(*dst)
            self._lib.ec_encode_data_update(
                length, self.k, self.m, index, self._encode_tables.ctypes.data, src, dst_p
            )

    def decode(
        self, available: Mapping[int, Buffer], wanted: Iterable[int] | None = None
    ) -> dict[int, U8Array]:
        """Rebuild chunks from any k of ``available`` (index -> chunk).

        ``wanted`` defaults to the data indexes missing from ``available``; any index, data or
        parity, may be wanted. Returns new arrays. Raises :class:`TooFewChunksError` with fewer than
        k chunks, :class:`InvalidParamsError` for an index outside 0..k+m-1.
        """
        if wanted is None:
            wanted = [i for i in range(self.k) if i not in available]
        wanted_list = sorted(set(wanted))
        length = self._check_len(list(available.values()), None, "available")
        out = {i: np.empty(length, dtype=np.uint8) for i in wanted_list}
        self.decode_into(available, out)
        return out

    def decode_into(self, available: Mapping[int, Buffer], out: Mapping[int, Buffer]) -> None:
        """Rebuild the chunks keyed in ``out`` into its buffers from any k of ``available``.

        Uses the k lowest available indexes (data first: fewer multiplications). ``out`` buffers are
        overwritten and must not overlap ``available``. Decode tables are cached per pattern.
        """
        n = self.k + self.m
        for i in list(available) + list(out):
            if not isinstance(i, (int, np.integer)) or not 0 <= i < n:
                raise InvalidParamsError(f"chunk index {i!r} outside 0..{n - 1}")
        if len(available) < self.k:
            raise TooFewChunksError(len(available), self.k)
        if not out:
            return
        chosen = tuple(sorted(int(i) for i in available)[: self.k])
        wanted = tuple(sorted(int(i) for i in out))
        ordered = sorted(int(i) for i in available)
        addrs, length = _pointers([available[i] for i in ordered], False, "available")
        src = addrs[: self.k]  # chosen: the k lowest indexes
        dst, olength = _pointers([out[i] for i in wanted], True, "out")
        if olength != length:
            raise ChunkSizeMismatchError(f"out chunks are {olength} bytes, available are {length}")
        if self.k == 1:
            self._copy(available[ordered[0]], [out[i] for i in wanted])
            return
        self._run(self._decode_tables(chosen, wanted), src, dst, length)

    def repair_row(self, sources: Sequence[int], target: int) -> U8Array:
        """The k coefficients that rebuild chunk ``target`` from the chunks ``sources``.

        ``target = XOR over i of coeff[i] * chunk[sources[i]]`` in GF(2^8): the row a repair
        spread over the helpers uses (each helper scales its own chunk; see :meth:`scale_add`).
        Raises :class:`InvalidParamsError` unless ``sources`` are k distinct indexes without
        ``target``.
        """
        n = self.k + self.m
        chosen = tuple(int(i) for i in sources)
        if len(set(chosen)) != self.k or target in chosen or not 0 <= target < n:
            raise InvalidParamsError(
                f"a repair row needs k={self.k} distinct sources without the target, got "
                f"sources {list(chosen)} for target {target}"
            )
        if any(not 0 <= i < n for i in chosen):
            raise InvalidParamsError(f"chunk index outside 0..{n - 1} in {list(chosen)}")
        order = sorted(range(self.k), key=lambda i: chosen[i])
        row = self._decode_rows(tuple(sorted(chosen)), (int(target),))[0]
        out = np.empty(self.k, dtype=np.uint8)
        out[order] = row  # back in the order the sources were given
        return out

    def scale_add(self, coeff: int, src: Buffer, out: Buffer, acc: Buffer | None = None) -> None:
        """``out = coeff * src`` (GF(2^8)), XOR ``acc`` when given: one pass, no copies.

        A helper of a spread repair adds its scaled chunk to the partial sum it received and
        sends the result on. ``out`` must not overlap ``src`` or ``acc``; all the same length.
        """
        if not 0 <= int(coeff) <= 255:
            raise InvalidParamsError(f"a GF(2^8) coefficient is 0..255, got {coeff}")
        srcs = [src] if acc is None else [src, acc]
        addrs, length = _pointers(srcs, False, "src")
        (dst,), olength = _pointers([out], True, "out")
        if olength != length:
            raise ChunkSizeMismatchError(f"out is {olength} bytes, src is {length}")
        key = (int(coeff), acc is not None)
        tables = self._scale_tables.get(key)
        if tables is None:
            rows = np.array([coeff, 1][: len(srcs)], dtype=np.uint8)
            tables = np.zeros(32 * len(srcs), dtype=np.uint8)
            self._lib.ec_init_tables(len(srcs), 1, _u8ptr(rows), _u8ptr(tables))
            with self._lock:
                self._scale_tables[key] = tables
        if length:
            src_p = (ctypes.c_void_p * len(addrs))(*addrs)
            dst_p = (ctypes.c_void_p * 1)(dst)
            self._lib.ec_encode_data(length, len(srcs), 1, tables.ctypes.data, src_p, dst_p)

    def close(self) -> None:
        """Stop the thread pool (if any); the codec stays usable and restarts it on demand."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- internals -----------------------------------------------------------------------------

    def _check_len(self, bufs: Sequence[Buffer], count: int | None, what: str) -> int:
        if count is not None and len(bufs) != count:
            raise ChunkSizeMismatchError(f"expected {count} {what} chunks, got {len(bufs)}")
        return _pointers(bufs, False, what)[1]

    @staticmethod
    def _copy(src: Buffer, dst: Sequence[Buffer]) -> None:
        """RS(1, m): every chunk is the data chunk; copy it (numpy's memcpy drops the GIL)."""
        s = as_u8(src, what="data")
        for i, d in enumerate(dst):
            np.copyto(as_u8(d, writable=True, what=f"chunk {i}"), s)

    def _tables(self, rows: U8Array, nrows: int) -> U8Array:
        tables = np.zeros(32 * self.k * nrows, dtype=np.uint8)
        self._lib.ec_init_tables(self.k, nrows, _u8ptr(np.ascontiguousarray(rows)), _u8ptr(tables))
        return tables

    def _decode_tables(self, chosen: tuple[int, ...], wanted: tuple[int, ...]) -> U8Array:
        key = (chosen, wanted)
        tables = self._decode_cache.get(key)
        if tables is not None:
            return tables
        rows = self._decode_rows(chosen, wanted)
        tables = self._tables(rows.reshape(-1), len(wanted))
        with self._lock:
            self._decode_cache[key] = tables
        return tables

    def _decode_rows(self, chosen: tuple[int, ...], wanted: tuple[int, ...]) -> U8Array:
        """The rows (one per wanted index, k columns) that map the chosen chunks to the wanted."""
        k = self.k
        if k == 1:
            return np.ones((len(wanted), 1), dtype=np.uint8)  # every chunk is a copy
        full = self._matrix.reshape(self.k + self.m, k)
        square = np.ascontiguousarray(full[list(chosen)])
        inverse = np.zeros(k * k, dtype=np.uint8)
        if self._lib.gf_invert_matrix(_u8ptr(square.reshape(-1).copy()), _u8ptr(inverse), k):
            raise CodecError(f"decode matrix for chunks {chosen} is singular (not Cauchy?)")
        inv = inverse.reshape(k, k)
        rows = np.zeros((len(wanted), k), dtype=np.uint8)
        mul = self._lib.gf_mul
        for r, index in enumerate(wanted):
            if index < k:
                rows[r] = inv[index]
            else:
                coeffs = full[index]
                for col in range(k):
                    acc = 0
                    for j in range(k):
                        acc ^= mul(int(coeffs[j]), int(inv[j, col]))
                    rows[r, col] = acc
        return rows

    def _plan(self, src: tuple[int, ...], dst: tuple[int, ...], length: int) -> _Plan:
        key = (src, dst, length)
        plan = self._plans.get(key)
        if plan is None:
            plan = _Plan(src, dst, length, self.threads)
            with self._lock:
                if len(self._plans) >= _PTR_CACHE_MAX:
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def _run(
        self, tables: U8Array, src: tuple[int, ...], dst: tuple[int, ...], length: int
    ) -> None:
        if length == 0:
            return
        pieces = self._plan(src, dst, length).pieces
        tptr = tables.ctypes.data
        encode = self._lib.ec_encode_data
        k, rows = len(src), len(dst)
        if len(pieces) == 1:
            size, s, d = pieces[0]
            encode(size, k, rows, tptr, s, d)
            return
        pool = self._ensure_pool()
        futures: list[Future[None]] = [
            pool.submit(self._helper, encode, size, k, rows, tptr, s, d)
            for size, s, d in pieces[1:]
        ]
        size, s, d = pieces[0]
        encode(size, k, rows, tptr, s, d)
        for f in futures:
            f.result()

    def _helper(self, fn: Any, *args: Any) -> None:
        """One piece on a helper thread, its CPU time counted (see :meth:`helper_seconds`)."""
        t0 = time.thread_time()
        fn(*args)
        spent = time.thread_time() - t0
        with self._lock:
            self._helper_cpu += spent

    def helper_seconds(self) -> float:
        """CPU seconds the helper threads of ``threads > 1`` have spent so far, for a caller that
        counts CPU by thread (their time is not the calling thread's)."""
        with self._lock:
            return self._helper_cpu

    def _ensure_pool(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        max_workers=self.threads - 1, thread_name_prefix="ecsnap-rs"
                    )
                pool = self._pool
        return pool


def _u8ptr(arr: U8Array) -> Any:
    return arr.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
