"""``ecsnap bench codec``: RS encode/decode throughput against raw ISA-L, pyeclib and numpy.

Throughput is GB/s (1e9 bytes/s) of data bytes in: k x chunk_bytes per call, for encode and for
decode (which rebuilds the first m data chunks from the rest, the most work a decode does). All
implementations of one shape are timed round-robin in the same run, and the ratios are computed
from medians of that run only.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from typing import Any

import numpy as np

from bench._common import Recorder, interleaved, size_label, summarize, table
from codec import RSCodec
from codec import reference as ref
from codec._isal import library

SHAPES = [(4, 2), (8, 2), (8, 3), (12, 4)]
CHUNKS = [64 << 10, 1 << 20, 16 << 20]
UNIT = "GB/s of data bytes in"


def _raw_encode(rs: RSCodec, data: list[Any], parity: list[Any]) -> Any:
    """One ctypes call on prebuilt pointer arrays and prebuilt tables: ISA-L with nothing around."""
    lib = library()
    src = (ctypes.c_void_p * rs.k)(*[a.ctypes.data for a in data])
    dst = (ctypes.c_void_p * rs.m)(*[a.ctypes.data for a in parity])
    tables = rs._encode_tables.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
    length, k, m, fn = data[0].nbytes, rs.k, rs.m, lib.ec_encode_data
    return lambda: fn(length, k, m, tables, src, dst)


def _pyeclib(k: int, m: int, payload: bytes) -> tuple[Any, Any] | None:
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError:
        return None
    driver = ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy")
    fragments = driver.encode(payload)
    survivors = fragments[m:]  # lose the first m data fragments

    def encode() -> None:
        driver.encode(payload)

    def decode() -> None:
        driver.reconstruct(survivors, list(range(m)))

    return encode, decode


def _measure(
    k: int,
    m: int,
    chunk: int,
    rng: np.random.Generator,
    repeats: int,
    warmup: int,
    quick: bool,
    reference: bool,
) -> dict[tuple[str, str, int], list[float]]:
    """Time every implementation of one shape in one interleaved run."""
    data = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(k)]
    parity = [np.empty(chunk, dtype=np.uint8) for _ in range(m)]
    out = {i: np.empty(chunk, dtype=np.uint8) for i in range(m)}
    codecs = {t: RSCodec(k, m, threads=t) for t in (1, 2)}
    chunks_all = data + codecs[1].encode(data)
    survivors = {i: chunks_all[i] for i in range(m, k + m)}  # the first m data chunks are lost
    fns: dict[tuple[str, str, int], Any] = {}
    for t, rs in codecs.items():
        fns[("ecsnap", "encode", t)] = lambda rs=rs: rs.encode_into(data, parity)
        fns[("ecsnap", "decode", t)] = lambda rs=rs: rs.decode_into(survivors, out)
    fns[("isal_raw", "encode", 1)] = _raw_encode(codecs[1], data, parity)
    py = _pyeclib(k, m, b"".join(d.tobytes() for d in data))
    if py is not None:
        fns[("pyeclib", "encode", 1)], fns[("pyeclib", "decode", 1)] = py
    samples = interleaved(fns, repeats, warmup, min_time=0.01 if quick else 0.03)
    if reference:
        ref_fns = {
            ("reference", "encode", 1): lambda: ref.encode(k, m, data),
            ("reference", "decode", 1): lambda: ref.decode(k, m, survivors, range(m)),
        }
        samples.update(interleaved(ref_fns, max(3, repeats // 5), 1))
    for rs in codecs.values():
        rs.close()
    return samples


def run(quick: bool = False, repeats: int | None = None) -> list[dict[str, Any]]:
    repeats = repeats or (5 if quick else 15)
    warmup = 1 if quick else 3
    rec = Recorder("codec", {"quick": quick, "repeats": repeats, "warmup": warmup})
    rng = np.random.default_rng(0)
    rows: list[tuple[Any, ...]] = []
    for chunk in CHUNKS:
        for k, m in SHAPES:
            reference = chunk <= (64 << 10) or (not quick and chunk <= (1 << 20))
            samples = _measure(k, m, chunk, rng, repeats, warmup, quick, reference)
            for (impl, op, t), s in samples.items():
                stats = summarize(s)
                gbps = k * chunk / stats["median_s"] / 1e9
                rec.add(
                    kind="throughput",
                    impl=impl,
                    op=op,
                    k=k,
                    m=m,
                    chunk_bytes=chunk,
                    shape=f"{k}x{m}x{size_label(chunk)}",
                    threads=t,
                    gbps=gbps,
                    unit=UNIT,
                    samples=len(s),
                    **stats,
                )
                rows.append((f"{k}x{m}x{size_label(chunk)}", op, impl, t, gbps))
    _ratios(rec)
    path = rec.write()
    print(table(rows, ["shape", "op", "impl", "threads", UNIT]))
    print()
    print(
        table(
            [
                (r["name"], r["value"], r["target"], "yes" if r["met"] else "NO")
                for r in rec.records
                if r["kind"] == "ratio"
            ],
            ["ratio (medians, this run)", "value", "target", "met"],
        )
    )
    print(f"\nwrote {len(rec.records)} records to {path}")
    return rec.records


def _ratios(rec: Recorder) -> None:
    tp = {
        (r["impl"], r["op"], r["k"], r["m"], r["chunk_bytes"], r["threads"]): r["gbps"]
        for r in rec.records
        if r["kind"] == "throughput"
    }
    big = [c for c in CHUNKS if c >= (1 << 20)]
    vs_raw = [
        tp[("ecsnap", "encode", k, m, c, 1)] / tp[("isal_raw", "encode", k, m, c, 1)]
        for k, m in SHAPES
        for c in big
    ]
    top = CHUNKS[-1]
    scale = [
        tp[("ecsnap", "encode", k, m, top, 2)] / tp[("ecsnap", "encode", k, m, top, 1)]
        for k, m in SHAPES
    ]
    vs_py = [
        tp[("ecsnap", op, k, m, c, 1)] / tp[("pyeclib", op, k, m, c, 1)]
        for op in ("encode", "decode")
        for k, m in SHAPES
        for c in CHUNKS
        if ("pyeclib", op, k, m, c, 1) in tp
    ]
    for name, values, target in (
        ("encode_into / raw ISA-L, 1 thread, chunks >= 1 MiB", vs_raw, 0.90),
        ("2 threads / 1 thread encode, 16 MiB chunks", scale, 1.7),
        ("ecsnap / pyeclib API, 1 thread", vs_py, 5.0),
    ):
        if values:
            med = statistics.median(values)
            rec.add(
                kind="ratio",
                name=name,
                value=med,
                min=min(values),
                max=max(values),
                target=target,
                met=med >= target,
                unit="ratio of medians",
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ecsnap bench codec", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI, a first look)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    run(quick=args.quick, repeats=args.repeats)
    return 0
