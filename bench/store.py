"""``ecsnap bench store``: snapshot a training state through ecsnap and through the alternatives.

One run starts 4 virtual hosts under ``mpiexec`` and one trainer process per host, each holding a
quarter of the state (fp32 and bf16 tensors, about 50 per rank). Each repeat, interleaved so that
machine drift hits every contender alike:

- ecsnap ``put``: all ranks at once; put->staged (what the training loop waits for) and
  put->protected (parity stored on peers), the slowest rank counted;
- the floor: the same state copied with 2 threads into pre-faulted shared memory;
- ``torch.save`` to /dev/shm and to disk (with fsync), and ``torch.load`` back: from /dev/shm in
  a fresh process (what a restarted trainer pays, the baseline of the get targets), in this
  process (whose heap may hand freed pages back without faults: from 0.26 s to 2.7 s for 1.5 GB
  across runs here, so not what a restart sees), and in HOSTS fresh processes at once, one shard
  each;
- DCP ``async_save`` with a FileSystemWriter to /dev/shm: its blocking time and its time until
  written; DCP ``save`` and ``load`` with FileSystemWriter/Reader on /dev/shm;
- ecsnap local ``get`` (every page touched), the slowest rank counted: in the running trainers,
  and in a fresh process per rank that connects and gets (a trainer restarted after a crash).

Then the CPU block: as many puts again, a training step (``GAP``) apart, the copy floor measured
between them, nothing else run: the daemons' and trainers' CPU seconds per protected GB by phase
(``ecsnap_cpu_seconds_total``), against the floor (that copy, one encode pass, one send and one
receive of the bytes each host moves). The puts between the contenders are counted too, apart
(``between contenders``): here whatever runs right after a contender that wrote or loaded the
state pays more per byte (a copy floor run there: 0.182-0.207 CPU s per GB against about 0.165
after a put; a put's staging 0.21-0.31 against 0.17 with nothing between puts), and a put
always comes right after one, while the copy floor comes right after a put.

Then host loss, 1-3 times: the storage job is killed, one host's memory wiped, the job relaunched.
The replacement rebuilds the newest step from its group before the daemons serve (timed by the
daemon), then every rank reads it back (checked bit-exact); older steps are rebuilt after, and the
run waits for health "healthy" to time the rebuild of all of them.

Then the daemons' byte counters: parity held and bytes sent per host against the host's blob.

Then the replication baseline (``--replicas R``, default 2; the scheme of Gemini and NVIDIA's local
checkpointing): the same daemons relaunched as RS(1, R-1), which keeps R-1 byte copies of every
chunk on the other hosts of its group (no encoding; see ``codec.rs``), through the same puts, gets
and host losses, with the same contenders timed again in that phase (named
``..._replication_phase``) so that both phases carry the same load and drift between them shows in
the floor.
Memory, network bytes and times are reported as replication / RS. The phases run one after the
other, not side by side, so that both daemon sets never hold memory at once.
Results: JSON lines in ``bench/results/store.jsonl`` with medians and spreads, ratios of medians.

``--root DIR`` puts the run (the daemons' shared memory, the contenders' "/dev/shm" files, the copy
floor's buffer) under DIR instead of /dev/shm: a tmpfs mounted with ``huge=within_size``, say (the
README's "Huge pages for shared memory"). The records carry the directory and its tmpfs's
``huge`` option.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import baselines
from bench._common import (
    Recorder,
    add_put_cpu,
    add_root_option,
    exit_on_sigterm,
    record_cpu,
    run_dir,
    table,
)
from bench._ranks import Workers, run_fresh
from bench.harness import Cluster, make_state, nbytes_of
from storage.config import CHUNK_BYTES as CHUNK

HOSTS = 4
GAP = 1.0  # seconds between the CPU block's puts and copy floors (a training step)


def _daemons(job: str, root: Path, k: int, m: int, chunk: int) -> Cluster:
    return Cluster(
        root,
        hosts=HOSTS,
        k=k,
        m=m,
        job=job,
        extra=["--chunk-bytes", str(chunk)],
        peer_timeout=120.0,
        log=root / "daemons.log",
    )


def _put(workers: Workers, step: int, cpu: dict[str, list[float]] | None) -> list[dict[str, Any]]:
    """Every rank puts ``step``; returns their timings. With ``cpu``, the put's CPU seconds per
    protected GB go there by phase (the daemons' counters read before and after)."""
    before = workers.all({"op": "info"}) if cpu is not None else []
    puts = workers.all({"op": "put", "step": step})
    if cpu is not None:
        after = workers.all({"op": "info"})
        add_put_cpu(cpu, before, after, puts, sum(w["nbytes"] for w in workers.ready))
    return puts


def _phase(
    label: str,
    job: str,
    root: Path,
    k: int,
    m: int,
    chunk: int,
    size: tuple[int, int],
    rounds: tuple[int, int, int],
    in_process: Callable[[int], dict[str, float]],
    cpu: dict[str, list[float]],
    between: dict[str, list[float]],
    floor_copy: Callable[[], None],
) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Puts, local gets and host losses through one set of RS(k, m) daemons.

    ``size`` is (state bytes, tensors), ``rounds`` (warm-up puts, measured puts, host losses).
    Each put round also runs ``in_process(round)`` (the contenders timed in this process), so
    drift hits them alike. Samples are named ``<label>_...``; returns them and each host's info.
    Each measured put's CPU seconds per protected GB go to ``between`` by phase
    (``add_put_cpu``); then as many puts follow, ``GAP`` seconds apart with nothing else run
    between them but ``floor_copy()`` (the copy floor, measured there), whose CPU goes to
    ``cpu`` (see the module docstring).
    """
    nbytes, ntensors = size
    warmup, repeats, losses = rounds
    samples: dict[str, list[float]] = {}
    daemons = _daemons(job, root, k, m, chunk)
    workers = None
    try:
        workers = Workers(job, root, nbytes, ntensors, HOSTS)
        for r in range(warmup + repeats):
            step = r + 1
            puts = _put(workers, step, between if r >= warmup else None)
            got = workers.all({"op": "get", "step": step, "verify": r == 0})
            restarted = run_fresh(
                [{**spec, "op": "get", "step": step, "verify": r == 0} for spec in workers.specs]
            )
            if r == 0 and not all(g.get("exact") for g in got + restarted):
                raise AssertionError(f"{label} get returned different bytes than were put")
            measured = {
                f"{label}_put_return": max(p["return"] for p in puts),
                f"{label}_put_staged": max(p["staged"] for p in puts),
                f"{label}_put_protected": max(p["protected"] for p in puts),
                f"{label}_get_local": max(g["get_touched"] for g in got),
                f"{label}_get_restarted_trainer": max(g["get_touched"] for g in restarted),
                **in_process(r),
            }
            if r >= warmup:
                for name, value in measured.items():
                    samples.setdefault(name, []).append(value)
            print(
                f"RS({k},{m}) repeat {r + 1}/{warmup + repeats}: "
                + ", ".join(f"{n}={v:.3f}s" for n, v in measured.items()),
                file=sys.stderr,
            )
        # CPU per protected GB: puts a training step apart, the copy floor between them
        last = warmup + repeats
        for _ in range(repeats):
            floor_copy()
            time.sleep(GAP)
            last += 1
            _put(workers, last, cpu)
            time.sleep(GAP)
        infos = workers.all({"op": "info"})
        # host loss: the storage job dies, one host's memory is wiped, the job is relaunched and
        # rebuilds that host from its group at start-up; then every rank reads the last step
        for i in range(losses):
            lost = 1 + i % (HOSTS - 1)
            daemons.kill()
            shutil.rmtree(root / job / f"host{lost}")
            t0 = time.perf_counter()
            daemons = _daemons(job, root, k, m, chunk)
            t_relaunch = time.perf_counter() - t0
            got = workers.all({"op": "get", "step": last, "verify": True})
            if not all(g.get("exact") for g in got):
                raise AssertionError(f"{label} get after a rebuild returned different bytes")
            # the newest step is rebuilt before the daemons serve; older ones after: wait for all
            deadline = time.monotonic() + 300
            while (after := workers.all({"op": "info"}))[lost]["health"] != "healthy":
                if time.monotonic() > deadline:
                    raise AssertionError(f"host{lost} did not become healthy: {after[lost]}")
                time.sleep(0.05)
            first = after[lost]["stats"]["startup_rebuild_seconds"]
            rebuild = after[lost]["stats"]["rebuild_seconds"]
            get_lost = got[lost]["get_touched"]
            for name, value in (
                ("relaunch_with_rebuild", t_relaunch),
                ("rebuild_newest_step_one_host", first),
                ("rebuild_all_steps_one_host", rebuild),
                ("get_lost_host", get_lost),
                ("rebuild_newest_plus_get_lost_host", first + get_lost),
            ):
                samples.setdefault(f"{label}_{name}", []).append(value)
            print(
                f"RS({k},{m}) host{lost} lost: relaunch {t_relaunch:.2f}s (newest step rebuilt "
                f"in {first:.3f}s, all in {rebuild:.3f}s), its rank's get {get_lost:.3f}s",
                file=sys.stderr,
            )
    finally:
        if workers is not None:
            workers.close()
        daemons.stop()
        if os.environ.get("ECSNAP_TRACE"):
            print((root / "daemons.log").read_text(), file=sys.stderr)
        shutil.rmtree(root / job, ignore_errors=True)  # its memory, before the next phase
    return samples, infos


def _cpu_floor(
    data: Any, k: int, m: int, chunk: int, repeats: int
) -> Callable[[int, int, list[float]], dict[str, float]]:
    """The CPU floor of protecting a GB, by part, for a scheme RS(k, m): one copy of the state
    (the copy floor's CPU per GB, measured where the puts it is held against were: given to the
    returned function), one encode pass (none for copies, k = 1) and one send and one receive
    of the bytes each host must move (:mod:`bench.transfer_floor`, measured here), all medians
    of this run."""
    from bench import transfer_floor

    gb = data.nbytes / 1e9
    encode = statistics.median(
        baselines.floor_encode_cpu(data, k, m, chunk) / gb for _ in range(max(3, repeats // 2))
    )
    swap_bytes = min(256 << 20, data.nbytes)
    swaps = transfer_floor.measure(swap_bytes, piece=chunk, repeats=max(3, repeats))
    per_byte = statistics.median(s["cpu"] for s in swaps) / (2 * swap_bytes)  # sent + received

    def floor(k_: int, m_: int, copy_cpu: list[float]) -> dict[str, float]:
        if k_ > 1 and (k_, m_) != (k, m):
            raise ValueError(f"the encode floor was measured for RS({k},{m}), not RS({k_},{m_})")
        moved = (1 + (m_ - 1) / k_) if k_ > 1 else m_  # bytes each host sends (and receives)
        parts = {
            "copy": statistics.median(copy_cpu),
            "encode": encode if k_ > 1 else 0.0,  # copies are not encoded
            "send + receive": per_byte * moved * 1e9,
        }
        parts["total"] = sum(parts.values())
        return parts

    return floor


def _bytes(
    rec: Recorder, scheme: str, k: int, m: int, infos: list[dict[str, Any]], puts: int
) -> list[tuple[Any, ...]]:
    """Per host: parity held and bytes sent per step against its blob (and the m/k targets)."""
    rows = []
    for info in infos:
        held = len(info["protected"])
        blob = info["data_bytes"] / held
        parity_ratio = info["parity_bytes"] / held / blob
        net_ratio = info["sent_bytes"] / puts / blob
        rec.add(
            kind="bytes",
            scheme=scheme,
            host=info["host"],
            blob_bytes=blob,
            parity_bytes_per_step=info["parity_bytes"] / held,
            sent_bytes_per_step=info["sent_bytes"] / puts,
            parity_over_blob=parity_ratio,
            sent_over_blob=net_ratio,
            parity_target=m / k,
            sent_target=1 + (m - 1) / k,
            unit="bytes",
        )
        rows.append((scheme, info["host"], blob, parity_ratio, m / k, net_ratio, 1 + (m - 1) / k))
    return rows


def run(
    quick: bool = False,
    k: int = 3,
    m: int = 1,
    nbytes: int | None = None,
    repeats: int | None = None,
    chunk: int = CHUNK,
    replicas: int = 2,
    under: Path | None = None,
) -> list[dict[str, Any]]:
    from transport import shm

    nbytes = nbytes or ((256 << 20) if quick else 1_500_000_000)
    ntensors = 200
    repeats = repeats or (3 if quick else 7)
    warmup = 3  # keep + 1 puts: from then on every put reuses pre-faulted buffers (steady state)
    losses = 1 if quick else 3
    root, huge = run_dir(under, "ecsnap-bench")
    rec = Recorder(
        "store",
        {
            "quick": quick,
            "k": k,
            "m": m,
            "replicas": replicas,
            "hosts": HOSTS,
            "ranks": HOSTS,
            "state_bytes": nbytes,
            "tensors": ntensors,
            "repeats": repeats,
            "chunk_bytes": chunk,
            "root": str(root.parent),
            "huge_pages": huge,
        },
    )
    state = make_state(99, 0, nbytes=nbytes, tensors=ntensors)
    actual = nbytes_of(state)
    pool = ThreadPoolExecutor(2)
    from storage.state import flatten

    floor_buf = shm.create(root / "floor.buf", flatten(state)[2])  # leaves 64-byte aligned
    then = f", then {replicas}-way replication (RS(1,{replicas - 1}))" if replicas > 1 else ""
    print(
        f"state: {actual / 1e9:.2f} GB in {len(state)} tensors, {HOSTS} hosts, RS({k},{m}){then}; "
        f"under {root.parent} (huge pages: {huge or 'not a tmpfs'})",
        file=sys.stderr,
    )

    floor_copy_cpu: list[float] = []  # CPU s per GB of the copy floor, between the contenders
    quiet_copy_cpu: list[float] = []  # ... and between the CPU block's puts

    def copy_floor(cpu_per_gb: list[float]) -> float:
        """The copy floor once: its CPU seconds per GB go to ``cpu_per_gb``; returns seconds."""
        seconds, copy_cpu = baselines.floor_copy(state, floor_buf, pool)
        cpu_per_gb.append(copy_cpu / (actual / 1e9))
        return seconds

    def quiet_copy() -> None:
        copy_floor(quiet_copy_cpu)

    def alternatives(r: int) -> dict[str, float]:
        out = {"floor_copy_2threads": copy_floor(floor_copy_cpu)}
        out.update(baselines.torch_save_load(state, root, HOSTS))
        out["torch_save_disk"], out["torch_load_disk"] = baselines.torch_disk(state)
        out["dcp_async_save_blocking"], out["dcp_async_save_done"] = baselines.dcp_async(
            state, root / f"dcp-async-{r}"
        )
        out["dcp_save_shm"], out["dcp_load_shm"] = baselines.dcp_save_load(state, root / f"dcp-{r}")
        return out

    def alternatives_again(r: int) -> dict[str, float]:
        # the same load in both phases, so that their times compare; kept apart by name
        return {f"{n}_replication_phase": v for n, v in alternatives(r + 1000).items()}

    cpu: dict[str, list[float]] = {}  # CPU s per protected GB by phase: the CPU block's puts
    repl_cpu: dict[str, list[float]] = {}
    between: dict[str, list[float]] = {}  # ... and the puts between the contenders
    repl_between: dict[str, list[float]] = {}
    try:
        rounds = (warmup, repeats, losses)
        samples, infos = _phase(
            "ecsnap",
            "bench",
            root,
            k,
            m,
            chunk,
            (nbytes, ntensors),
            rounds,
            alternatives,
            cpu,
            between,
            quiet_copy,
        )
        if replicas > 1:
            more, repl_infos = _phase(
                "replication",
                "bench-repl",
                root,
                1,
                replicas - 1,
                chunk,
                (nbytes, ntensors),
                rounds,
                alternatives_again,
                repl_cpu,
                repl_between,
                quiet_copy,
            )
            samples.update(more)
        floor = _cpu_floor(floor_buf.array[:actual], k, m, chunk, repeats)
    finally:
        floor_buf.close()
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    rows, med = rec.times(samples, state_bytes=actual)
    puts = warmup + 2 * repeats  # the CPU block's too
    bytes_rows = _bytes(rec, f"RS({k},{m})", k, m, infos, puts)
    if replicas > 1:
        bytes_rows += _bytes(rec, f"{replicas}-way", 1, replicas - 1, repl_infos, puts)
    rs_rows = [r for r in bytes_rows if r[0] == f"RS({k},{m})"]
    ratios = [
        (
            "put blocking / DCP async_save blocking",
            med["ecsnap_put_staged"] / med["dcp_async_save_blocking"],
            "<= 0.5",
        ),
        (
            "put blocking / 2-thread copy floor",
            med["ecsnap_put_staged"] / med["floor_copy_2threads"],
            "<= 1.3",
        ),
        (
            "DCP async_save until written / put->protected",
            med["dcp_async_save_done"] / med["ecsnap_put_protected"],
            ">= 4.0",
        ),
        (
            "torch.save /dev/shm / put->protected",
            med["torch_save_shm"] / med["ecsnap_put_protected"],
            ">= 2.0",
        ),
        (
            "torch.load /dev/shm, fresh process / get in a restarted trainer",
            med["torch_load_shm"] / med["ecsnap_get_restarted_trainer"],
            ">= 8.0",
        ),
        (
            "torch.load /dev/shm, one fresh process per shard / get in a restarted trainer",
            med["torch_load_shm_sharded"] / med["ecsnap_get_restarted_trainer"],
            None,
        ),
        (
            "torch.load /dev/shm, warm heap / get in a running trainer",
            med["torch_load_shm_warm_heap"] / med["ecsnap_get_local"],
            None,
        ),
        (
            "torch.load /dev/shm, fresh process / get of a lost host's shard "
            "(rebuild of the newest step + get)",
            med["torch_load_shm"] / med["ecsnap_rebuild_newest_plus_get_lost_host"],
            ">= 2.0",
        ),
        (
            "parity bytes per host / (m/k x blob), worst host",
            max(r[3] / r[4] for r in rs_rows),
            "<= 1.01",
        ),
        (
            "bytes sent per host / ((1+(m-1)/k) x blob), worst host",
            max(r[5] / r[6] for r in rs_rows),
            "<= 1.01",
        ),
    ]
    rs_floor = floor(k, m, quiet_copy_cpu)
    cpu_rows = record_cpu(rec, f"RS({k},{m})", cpu, rs_floor)
    rs_between = floor(k, m, floor_copy_cpu)
    cpu_rows += record_cpu(rec, f"RS({k},{m}) between contenders", between, rs_between)
    ratios += [
        (
            "daemon + trainer CPU per protected GB / floor (one copy, one encode, one send and "
            "one receive)",
            statistics.median(cpu["total"]) / rs_floor["total"],
            "<= 1.5",
        ),
        (
            "puts between the contenders: daemon + trainer CPU per protected GB / floor",
            statistics.median(between["total"]) / rs_between["total"],
            None,
        ),
    ]
    if replicas > 1:
        repl_floor = floor(1, replicas - 1, quiet_copy_cpu)
        cpu_rows += record_cpu(rec, f"{replicas}-way", repl_cpu, repl_floor)
        cpu_rows += record_cpu(
            rec,
            f"{replicas}-way between contenders",
            repl_between,
            floor(1, replicas - 1, floor_copy_cpu),
        )
        ratios.append(
            (
                f"{replicas}-way: daemon + trainer CPU per protected GB / floor",
                statistics.median(repl_cpu["total"]) / repl_floor["total"],
                None,
            )
        )
    ratio_rows = rec.ratios(ratios)
    if replicas > 1:
        _compare(rec, med, f"RS({k},{m})", f"{replicas}-way")
    path = rec.write()
    print(table(rows, ["contender", "median s", "p10 s", "p90 s"]))
    print()
    print(
        table(
            bytes_rows,
            ["scheme", "host", "blob bytes", "parity/blob", "target", "sent/blob", "target"],
        )
    )
    print()
    print(table(cpu_rows, ["scheme", "CPU phase", "s per protected GB", "p10", "p90", "floor"]))
    print()
    print(table(ratio_rows, ["ratio (this run)", "value", "target", "met"]))
    if replicas > 1:
        print()
        print(
            table(
                [(r["name"], r["value"]) for r in rec.records if r["kind"] == "compare"],
                ["replication / RS (this run)", "value"],
            )
        )
    print(f"\nwrote {len(rec.records)} records to {path}")
    return rec.records


def _compare(rec: Recorder, med: dict[str, float], rs_scheme: str, repl_scheme: str) -> None:
    """Replication against RS: memory and network per step summed over hosts (from the ``bytes``
    records of the two schemes), and the times."""

    def total(scheme: str, *keys: str) -> float:
        return float(
            sum(
                r[key]
                for r in rec.records
                if r["kind"] == "bytes" and r["scheme"] == scheme
                for key in keys
            )
        )

    held = ("blob_bytes", "parity_bytes_per_step")
    pairs = [
        (
            "memory held per step (data + redundancy)",
            total(repl_scheme, *held),
            total(rs_scheme, *held),
        ),
        (
            "network bytes sent per step",
            total(repl_scheme, "sent_bytes_per_step"),
            total(rs_scheme, "sent_bytes_per_step"),
        ),
    ]
    for what in (
        "put_staged",
        "put_protected",
        "get_local",
        "get_restarted_trainer",
        "rebuild_newest_step_one_host",
        "rebuild_all_steps_one_host",
        "get_lost_host",
    ):
        pairs.append((what, med[f"replication_{what}"], med[f"ecsnap_{what}"]))
    pairs.append(
        (
            "2-thread copy floor (drift between the two phases)",
            med["floor_copy_2threads_replication_phase"],
            med["floor_copy_2threads"],
        )
    )
    for name, repl, rs in pairs:
        rec.add(
            kind="compare",
            name=f"replication / RS: {name}",
            value=repl / rs,
            replication=repl,
            rs=rs,
            unit="ratio (bytes: sums over hosts; times: medians)",
        )


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(
        prog="ecsnap bench store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="256 MB state, 3 repeats")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--bytes", type=int, default=None, help="state size (default 1.5 GB)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--chunk-bytes", type=int, default=CHUNK, help=f"the largest chunk (default {CHUNK})"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="then the same daemons keeping this many full copies, RS(1, r-1) (1: skip)",
    )
    parser.add_argument(
        "--lab",
        action="store_true",
        help="over 4 lab hosts (network namespaces, root only): RS(3,1), RS(2,2), 2- and 3-way "
        "replication against their network floors (see bench/lab_store.py)",
    )
    parser.add_argument(
        "--link-gbit", type=float, default=2.0, help="with --lab: each host's link rate"
    )
    parser.add_argument(
        "--schemes",
        nargs="*",
        default=None,
        help="with --lab: only these (rs31 rs22 repl2 rs31_star repl3)",
    )
    add_root_option(parser)
    args = parser.parse_args(argv)
    if args.lab:
        from bench import lab_store

        lab_store.run(
            gbit=args.link_gbit,
            nbytes=args.bytes or ((256 << 20) if args.quick else 1_500_000_000),
            repeats=args.repeats or (2 if args.quick else 5),
            losses=1 if args.quick else 2,
            only=args.schemes,
        )
        return 0
    run(
        quick=args.quick,
        k=args.k,
        m=args.m,
        nbytes=args.bytes,
        repeats=args.repeats,
        chunk=args.chunk_bytes,
        replicas=args.replicas,
        under=args.root,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
