"""``ecsnap serve``: one storage daemon per host, all of them one MPI job.

Call sequence (every daemon runs the same loop, in lock-step rounds)::

    mpiexec -n H ecsnap serve --job J [--virtual-hosts] [--k K --m M] ...

    round:  allgather the events of the last round (staged shards, prepared, stored, deletes,
            fetches), apply them in slot order to the replicated :class:`Catalog`, then act:
            prepare ready steps (parity memory, data checksums), run the erasure-coding exchange
            of steps every daemon prepared, serve fetches of shards for other hosts, write the
            manifest of newly protected steps and evict what retention drops.

Trainers talk to their host's daemon over ``<root>/<job>/<host>/ctl.sock`` (framed JSON) and write
shard bytes straight into the daemon's shared-memory buffers. The daemon's threads: the main
thread drives MPI; one thread per trainer connection answers requests.

The storage job is one failure domain: a dead peer makes the mpich job die or hang, so every wait
on a peer has a timeout after which this daemon aborts the job. State stays in the host directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from codec import RSCodec, checksum
from storage.catalog import Catalog, StepRec
from storage.config import DEFAULT_ROOT, ServeConfig, host_dir
from storage.errors import (
    CapacityError,
    ConfigError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    to_wire,
)
from storage.placement import default_km, make_groups
from transport import shm
from transport.control import Connection, Server
from transport.errors import PeerTimeoutError

__all__ = ["Daemon", "main"]

TAG_DATA, TAG_PARITY, TAG_FETCH = 11, 12, 13
MANIFEST_VERSION = 1


def _log(host: str, msg: str) -> None:
    print(f"ecsnap[{host}] {msg}", file=sys.stderr, flush=True)


@dataclass
class _Buffer:
    name: str
    file: shm.MappedFile

    @property
    def size(self) -> int:
        return self.file.size


@dataclass
class _Local:
    """What this daemon holds of one step (not replicated)."""

    buffers: dict[int, str] = field(default_factory=dict)  # rank -> buffer name (my shards)
    parity: str | None = None
    prepared: bool = False
    stored: bool = False
    manifest: bool = False
    data_crc: list[int] = field(default_factory=list)
    crc_job: Future[list[int]] | None = None
    parity_crc: list[int] = field(default_factory=list)
    t: dict[str, float] = field(default_factory=dict)  # phase -> monotonic time, for tracing


class Pool:
    """This host's shared-memory files: shard buffers and parity, reused across steps.

    ``used`` counts every file (in use or free) against ``budget``; free files are dropped before
    a request is refused. Thread-safe.
    """

    def __init__(self, directory: Path, budget: int | None) -> None:
        self.dir = directory  # the host directory: shard buffers in data/, parity in parity/
        self.budget = budget
        self.files: dict[str, _Buffer] = {}
        self.free: set[str] = set()
        self.lock = threading.Lock()
        self._seq = 0

    @property
    def used(self) -> int:
        return sum(b.size for b in self.files.values())

    def take(self, size: int, prefix: str, reserve: int = 0) -> _Buffer:
        """A pre-faulted file of at least ``size`` bytes (a free one of similar size if any).

        ``reserve`` is memory the caller will need soon after (parity): it must fit too.
        Raises :class:`CapacityError` when the budget or /dev/shm cannot hold it.
        """
        with self.lock:
            best = None
            for name in self.free:
                b = self.files[name]
                if (
                    name.startswith(prefix)
                    and size <= b.size <= size + size // 4 + 4096
                    and (best is None or b.size < best.size)
                ):
                    best = b
            if best is not None and self._fits(reserve):
                self.free.discard(best.name)
                return best
            need = max(size, 1)
            if not self._fits(need + reserve):
                for name in sorted(self.free, key=lambda n: -self.files[n].size):
                    self._drop(name)
                    if self._fits(need + reserve):
                        break
            if not self._fits(need + reserve):
                raise CapacityError(
                    f"{size + reserve} more bytes would exceed this host's --memory-budget of "
                    f"{self.budget} ({self.used} in use); raise the budget, lower --keep, or "
                    "delete old steps. Nothing stored was touched."
                )
            self._seq += 1
            name = f"{prefix}{os.getpid()}-{self._seq}"
        try:
            f = shm.create(self.path(name), need)
        except OSError as exc:
            try:
                self.path(name).unlink()
            except FileNotFoundError:
                pass
            raise CapacityError(f"cannot allocate {need} bytes of shared memory: {exc}") from exc
        buf = _Buffer(name, f)
        with self.lock:
            self.files[name] = buf
        return buf

    def _fits(self, extra: int) -> bool:
        return self.budget is None or self.used + extra <= self.budget

    def path(self, name: str) -> Path:
        return self.dir / ("parity" if name.startswith("p") else "data") / name

    def get(self, name: str) -> _Buffer:
        with self.lock:
            return self.files[name]

    def release(self, name: str | None) -> None:
        if name is None:
            return
        with self.lock:
            if name in self.files:
                self.free.add(name)

    def _drop(self, name: str) -> None:
        buf = self.files.pop(name)
        self.free.discard(name)
        buf.file.close()
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            pass

    def drop(self, name: str) -> None:
        with self.lock:
            if name in self.files:
                self._drop(name)


class Daemon:
    """One host's daemon. ``run()`` is the MPI engine; trainers are served on other threads."""

    def __init__(self, config: ServeConfig, comm: Any) -> None:
        from transport.mpi import Links

        self.config = config
        self.comm = comm
        self.slot: int = comm.Get_rank()
        self.nslots: int = comm.Get_size()
        vh = config.virtual_hosts
        if vh is None:
            self.host = socket.gethostname().split(".")[0]
        elif vh:
            if len(vh) != self.nslots:
                raise ConfigError(
                    f"--virtual-hosts names {len(vh)} hosts but {self.nslots} daemons run"
                )
            self.host = vh[self.slot]
        else:
            self.host = f"host{self.slot}"
        if config.k is None or config.m is None:
            k, m = default_km(self.nslots)
        else:
            k, m = config.k, config.m
        self.groups = make_groups(self.nslots, k, m)
        self.k, self.m = k, m
        self.group = next(g for g in self.groups if self.slot in g.slots)
        self.dir = host_dir(config.root, config.job, self.host)
        self.links = Links(comm, timeout=config.peer_timeout)
        self.catalog = Catalog(self.groups, self.nslots, config.chunk_bytes, config.keep)
        self.local: dict[int, _Local] = {}
        self.pending: dict[tuple[int, int], str] = {}  # (step, rank) -> buffer being staged
        self.events: list[dict[str, Any]] = []
        self.fetches: list[dict[str, Any]] = []
        self.fetch_done: dict[str, dict[str, Any]] = {}
        self.hosts: list[str] = []
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.stopping = False
        self._codecs: dict[tuple[int, int], RSCodec] = {}
        self._scratch: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        self._fetch_seq = 0
        self._failed: dict[int, str] = {}  # step -> why, for trainers waiting on it
        self.announced: set[int] = set()  # steps with a shard staged here, until forgotten
        self.wake = threading.Event()
        self.trace = bool(os.environ.get("ECSNAP_TRACE"))
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="ecsnap-crc")
        self.stats: dict[str, float] = {
            "encode_bytes": 0,
            "encode_seconds": 0,
            "decode_bytes": 0,
            "steps_protected": 0,
        }

    # -- start-up --------------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        job_dir = self.dir.parent
        for d in (
            Path(self.config.root),
            job_dir,
            self.dir,
            self.dir / "data",
            self.dir / "parity",
            self.dir / "steps",
            self.dir / "tmp",
        ):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (
            job_dir,
            self.dir,
            self.dir / "data",
            self.dir / "parity",
            self.dir / "steps",
            self.dir / "tmp",
        ):
            os.chmod(d, 0o700)
        for f in (self.dir / "tmp").iterdir():
            f.unlink()
        self.pool = Pool(self.dir, self.config.memory_budget)

    def start(self) -> None:
        self.hosts = self.links.allgather_json(self.host, "host names")
        dupes = {h for h in self.hosts if self.hosts.count(h) > 1}
        if dupes:
            raise ConfigError(
                f"two daemons claim host(s) {sorted(dupes)}; run one daemon per host, or "
                "--virtual-hosts to test on one machine"
            )
        self._prepare_dirs()
        self.server = Server(self.dir / "ctl.sock", self._handle)
        self.server.start()
        self.links.barrier("start-up")
        _log(
            self.host,
            f"ready: job {self.config.job} slot {self.slot}/{self.nslots} "
            f"group {self.group.index} RS({self.group.k},{self.group.m}) "
            f"chunk {self.config.chunk_bytes} B, socket {self.dir / 'ctl.sock'}",
        )

    # -- the MPI engine --------------------------------------------------------------------------

    def run(self) -> int:
        idle = 0.0005
        while True:
            with self.lock:
                events, self.events = self.events, []
            everyone = self.links.allgather_json(
                {"ev": events, "stop": self.stopping},
                "round",
                timeout=self.config.peer_timeout,
                busy=bool(events) or self._has_work(),
            )
            busy = any(p["ev"] for p in everyone)
            with self.cond:
                for slot, payload in enumerate(everyone):
                    for event in payload["ev"]:
                        if event.get("e") == "fetch":
                            self.fetches.append(event)
                            continue
                        self.catalog.apply(slot, event)
                        if event.get("e") == "staged" and slot == self.slot:
                            step, shard = int(event["step"]), event["shard"]
                            loc = self.local.setdefault(step, _Local())
                            loc.buffers[int(shard["rank"])] = str(shard["buffer"])
                            loc.t.setdefault("staged", time.monotonic())
                self.cond.notify_all()
            self._advance()
            if any(p["stop"] for p in everyone):
                return 0
            if busy or self._has_work():
                idle = 0.0005
            else:
                # Peers join a round within ``idle``; a trainer's request starts one at once here.
                self.wake.wait(idle)
                self.wake.clear()
                idle = min(idle * 2, 0.02)

    def _has_work(self) -> bool:
        with self.lock:
            return bool(self.events) or any(
                r.state in ("ready", "encoding") for r in self.catalog.steps.values()
            )

    def _advance(self) -> None:
        for rec in sorted(self.catalog.steps.values(), key=lambda r: r.step):
            loc = self.local.setdefault(rec.step, _Local())
            if rec.state == "ready" and not loc.prepared:
                self._prepare(rec, loc)
            elif rec.state == "encoding" and not loc.stored:
                self._exchange(rec, loc)
        self._serve_fetches()
        with self.cond:
            for rec in list(self.catalog.steps.values()):
                loc = self.local[rec.step]
                if rec.state == "protected" and not loc.manifest:
                    loc.manifest = True
                    self._write_manifest(rec, loc)
                    loc.t["protected"] = time.monotonic()
                    if self.trace:
                        t0 = loc.t.get("staged", loc.t.get("ready", 0.0))
                        phases = " ".join(f"{k}=+{(v - t0) * 1e3:.1f}ms" for k, v in loc.t.items())
                        _log(self.host, f"step {rec.step}: {phases}")
                    self.stats["steps_protected"] += 1
                if rec.state == "failed":
                    self._forget(rec.step)
            for step in [s for s in self.local if s not in self.catalog.steps]:
                self._forget(step)  # deleted, or evicted by retention
            self.cond.notify_all()

    def _forget(self, step: int) -> None:
        """Give this host's files of ``step`` back to the pool (caller holds the lock)."""
        self.announced.discard(step)
        loc = self.local.pop(step, None)
        if loc is not None:
            for name in loc.buffers.values():
                self.pool.release(name)
            self.pool.release(loc.parity)
        rec = self.catalog.steps.get(step)
        if rec is not None and rec.state == "failed":
            self.catalog.steps.pop(step, None)
            self._failed[step] = rec.error or "failed"
        try:
            (self.dir / "steps" / f"{step}.json").unlink()
        except FileNotFoundError:
            pass

    def _prepare(self, rec: StepRec, loc: _Local) -> None:
        """Reserve parity memory, start checksumming this host's data chunks; report next round.

        The checksums run on a helper thread (ISA-L's CRC drops the GIL) while the exchange moves
        the same bytes; ``stored`` waits for them.
        """
        loc.prepared = True
        loc.t["ready"] = time.monotonic()
        layout = rec.layouts[self.group.index]
        pos = self.group.position(self.slot)
        nparity = len(layout.parity_stripes[pos])
        error = None
        try:
            buf = self.pool.take(nparity * self.config.chunk_bytes, "p")
            loc.parity = buf.name
        except CapacityError as exc:
            error = str(exc)
        if error is None:
            views = [self._chunk_view(rec, c) for c in range(len(rec.blobs[self.slot].chunks))]
            loc.crc_job = self._crc_pool.submit(lambda: [checksum(v) for v in views])
        loc.t["prepared"] = time.monotonic()
        with self.lock:
            self.events.append({"e": "prepared", "step": rec.step, "error": error})

    def _chunk_view(self, rec: StepRec, c: int) -> np.ndarray[Any, Any]:
        ref = rec.blobs[self.slot].chunks[c]
        buf = self.pool.get(rec.shards[ref.rank].buffer)
        return buf.file.array[ref.offset : ref.offset + ref.length]

    def _codec(self, k: int, m: int) -> RSCodec:
        rs = self._codecs.get((k, m))
        if rs is None:
            rs = self._codecs[(k, m)] = RSCodec(k, m, threads=self.config.encode_threads)
        return rs

    def _scratch_for(self, rows: int) -> np.ndarray[Any, Any]:
        key = (rows, self.config.chunk_bytes)
        s = self._scratch.get(key)
        if s is None:
            s = np.zeros((rows, self.config.chunk_bytes), dtype=np.uint8)
            self._scratch[key] = s
        return s

    def _exchange(self, rec: StepRec, loc: _Local) -> None:
        """Send data chunks to their stripes' encoders, encode, forward parity, window by window.

        Every daemon of the group runs this in the same round. Pairs of daemons post their messages
        in stripe order, so MPI's non-overtaking rule matches them without per-stripe tags.
        """
        loc.stored = True
        loc.t["exchange"] = time.monotonic()
        g = self.group
        layout = rec.layouts[g.index]
        pos = g.position(self.slot)
        k, m, cb = g.k, g.m, self.config.chunk_bytes
        rs = self._codec(k, m)
        parity = self.pool.get(loc.parity).file.array if loc.parity else None
        window = self.config.window
        data_scratch = self._scratch_for(window * k)
        out_scratch = self._scratch_for(window * max(m - 1, 1) + 1)
        blobs = {p: rec.blobs[g.slots[p]] for p in range(layout.n)}
        t_encode = 0.0
        for w0 in range(0, layout.stripes, window):
            stripes = range(w0, min(w0 + window, layout.stripes))
            data_reqs: list[Any] = []
            parity_reqs: list[Any] = []
            mine_to_encode = []
            for s in stripes:
                ppos = layout.parity_positions(s)
                encoder = ppos[0]
                for j in range(k):
                    if layout.data_position(s, j) == pos:
                        c = layout.data_chunk(s, j)
                        if c is not None:
                            data_reqs += self.links.isend(
                                self._chunk_view(rec, c), g.slots[encoder], TAG_DATA
                            )
                if encoder == pos:
                    mine_to_encode.append(s)
                    row0 = (s - w0) * k
                    for j in range(k):
                        dpos = layout.data_position(s, j)
                        c = layout.data_chunk(s, j)
                        dst = data_scratch[row0 + j]
                        if c is None:
                            dst[:] = 0
                            continue
                        length = blobs[dpos].chunks[c].length
                        if length < cb:
                            dst[length:] = 0
                        data_reqs += self.links.irecv(dst[:length], g.slots[dpos], TAG_DATA)
                elif pos in ppos and parity is not None:
                    slot_i = layout.parity_slot(pos, s)
                    dst = parity[slot_i * cb : (slot_i + 1) * cb]
                    parity_reqs += self.links.irecv(dst, g.slots[encoder], TAG_PARITY)
            self.links.wait(data_reqs, f"data exchange of step {rec.step}", busy=True)
            for s in mine_to_encode:
                assert parity is not None
                row0 = (s - w0) * k
                slot0 = layout.parity_slot(pos, s)
                outs = [parity[slot0 * cb : (slot0 + 1) * cb]]
                for i in range(1, m):
                    outs.append(out_scratch[(s - w0) * (m - 1) + i - 1])
                t0 = time.perf_counter()
                rs.encode_into([data_scratch[row0 + j] for j in range(k)], outs)
                t_encode += time.perf_counter() - t0
                ppos = layout.parity_positions(s)
                for i in range(1, m):
                    parity_reqs += self.links.isend(outs[i], g.slots[ppos[i]], TAG_PARITY)
            self.links.wait(parity_reqs, f"parity exchange of step {rec.step}", busy=True)
        encoded_stripes = sum(
            1 for s in range(layout.stripes) if layout.parity_positions(s)[0] == pos
        )
        self.stats["encode_bytes"] += encoded_stripes * k * cb
        self.stats["encode_seconds"] += t_encode
        if parity is not None:
            n = len(layout.parity_stripes[pos])
            loc.parity_crc = [checksum(parity[i * cb : (i + 1) * cb]) for i in range(n)]
        if loc.crc_job is not None:
            loc.data_crc = loc.crc_job.result()
        loc.t["stored"] = time.monotonic()
        with self.lock:
            self.events.append(
                {
                    "e": "stored",
                    "step": rec.step,
                    "crc": {"data": loc.data_crc, "parity": loc.parity_crc},
                }
            )

    def _serve_fetches(self) -> None:
        """Move shards to the hosts that asked for them (a rank read from another host)."""
        with self.lock:
            fetches, self.fetches = self.fetches, []
        for f in fetches:
            rec = self.catalog.steps.get(int(f["step"]))
            to = int(f["to"])
            result: dict[str, Any]
            if rec is None or rec.state != "protected" or int(f["rank"]) not in rec.shards:
                result = {"error": "gone"}
                if to == self.slot:
                    self._fetch_finish(f["id"], result)
                continue
            shard = rec.shards[int(f["rank"])]
            if shard.slot == self.slot and to != self.slot:
                view = self.pool.get(shard.buffer).file.array[: shard.nbytes]
                self.links.wait(
                    self.links.isend(view, to, TAG_FETCH), "shard fetch (send)", busy=True
                )
            elif to == self.slot:
                path = self.dir / "tmp" / f"fetch-{f['id']}"
                try:
                    tmp = shm.create(path, max(shard.nbytes, 1), prefault_pages=False)
                except OSError as exc:
                    # the holder sends regardless: drain it into scratch so MPI stays in step
                    sink = np.empty(shard.nbytes, dtype=np.uint8)
                    self.links.wait(
                        self.links.irecv(sink, shard.slot, TAG_FETCH), "shard fetch", busy=True
                    )
                    self._fetch_finish(
                        f["id"], {"error": f"no memory for the fetched shard: {exc}"}
                    )
                    continue
                self.links.wait(
                    self.links.irecv(tmp.array[: shard.nbytes], shard.slot, TAG_FETCH),
                    "shard fetch (receive)",
                    busy=True,
                )
                tmp.close()
                self._fetch_finish(f["id"], {"path": str(path), "size": max(shard.nbytes, 1)})

    def _fetch_finish(self, fid: str, result: dict[str, Any]) -> None:
        with self.cond:
            self.fetch_done[fid] = result
            self.cond.notify_all()

    def _write_manifest(self, rec: StepRec, loc: _Local) -> None:
        manifest = {
            "version": MANIFEST_VERSION,
            "job": self.config.job,
            "step": rec.step,
            "world_size": rec.world_size,
            "hosts": self.hosts,
            "chunk_bytes": self.config.chunk_bytes,
            "groups": [{"slots": list(g.slots), "k": g.k, "m": g.m} for g in self.groups],
            "shards": [s.to_json() for s in sorted(rec.shards.values(), key=lambda s: s.rank)],
            "crc": {str(slot): c for slot, c in rec.stored.items()},
            "parity": loc.parity,
        }
        body = json.dumps(manifest, separators=(",", ":"))
        manifest["checksum"] = checksum(body.encode())
        path = self.dir / "steps" / f"{rec.step}.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, separators=(",", ":"))
        os.replace(tmp, path)

    # -- trainer requests (control-socket threads) ------------------------------------------------

    def _handle(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any] | None:
        op = msg.get("op")
        try:
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise StorageError(f"unknown request {op!r}")
            reply: dict[str, Any] = handler(msg)
            reply.setdefault("ok", True)
            return reply
        except StorageError as exc:
            return to_wire(exc)
        except (KeyError, TypeError, ValueError) as exc:
            return to_wire(StorageError(f"bad request {op!r}: {exc!r}"))

    def _op_hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("job") != self.config.job:
            raise StorageError(
                f"this daemon serves job {self.config.job!r}, not {msg.get('job')!r}"
            )
        return {
            "host": self.host,
            "slot": self.slot,
            "hosts": self.hosts,
            "k": self.group.k,
            "m": self.group.m,
            "chunk_bytes": self.config.chunk_bytes,
        }

    @staticmethod
    def _int(msg: dict[str, Any], key: str, low: int = 0) -> int:
        v = msg.get(key)
        if type(v) is not int or v < low:
            raise StorageError(f"{key} must be an int >= {low}, got {v!r}")
        return v

    def _op_alloc(self, msg: dict[str, Any]) -> dict[str, Any]:
        step, rank = self._int(msg, "step"), self._int(msg, "rank")
        world, nbytes = self._int(msg, "world_size", 1), self._int(msg, "nbytes")
        if rank >= world:
            raise StorageError(f"rank {rank} is not below world_size {world}")
        with self.lock:
            rec = self.catalog.steps.get(step)
            if rec is not None and (rank in rec.shards or rec.state != "staging"):
                raise StepExistsError(
                    f"step {step} was already put by rank {rank} (steps are write-once); "
                    "delete it first or put a new step"
                )
            if (step, rank) in self.pending:
                raise StepExistsError(f"rank {rank} is already putting step {step}")
            if rec is not None and rec.world_size != world:
                raise StorageError(
                    f"step {step} is being put with world_size {rec.world_size}, not {world}"
                )
            self.pending[(step, rank)] = ""
        try:
            reserve = -(-nbytes * self.m // self.group.k)
            buf = self.pool.take(nbytes, f"r{rank}-", reserve=reserve)
        except CapacityError:
            with self.lock:
                self.pending.pop((step, rank), None)
            raise
        with self.lock:
            self.pending[(step, rank)] = buf.name
        return {"buffer": buf.name, "path": str(self.pool.path(buf.name)), "size": buf.size}

    def _op_staged(self, msg: dict[str, Any]) -> dict[str, Any]:
        step, rank = self._int(msg, "step"), self._int(msg, "rank")
        with self.lock:
            name = self.pending.pop((step, rank), None)
            if not name or name != msg.get("buffer"):
                raise StorageError(f"step {step} rank {rank} was not allocated on this host")
            shard = {
                "rank": rank,
                "slot": self.slot,
                "nbytes": self._int(msg, "nbytes"),
                "buffer": name,
                "meta": msg["meta"],
            }
            self.announced.add(step)
            self.events.append(
                {"e": "staged", "step": step, "world_size": msg["world_size"], "shard": shard}
            )
            self.wake.set()
        return {}

    def _op_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        step, rank = self._int(msg, "step"), self._int(msg, "rank")
        with self.lock:
            name = self.pending.pop((step, rank), None)
        self.pool.release(name or None)
        return {}

    def _op_wait(self, msg: dict[str, Any]) -> dict[str, Any]:
        step = self._int(msg, "step")
        timeout = float(msg.get("timeout") or self.config.peer_timeout)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                rec = self.catalog.steps.get(step)
                if rec is not None and rec.state == "protected":
                    return {"step": step}
                if step in self._failed:
                    raise CapacityError(f"step {step} failed: {self._failed[step]}")
                if (
                    rec is None
                    and step not in self.announced
                    and not any(s == step for s, _ in self.pending)
                ):
                    raise StepNotFoundError(f"step {step} is not being put (deleted?)", step)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(f"step {step} not protected within {timeout:.0f}s")
                self.cond.wait(min(left, 1.0))

    def _resolve(self, step: Any) -> StepRec:
        with self.lock:
            if step is None:
                latest = self.catalog.latest()
                if latest is None:
                    raise StepNotFoundError("no protected step yet", None)
                step = latest
            if type(step) is not int or step < 0:
                raise StorageError(f"step must be an int >= 0 or None, got {step!r}")
            rec = self.catalog.steps.get(step)
            if rec is None or rec.state != "protected":
                held = self.catalog.protected()
                raise StepNotFoundError(
                    f"step {step} is not protected on job {self.config.job!r} "
                    f"(protected steps: {held or 'none'})",
                    step,
                )
            return rec

    def _op_get(self, msg: dict[str, Any]) -> dict[str, Any]:
        rec = self._resolve(msg.get("step"))
        rank = self._int(msg, "rank")
        shard = rec.shards.get(rank)
        if shard is None:
            raise StepNotFoundError(
                f"step {rec.step} has no rank {rank} (world_size {rec.world_size})", rec.step
            )
        out = {"step": rec.step, "meta": shard.meta, "nbytes": shard.nbytes}
        if shard.slot == self.slot:
            buf = self.pool.get(shard.buffer)
            return {
                **out,
                "path": str(self.pool.path(shard.buffer)),
                "size": buf.size,
                "temp": False,
            }
        with self.cond:
            self._fetch_seq += 1
            fid = f"{self.slot}-{os.getpid()}-{self._fetch_seq}"
            self.events.append(
                {"e": "fetch", "id": fid, "step": rec.step, "rank": rank, "to": self.slot}
            )
            self.wake.set()
            deadline = time.monotonic() + self.config.peer_timeout
            while fid not in self.fetch_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(f"fetching step {rec.step} rank {rank} timed out")
                self.cond.wait(min(left, 1.0))
            result = self.fetch_done.pop(fid)
        if "error" in result:
            raise StepNotFoundError(f"step {rec.step} rank {rank}: {result['error']}", rec.step)
        return {**out, "path": result["path"], "size": result["size"], "temp": True}

    def _op_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        path = Path(str(msg.get("path")))
        if path.parent != self.dir / "tmp":
            raise StorageError(f"{path} is not a temporary file of this daemon")
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return {}

    def _op_steps(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return {"steps": self.catalog.protected()}

    def _op_status(self, msg: dict[str, Any]) -> dict[str, Any]:
        step = self._int(msg, "step")
        with self.lock:
            rec = self.catalog.steps.get(step)
            if rec is None:
                raise StepNotFoundError(f"step {step} is not held on job {self.config.job!r}", step)
            parity = 0
            for g in self.groups:
                lay = rec.layouts.get(g.index)
                if lay is not None:
                    parity += lay.stripes * g.m * self.config.chunk_bytes
            return {
                "step": step,
                "world_size": rec.world_size,
                "state": rec.state,
                "ranks_staged": sorted(rec.shards),
                "hosts": sorted({self.hosts[s.slot] for s in rec.shards.values()}),
                "data_bytes": rec.nbytes(),
                "parity_bytes": parity,
            }

    def _op_delete(self, msg: dict[str, Any]) -> dict[str, Any]:
        step = self._int(msg, "step")
        with self.cond:
            if step not in self.catalog.steps:
                raise StepNotFoundError(f"step {step} is not held on job {self.config.job!r}", step)
            self.events.append({"e": "delete", "step": step})
            self.wake.set()
            deadline = time.monotonic() + self.config.peer_timeout
            while step in self.catalog.steps and time.monotonic() < deadline:
                self.cond.wait(0.5)
        return {}

    def _op_info(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Counters for benchmarks and status: bytes held and moved."""
        with self.lock:
            data = sum(
                s.nbytes
                for r in self.catalog.steps.values()
                for s in r.shards.values()
                if s.slot == self.slot and r.state == "protected"
            )
            parity = 0
            for r in self.catalog.steps.values():
                loc = self.local.get(r.step)
                if r.state == "protected" and loc is not None and loc.parity:
                    lay = r.layouts[self.group.index]
                    parity += (
                        len(lay.parity_stripes[self.group.position(self.slot)])
                        * self.config.chunk_bytes
                    )
            return {
                "host": self.host,
                "slot": self.slot,
                "data_bytes": data,
                "parity_bytes": parity,
                "pool_bytes": self.pool.used,
                "sent_bytes": self.links.counters.sent,
                "received_bytes": self.links.counters.received,
                "stats": dict(self.stats),
                "protected": self.catalog.protected(),
            }

    def close(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
        for rs in self._codecs.values():
            rs.close()
        self._crc_pool.shutdown(wait=True)


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def parse_args(argv: Iterable[str] | None) -> ServeConfig:
    p = argparse.ArgumentParser(
        prog="ecsnap serve",
        description="Run one ecsnap daemon per MPI rank: mpiexec -n HOSTS ecsnap serve --job NAME",
    )
    p.add_argument(
        "--job", default=os.environ.get("ECSNAP_JOB"), required="ECSNAP_JOB" not in os.environ
    )
    p.add_argument("--root", default=os.environ.get("ECSNAP_ROOT", DEFAULT_ROOT))
    p.add_argument("--k", type=int)
    p.add_argument("--m", type=int)
    p.add_argument(
        "--virtual-hosts",
        nargs="?",
        const="",
        default=None,
        help="rank i acts as host<i> (or the i-th of a comma-separated list)",
    )
    p.add_argument("--chunk-bytes", type=_parse_size, default=1 << 20)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--memory-budget", type=_parse_size, default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--peer-timeout", type=float, default=120.0)
    a = p.parse_args(list(argv) if argv is not None else None)
    vh: tuple[str, ...] | None = None
    if a.virtual_hosts is not None:
        vh = tuple(h for h in a.virtual_hosts.split(",") if h) if a.virtual_hosts else ()
    return ServeConfig(
        job=a.job,
        root=Path(a.root),
        k=a.k,
        m=a.m,
        chunk_bytes=a.chunk_bytes,
        keep=a.keep,
        memory_budget=a.memory_budget,
        virtual_hosts=vh,
        metrics_port=a.metrics_port,
        peer_timeout=a.peer_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"ecsnap serve: {exc}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    try:
        daemon = Daemon(config, comm)
    except ConfigError as exc:
        if comm.Get_rank() == 0:
            print(f"ecsnap serve: {exc}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: Any) -> None:
        daemon.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        daemon.start()
        code = daemon.run()
        _log(daemon.host, "stopped; state stays in " + str(daemon.dir))
        return code
    except ConfigError as exc:
        print(f"ecsnap serve: {exc}", file=sys.stderr)
        comm.Abort(2)
        return 2
    except PeerTimeoutError as exc:
        _log(daemon.host, f"{exc}")
        comm.Abort(3)
        return 3
    finally:
        daemon.close()
