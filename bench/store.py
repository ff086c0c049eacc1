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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import storage
from bench._common import Recorder, exit_on_sigterm, table

HOSTS = 4


def make_state(nbytes: int, ntensors: int, seed: int) -> dict[str, torch.Tensor]:
    """About ``nbytes`` of fp32 and bf16 tensors (alternating), ``ntensors`` of them."""
    g = torch.Generator().manual_seed(seed)
    per = max(nbytes // ntensors, 1024)
    state = {}
    for i in range(ntensors):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        n = per // (4 if dtype == torch.float32 else 2)
        cols = 1024
        t = torch.empty(max(n // cols, 1), cols, dtype=torch.float32).uniform_(generator=g)
        state[f"layer{i // 4}.w{i % 4}"] = t.to(dtype)
    return state


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- the trainer side (one process per rank) ------------------------------------------------------


def _connect(spec: dict[str, Any]) -> Any:
    return storage.connect(
        spec["job"],
        rank=spec["rank"],
        world_size=spec["world"],
        host=spec["host"],
        root=spec["root"],
        timeout=60,
    )


def _touch(state: dict[str, torch.Tensor]) -> None:
    """Read one byte per page: every byte of a mapped state is then mapped in."""
    for t in state.values():
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())


def worker(spec: dict[str, Any]) -> None:
    state = make_state(spec["nbytes"], spec["ntensors"], seed=spec["rank"])
    store = _connect(spec)
    print(json.dumps({"ready": True, "nbytes": _nbytes(state)}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, Any] = {}
        if cmd["op"] == "put":
            t0 = time.perf_counter()
            h = store.put(cmd["step"], state)
            t_return = time.perf_counter() - t0
            h.staged.result()
            t_staged = time.perf_counter() - t0
            h.wait()
            out = {"return": t_return, "staged": t_staged, "protected": time.perf_counter() - t0}
        elif cmd["op"] == "get":
            t0 = time.perf_counter()
            got = store.get(cmd["step"])
            t_get = time.perf_counter() - t0
            _touch(got)
            out = {"get": t_get, "get_touched": time.perf_counter() - t0}
            if cmd.get("verify"):
                out["exact"] = _equal(got, state)
            del got
        elif cmd["op"] == "info":
            out = store.info()
        elif cmd["op"] == "quit":
            break
        print(json.dumps(out), flush=True)
    store.close()


def fresh(spec: dict[str, Any]) -> None:
    """A new process, as after a crash: a restarted trainer's ``get`` or a ``torch.load``.

    It imports what it needs (this module imports torch and storage), says ready, and starts
    on the next line of stdin, so that several start together and no import is timed. ``get``
    times connect + get + touching every page, then (with ``verify``) compares with the state
    its rank put; ``load`` times torch.load.
    """
    expected = None
    if spec.get("verify"):
        expected = make_state(spec["nbytes"], spec["ntensors"], seed=spec["rank"])
    print(json.dumps({"ready": True}), flush=True)
    if not sys.stdin.readline():
        return  # the benchmark gave up before the start (another process failed)
    t0 = time.perf_counter()
    if spec["op"] == "load":
        loaded = torch.load(spec["path"], weights_only=True)
        print(json.dumps({"load": time.perf_counter() - t0}), flush=True)
        del loaded
        return
    store = _connect(spec)
    got = store.get(spec["step"])
    _touch(got)
    out: dict[str, Any] = {"get_touched": time.perf_counter() - t0}
    if expected is not None:
        out["exact"] = _equal(got, expected)
    del got
    store.close()
    print(json.dumps(out), flush=True)


def _equal(got: dict[str, Any], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items()
    )


def _spawn(role: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    """``python -m bench.store --<role> SPEC``, talking JSON lines over its stdin and stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.store", f"--{role}", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )


def _read(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"bench worker exited with {p.wait()}")
    result: dict[str, Any] = json.loads(line)
    return result


def _end(p: subprocess.Popen[str], timeout: float) -> None:
    """Close its pipes (a process still waiting for a line reads EOF) and reap it."""
    for pipe in (p.stdin, p.stdout):
        if pipe is not None:
            pipe.close()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def run_fresh(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Start one :func:`fresh` process per spec, let them all go at once, return their results."""
    procs = [_spawn("fresh", spec) for spec in specs]
    try:
        for p in procs:
            _read(p)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return [_read(p) for p in procs]
    finally:
        for p in procs:
            _end(p, 60)


class Workers:
    def __init__(self, job: str, root: Path, nbytes: int, ntensors: int) -> None:
        self.specs = [
            {
                "job": job,
                "root": str(root),
                "rank": rank,
                "world": HOSTS,
                "host": f"host{rank}",
                "nbytes": nbytes // HOSTS,
                "ntensors": max(ntensors // HOSTS, 1),
            }
            for rank in range(HOSTS)
        ]
        self.procs = [_spawn("worker", spec) for spec in self.specs]
        self.ready = [_read(p) for p in self.procs]

    def all(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return [_read(p) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
        for p in self.procs:
            _end(p, 30)


def _daemons(job: str, root: Path, k: int, m: int, chunk: int) -> subprocess.Popen[str]:
    from storage import launch

    return launch.start(
        HOSTS, job, root, root / "daemons.log", k=k, m=m, extra=["--chunk-bytes", str(chunk)]
    )


# -- the contenders in this process ----------------------------------------------------------------


def _floor(state: dict[str, torch.Tensor], buf: Any, pool: ThreadPoolExecutor) -> float:
    from storage.state import flatten, stage

    _, leaves, nbytes = flatten(state)
    t0 = time.perf_counter()
    stage(leaves, buf.array[:nbytes], pool)
    return time.perf_counter() - t0


def _torch_save_load(state: dict[str, torch.Tensor], directory: Path) -> dict[str, float]:
    """torch.save to ``directory`` and torch.load back: in this process (whose heap may or may
    not hand freed pages back without faults, see the module docstring), and in a fresh
    process, as a restarted trainer would; then the state in HOSTS shards, each loaded by its
    own fresh process at once."""
    path = directory / "state.pt"
    t0 = time.perf_counter()
    torch.save(state, path)
    out = {"torch_save_shm": time.perf_counter() - t0}
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    out["torch_load_shm_warm_heap"] = time.perf_counter() - t0
    del loaded
    out["torch_load_shm"] = run_fresh([{"op": "load", "path": str(path)}])[0]["load"]
    path.unlink()
    names = list(state)
    shards = [directory / f"shard{i}.pt" for i in range(HOSTS)]
    for i, shard in enumerate(shards):
        torch.save({n: state[n] for n in names[i::HOSTS]}, shard)
    loads = run_fresh([{"op": "load", "path": str(shard)} for shard in shards])
    out["torch_load_shm_sharded"] = max(r["load"] for r in loads)
    for shard in shards:
        shard.unlink()
    return out


def _dcp_async(state: dict[str, torch.Tensor], directory: Path) -> tuple[float, float]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        t0 = time.perf_counter()
        fut: Any = async_save(state, storage_writer=FileSystemWriter(str(directory)))
        t_block = time.perf_counter() - t0
        fut.result()
        t_done = time.perf_counter() - t0
    shutil.rmtree(directory)
    return t_block, t_done


def _dcp_save_load(state: dict[str, torch.Tensor], directory: Path) -> tuple[float, float]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    target = {k: torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        t0 = time.perf_counter()
        dcp_save(state, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp_load(target, storage_reader=FileSystemReader(str(directory)), no_dist=True)
        t_load = time.perf_counter() - t0
    shutil.rmtree(directory)
    return t_save, t_load


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
) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Puts, local gets and host losses through one set of RS(k, m) daemons.

    ``size`` is (state bytes, tensors), ``rounds`` (warm-up puts, measured puts, host losses).
    Each put round also runs ``in_process(round)`` (the contenders timed in this process), so
    drift hits them alike. Samples are named ``<label>_...``; returns them and each host's info.
    """
    nbytes, ntensors = size
    warmup, repeats, losses = rounds
    samples: dict[str, list[float]] = {}
    daemons = _daemons(job, root, k, m, chunk)
    workers = None
    try:
        workers = Workers(job, root, nbytes, ntensors)
        for r in range(warmup + repeats):
            step = r + 1
            puts = workers.all({"op": "put", "step": step})
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
        infos = workers.all({"op": "info"})
        # host loss: the storage job dies, one host's memory is wiped, the job is relaunched and
        # rebuilds that host from its group at start-up; then every rank reads the last step
        last = warmup + repeats
        for i in range(losses):
            lost = 1 + i % (HOSTS - 1)
            os.killpg(daemons.pid, 9)
            daemons.wait(30)
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
        if daemons.poll() is None:
            os.killpg(daemons.pid, 15)
        daemons.wait(30)
        if os.environ.get("ECSNAP_TRACE"):
            print((root / "daemons.log").read_text(), file=sys.stderr)
        shutil.rmtree(root / job, ignore_errors=True)  # its memory, before the next phase
    return samples, infos


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
    chunk: int = 1 << 20,
    replicas: int = 2,
) -> list[dict[str, Any]]:
    from bench.persist import _torch_disk
    from transport import shm

    nbytes = nbytes or ((256 << 20) if quick else 1_500_000_000)
    ntensors = 200
    repeats = repeats or (3 if quick else 7)
    warmup = 3  # keep + 1 puts: from then on every put reuses pre-faulted buffers (steady state)
    losses = 1 if quick else 3
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    root = base / f"ecsnap-bench-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
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
        },
    )
    state = make_state(nbytes, ntensors, seed=99)
    actual = _nbytes(state)
    pool = ThreadPoolExecutor(2)
    floor_buf = shm.create(root / "floor.buf", actual)
    then = f", then {replicas}-way replication (RS(1,{replicas - 1}))" if replicas > 1 else ""
    print(
        f"state: {actual / 1e9:.2f} GB in {len(state)} tensors, {HOSTS} hosts, RS({k},{m}){then}",
        file=sys.stderr,
    )

    def alternatives(r: int) -> dict[str, float]:
        out = {"floor_copy_2threads": _floor(state, floor_buf, pool)}
        out.update(_torch_save_load(state, root))
        out["torch_save_disk"], out["torch_load_disk"] = _torch_disk(state)
        out["dcp_async_save_blocking"], out["dcp_async_save_done"] = _dcp_async(
            state, root / f"dcp-async-{r}"
        )
        out["dcp_save_shm"], out["dcp_load_shm"] = _dcp_save_load(state, root / f"dcp-{r}")
        return out

    def alternatives_again(r: int) -> dict[str, float]:
        # the same load in both phases, so that their times compare; kept apart by name
        return {f"{n}_replication_phase": v for n, v in alternatives(r + 1000).items()}

    try:
        rounds = (warmup, repeats, losses)
        samples, infos = _phase(
            "ecsnap", "bench", root, k, m, chunk, (nbytes, ntensors), rounds, alternatives
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
            )
            samples.update(more)
    finally:
        floor_buf.close()
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    rows, med = rec.times(samples, state_bytes=actual)
    puts = warmup + repeats
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
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="then the same daemons keeping this many full copies, RS(1, r-1) (1: skip)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--fresh", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.fresh:
        fresh(json.loads(args.fresh))
        return 0
    run(
        quick=args.quick,
        k=args.k,
        m=args.m,
        nbytes=args.bytes,
        repeats=args.repeats,
        chunk=args.chunk_bytes,
        replicas=args.replicas,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
