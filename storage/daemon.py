"""``ecsnap serve``: one storage daemon per host, all of them one MPI job.

Call sequence (every daemon runs the same loop, in lock-step rounds)::

    mpiexec -n H ecsnap serve --job J [--virtual-hosts] [--k K --m M] ...

    start:  adopt what the host directory holds (see :mod:`storage.recovery`): claim slots,
            agree on manifests, check every chunk, rebuild what was lost, then serve.
    round:  allgather the events of the last round (staged shards, prepared, stored, deletes,
            fetches, repairs), apply them in slot order to the replicated :class:`Catalog`, then
            act: prepare ready steps (parity memory, data checksums), run the erasure-coding
            exchange of steps every daemon prepared, move fetched shards, repair chunks a read
            found bad, write the manifest of newly protected steps, free what retention drops.

Trainers talk to their host's daemon over ``<root>/<job>/<host>/ctl.sock`` (framed JSON) and write
shard bytes straight into the daemon's shared-memory buffers. The daemon's threads: the main
thread drives MPI; one thread per trainer connection answers requests.

Slots, not machines: the layout has H slots; MPI rank r serves slot ``slot_of_rank[r]``, the one
whose files its host holds (or one nobody holds). Every MPI call maps slot to rank.

The storage job is one failure domain: a dead peer makes the mpich job die or hang, so every wait
on a peer has a timeout after which this daemon aborts the job. State stays in the host directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from codec.layout import zeros
from storage import persist, recovery
from storage.catalog import Catalog, StepRec
from storage.config import DEFAULT_ROOT, ServeConfig, host_dir
from storage.errors import (
    CapacityError,
    ConfigError,
    SnapshotUnrecoverableError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    to_wire,
)
from storage.metrics import Metrics
from storage.placement import Group, default_km, make_groups
from storage.pool import Pool
from storage.recovery import Erasures, holder, plan_repair
from transport import faults, shm
from transport.control import Connection, Server
from transport.errors import PeerTimeoutError

__all__ = ["Daemon", "main"]

TAG_DATA, TAG_PARITY, TAG_FETCH, TAG_REPAIR = 11, 12, 13, 14


# A bulk sender's sleep between polls. MPICH's shared-memory transfer needs the sender's progress
# every few tens of microseconds: 3 ranks into 1 on 2 cores moved 9 GB/s napping 50 us, 5 GB/s
# spinning (which takes the receiver's cores) and 1.2 GB/s sleeping 2 ms (measured).
_SENDER_NAP = 5e-5
_REPAIR_ROWS = 64 << 20  # bytes of receive rows per set in a repair window
_PERSIST = -1  # the lease the persister holds on a buffer it writes (connections are > 0)


def _unlink_mpi_segments() -> None:
    """Unlink the /dev/shm files MPICH made at MPI_Init, once every local rank has them mapped
    (after the first collective): mappings outlive names, and a SIGKILLed storage job then
    leaves nothing behind (it left one 4 MB ``mpich_shm_*`` file per job, measured)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith("/dev/shm/mpich_shm_"):
            try:
                os.unlink(path)
            except OSError:
                pass  # another local rank was first


def _lower_priority() -> None:
    """Run the calling thread at the lowest CPU priority (nice 19; on Linux, per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _log(host: str, msg: str) -> None:
    print(f"ecsnap[{host}] {msg}", file=sys.stderr, flush=True)


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


class Daemon:
    """One host's daemon. ``run()`` is the MPI engine; trainers are served on other threads."""

    def __init__(self, config: ServeConfig, comm: Any) -> None:
        from transport.mpi import Links

        self.config = config
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.nslots: int = comm.Get_size()
        vh = config.virtual_hosts
        if vh is None:
            self.host = socket.gethostname().split(".")[0]
        elif vh:
            if len(vh) != self.nslots:
                raise ConfigError(
                    f"--virtual-hosts names {len(vh)} hosts but {self.nslots} daemons run"
                )
            self.host = vh[self.rank]
        else:
            self.host = f"host{self.rank}"
        if config.k is None or config.m is None:
            self.k, self.m = default_km(self.nslots)
        else:
            self.k, self.m = config.k, config.m
        self.groups: list[Group] = make_groups(self.nslots, self.k, self.m)
        self.chunk_bytes = config.chunk_bytes
        self.slot = self.rank  # until adoption says otherwise
        self.rank_of: list[int] = list(range(self.nslots))  # slot -> MPI rank
        self.slot_of_rank: list[int] = list(range(self.nslots))
        self.dir = host_dir(config.root, config.job, self.host)
        self.pool = Pool(self.dir, config.memory_budget)
        self.links = Links(comm, timeout=config.peer_timeout)
        self.links.host = self.host
        self.catalog = Catalog(self.groups, self.nslots, self.chunk_bytes, config.keep)
        self.local: dict[int, _Local] = {}
        self.pending: dict[tuple[int, int], str] = {}  # (step, rank) -> buffer being staged
        self.pending_conn: dict[tuple[int, int], int] = {}  # ... and the connection staging it
        self.events: list[dict[str, Any]] = []
        self.fetches: list[dict[str, Any]] = []
        self.fetch_done: dict[str, dict[str, Any]] = {}
        self.repairs: list[dict[str, Any]] = []
        self.repairs_done: set[str] = set()  # ids of repairs run, for readers waiting on them
        # buffers that trainers hold views of: name -> {connection: live gets}; and ones to free
        # once they all let go. Counted: one connection may get the same shard twice and drop one.
        self.leases: dict[str, dict[int, int]] = {}
        self.deferred: set[str] = set()
        self.hosts: list[str] = []  # by slot
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.stopping = False
        self._codecs: dict[tuple[int, int], RSCodec] = {}
        self._scratch: dict[tuple[str, int, int], np.ndarray[Any, Any]] = {}
        self._fetch_seq = 0
        self._failed: dict[int, str] = {}  # step -> why, for trainers waiting on it
        self.announced: set[int] = set()  # steps with a shard staged here, until forgotten
        self.wake = threading.Event()
        self.trace = bool(os.environ.get("ECSNAP_TRACE"))
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="ecsnap-crc")
        self.health = "starting"
        self.errors: dict[str, int] = {}  # refused requests by error class
        self.last_error: str | None = None
        self.degraded_stripes = 0
        self.missing_slots: set[int] = set()
        # (step, erasures by slot) still to rebuild after start-up, oldest last; same everywhere
        self.deferred_repairs: list[tuple[int, dict[int, Erasures]]] = []
        # the persistent tier: one writer thread; ranks persisted per step, gathered from events
        self.persist_root = config.persist_dir
        self._persister = (
            ThreadPoolExecutor(1, thread_name_prefix="ecsnap-persist")
            if config.persist_dir is not None
            else None
        )
        self.persist_acc: dict[int, dict[str, Any]] = {}
        self.restoring: int | None = None  # a step being put back from disk at start-up
        self.rounds = 0  # rounds completed (every daemon finished the previous one's work)
        self.t_alloc: dict[tuple[int, int], float] = {}  # (step, rank) -> when the put began
        self.metrics = Metrics(self)
        self.stats: dict[str, float] = {
            "encode_bytes": 0,
            "encode_seconds": 0,
            "decode_bytes": 0,
            "steps_protected": 0,
            "checksum_failures": 0,
            "rebuilds": 0,
            "rebuild_seconds": 0,
            "startup_rebuild_seconds": 0,  # the part done before serving: the newest step
            "rebuilt_chunks": 0,
            "adopted_steps": 0,
            "lost_steps": 0,
            "persisted_steps": 0,  # published on disk (every daemon counts them)
            "persist_bytes": 0,  # written by this daemon
            "persist_seconds": 0,
            "restored_steps": 0,  # put back into memory from disk at start-up
            "restore_read_seconds": 0,  # ... reading its files (then the rounds protect it)
            "disk_reads": 0,  # shards served straight from disk
        }

    @property
    def group(self) -> Group:
        return next(g for g in self.groups if self.slot in g.slots)

    # -- start-up --------------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        job_dir = self.dir.parent
        Path(self.config.root).mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (job_dir, self.dir, *(self.dir / s for s in ("data", "parity", "steps", "tmp"))):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
        for f in (self.dir / "tmp").iterdir():
            f.unlink()

    def start(self) -> None:
        hosts_by_rank = self.links.allgather_json(self.host, "host names")
        _unlink_mpi_segments()  # every local rank is past MPI_Init: they all have them mapped
        dupes = sorted({h for h in hosts_by_rank if hosts_by_rank.count(h) > 1})
        if dupes:
            raise ConfigError(
                f"two daemons claim host {', '.join(dupes)} (one host directory each); run one "
                "daemon per host, or --virtual-hosts to test on one machine"
            )
        self._prepare_dirs()
        self._write_health()
        self._adopt(hosts_by_rank)
        self.server = Server(self.dir / "ctl.sock", self._handle, on_close=self._closed_conn)
        self.server.start()
        if self.config.metrics_port is not None:
            port = self.config.metrics_port
            if port and self.config.virtual_hosts is not None:
                port += self.rank
            try:
                self.metrics.serve(port, self.config.metrics_addr, self.dir / "metrics.port")
            except OSError as exc:
                raise ConfigError(f"cannot serve metrics on port {port}: {exc}") from exc
        self.links.barrier("start-up")
        _log(
            self.host,
            f"ready: job {self.config.job} slot {self.slot}/{self.nslots} "
            f"group {self.group.index} RS({self.group.k},{self.group.m}) "
            f"chunk {self.chunk_bytes} B, {len(self.catalog.protected())} protected step(s), "
            f"socket {self.dir / 'ctl.sock'}"
            + (f", metrics on :{self.metrics.port}" if self.metrics.port else ""),
        )

    def _adopt(self, hosts_by_rank: list[str]) -> None:
        """Claim a slot, agree on manifests, check chunks, rebuild what was lost (collective)."""
        valid, bad = recovery.scan(self.dir)
        for name in bad:
            self.stats["checksum_failures"] += 1
            _log(self.host, f"manifest {name} fails its checksum: taking it from a peer")
            (self.dir / "steps" / name).unlink()
        newest = valid[max(valid)] if valid else None
        claim = None
        layout = None
        if newest is not None:
            if self.host in newest["hosts"]:
                claim = newest["hosts"].index(self.host)
            layout = {
                "hosts": len(newest["hosts"]),
                "groups": newest["groups"],
                "chunk_bytes": newest["chunk_bytes"],
            }
        digests = {str(s): m["checksum"] for s, m in valid.items()}
        everyone = self.links.allgather_json(
            {"claim": claim, "layout": layout, "steps": digests}, "adoption"
        )
        layouts = [e["layout"] for e in everyone if e["layout"] is not None]
        if layouts:
            self._check_layout(layouts)
        # slots: each claims the one its files name; the rest fill the holes in rank order
        slot_of_rank: list[int | None] = [e["claim"] for e in everyone]
        claimed = [s for s in slot_of_rank if s is not None]
        twice = sorted({s for s in claimed if claimed.count(s) > 1})
        if twice:
            raise ConfigError(f"two daemons hold the files of slot(s) {twice}")
        free = iter(s for s in range(self.nslots) if s not in claimed)
        final = [s if s is not None else next(free) for s in slot_of_rank]
        self.slot_of_rank = final
        self.rank_of = [final.index(s) for s in range(self.nslots)]
        self.slot = final[self.rank]
        self.hosts = [hosts_by_rank[self.rank_of[s]] for s in range(self.nslots)]
        # manifests: each step from the lowest rank holding a valid copy
        source: dict[str, int] = {}
        for r, e in enumerate(everyone):
            for step in e["steps"]:
                source.setdefault(step, r)
        share = {s: valid[int(s)] for s, r in source.items() if r == self.rank}
        manifests: dict[int, dict[str, Any]] = {}
        for part in self.links.allgather_json(share, "manifests"):
            manifests.update({int(s): m for s, m in part.items()})
        for step in sorted(manifests):
            self.catalog.steps[step] = recovery.rec_from_manifest(manifests[step], self.catalog)
        self.stats["adopted_steps"] = len(manifests)
        # every host checks its own chunks; the erasures of all are everyone's to plan
        t0 = time.monotonic()
        mine = {str(step): self._verify(rec).to_json() for step, rec in self.catalog.steps.items()}
        erasures: dict[int, dict[int, Erasures]] = {}
        for r, part in enumerate(self.links.allgather_json(mine, "erasures")):
            for step, e in part.items():
                er = Erasures.from_json(e)
                if er:
                    erasures.setdefault(int(step), {})[final[r]] = er
        if erasures:
            self.health = "rebuilding"
            self.missing_slots = {
                final[r] for r, e in enumerate(everyone) if e["claim"] is None and manifests
            }
            self.degraded_stripes = self._degraded(list(erasures.items()))
            self._write_health()
        t1 = time.monotonic()
        # The newest step that can be rebuilt is rebuilt before serving (it is what a restarting
        # trainer reads); steps that cannot are marked lost now (cheap); older ones are rebuilt
        # in the background, one per round, the same queue on every daemon. The newest step's
        # parity is rebuilt before serving too: deferring it served 25% sooner (0.71 s against
        # 0.94 s for 1.5 GB, RS(3,1)), but a second loss in the group right after the relaunch
        # then lost the newest step (tried and measured).
        rebuilt_one = False
        for step in sorted(erasures, reverse=True):
            rec = self.catalog.steps[step]
            if rebuilt_one and not self._lost_slots(rec, erasures[step]):
                self.deferred_repairs.append((step, erasures[step]))
                continue
            self._repair(rec, erasures[step])
            rebuilt_one = rebuilt_one or rec.state == "protected"
        self.stats["startup_rebuild_seconds"] = time.monotonic() - t1
        if self.trace:
            _log(
                self.host,
                f"adoption: verify {(t1 - t0) * 1e3:.1f}ms, repair "
                f"{(time.monotonic() - t1) * 1e3:.1f}ms",
            )
        # files of steps that never became protected (the job died mid-put) are not state
        keep = {
            s.buffer
            for r in self.catalog.steps.values()
            for s in r.shards.values()
            if s.slot == self.slot
        }
        keep |= {r.parity[self.slot] for r in self.catalog.steps.values() if self.slot in r.parity}
        removed = self.pool.sweep(keep)
        for name in list(self.pool.files):
            if name not in keep:
                self.pool.drop(name)
        for step, rec in self.catalog.steps.items():
            loc = self.local.setdefault(step, _Local())
            loc.buffers = {r: s.buffer for r, s in rec.shards.items() if s.slot == self.slot}
            loc.parity = rec.parity.get(self.slot)
            loc.prepared = loc.stored = True
            if rec.state == "protected":
                self._write_manifest(rec, loc)
            else:
                (self.dir / "steps" / f"{step}.json").unlink(missing_ok=True)
        if self.persist_root is not None:
            self._restore_newest()
        if self.deferred_repairs:
            self.degraded_stripes = self._degraded(self.deferred_repairs)
        else:
            self.health = "healthy"
            self.degraded_stripes = 0
            self.missing_slots = set()
        self._write_health()
        if manifests or removed:
            lost = [s for s, r in self.catalog.steps.items() if r.state == "lost"]
            _log(
                self.host,
                f"adopted {len(manifests)} step(s) as slot {self.slot}; rebuilt "
                f"{int(self.stats['rebuilt_chunks'])} chunk(s) here; lost steps {lost or 'none'}; "
                f"removed {len(removed)} file(s) of unfinished steps",
            )

    # -- the persistent tier ---------------------------------------------------------------------

    def _restore_newest(self) -> None:
        """Put the newest persisted step back into memory if memory holds nothing as new
        (collective). Each daemon reads the ranks whose host it is (or that fall to its slot)
        and stages them as a trainer would; the usual rounds then protect the step."""
        assert self.persist_root is not None
        t0 = time.monotonic()
        root, job = self.persist_root, self.config.job
        if self.rank == 0:
            persist.remove_partials(root, job)
            disk = persist.complete_steps(root, job)
        else:
            disk = None
        disk = self.links.allgather_json(disk, "persisted steps")[0]
        latest = self.catalog.latest()
        if not disk or (latest is not None and disk[-1] <= latest):
            return
        step = int(disk[-1])
        taken: list[tuple[int, Any, dict[str, Any]]] = []
        error = None
        try:
            m = persist.manifest(root, job, step)
            for r, entry in sorted(m["ranks"].items(), key=lambda kv: int(kv[0])):
                host = entry.get("host")
                slot = self.hosts.index(host) if host in self.hosts else int(r) % self.nslots
                if slot != self.slot:
                    continue
                nbytes = int(entry["nbytes"])
                buf = self.pool.take(nbytes, f"r{r}-")
                taken.append((int(r), buf, entry))
                persist.read_rank(persist.step_dir(root, job, step), entry, buf.file.array)
        except StorageError as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in self.links.allgather_json(error, f"restore of {step}") if e]
        if errors:
            for _, buf, _ in taken:
                self.pool.release(buf.name)
            _log(self.host, f"cannot put step {step} back from {root}: {errors[0]}")
            return
        world = int(m["world_size"])
        with self.lock:
            for r, buf, entry in taken:
                shard = {
                    "rank": r,
                    "slot": self.slot,
                    "nbytes": int(entry["nbytes"]),
                    "buffer": buf.name,
                    "meta": entry["meta"],
                }
                self.events.append(
                    {"e": "staged", "step": step, "world_size": world, "shard": shard}
                )
                self.announced.add(step)
            self.restoring = step
        self.stats["restored_steps"] += 1
        self.stats["restore_read_seconds"] = time.monotonic() - t0
        _log(self.host, f"putting step {step} back from {root} ({len(taken)} rank(s) here)")

    def _maybe_persist(self, rec: StepRec) -> None:
        """Queue this host's shards of a newly protected step for the disk (caller holds lock)."""
        if self._persister is None or self.persist_root is None:
            return
        if rec.step % self.config.persist_every:
            return
        if persist.step_dir(self.persist_root, self.config.job, rec.step).exists():
            return  # put back from disk: it is there already
        mine = [
            (r, s.buffer, s.meta, s.nbytes) for r, s in rec.shards.items() if s.slot == self.slot
        ]
        for _, name, _, _ in mine:
            self._lease(name, _PERSIST)  # kept past retention until written
        self._persister.submit(self._persist_step, rec.step, rec.world_size, mine)

    def _persist_step(
        self, step: int, world: int, mine: list[tuple[int, str, dict[str, Any], int]]
    ) -> None:
        """Write this host's shards of ``step`` to the partial directory (persister thread)."""
        assert self.persist_root is not None
        _lower_priority()
        t0 = time.monotonic()
        event: dict[str, Any] = {"e": "persisted", "step": step, "world_size": world}
        try:
            partial = persist.partial_dir(self.persist_root, self.config.job, step)
            partial.mkdir(mode=0o700, parents=True, exist_ok=True)
            entries = {}
            written = 0
            for rank, name, meta, nbytes in mine:
                data = self.pool.get(name).file.array[:nbytes]
                entry = persist.write_rank(
                    partial / f"rank-{rank}.safetensors", meta, data, self._yield_to_puts
                )
                entry.update(meta=meta, nbytes=nbytes, host=self.host)
                entries[str(rank)] = entry
                written += int(entry["bytes"])
            event["ranks"] = entries
            self.stats["persist_bytes"] += written
            self.stats["persist_seconds"] += time.monotonic() - t0
        except (OSError, StorageError, KeyError) as exc:
            event = {"e": "persist_failed", "step": step, "error": f"{type(exc).__name__}: {exc}"}
        with self.lock:
            for _, name, _, _ in mine:
                self._unlease(name, _PERSIST)
            self.events.append(event)
            self.wake.set()

    def _yield_to_puts(self) -> None:
        """Hold the disk writer while a trainer on this host is staging a put (at most 2 s at a
        time, so a job that puts back to back still gets its steps written between puts)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with self.lock:
                if not self.pending:
                    return
            time.sleep(0.002)

    def _persist_event(self, event: dict[str, Any]) -> None:
        """Gather persisted ranks; once all are on disk the leader publishes (caller holds lock)."""
        step = int(event["step"])
        if event["e"] == "persist_failed":
            self.persist_acc.pop(step, None)
            _log(self.host, f"step {step} was not persisted: {event.get('error')}")
            if self.rank == 0 and self._persister is not None and self.persist_root is not None:
                partial = persist.partial_dir(self.persist_root, self.config.job, step)
                self._persister.submit(shutil.rmtree, partial, True)
            return
        acc = self.persist_acc.setdefault(step, {"world": int(event["world_size"]), "ranks": {}})
        acc["ranks"].update({int(r): e for r, e in event.get("ranks", {}).items()})
        if len(acc["ranks"]) < acc["world"]:
            return
        del self.persist_acc[step]
        self.stats["persisted_steps"] += 1
        if self.rank == 0 and self._persister is not None:
            self._persister.submit(self._publish, step, acc["world"], acc["ranks"])

    def _publish(self, step: int, world: int, ranks: dict[int, Any]) -> None:
        assert self.persist_root is not None
        try:
            persist.publish(self.persist_root, self.config.job, step, world, ranks)
            gone = persist.prune(self.persist_root, self.config.job, self.config.persist_keep)
            if self.trace:
                _log(self.host, f"step {step} persisted; removed from disk: {gone or 'none'}")
        except OSError as exc:
            _log(self.host, f"publishing step {step} on disk failed: {exc}")

    def _disk_steps(self) -> list[int]:
        if self.persist_root is None:
            return []
        return persist.complete_steps(self.persist_root, self.config.job)

    def _from_disk(self, step: int, rank: int, meta_only: bool) -> dict[str, Any]:
        """Rank ``rank`` of persisted ``step``: read into a temporary file the caller maps."""
        assert self.persist_root is not None
        m = persist.manifest(self.persist_root, self.config.job, step)
        entry = m["ranks"].get(str(rank))
        if entry is None:
            raise StepNotFoundError(
                f"step {step} on disk has no rank {rank} (world_size {m['world_size']})", step
            )
        nbytes = int(entry["nbytes"])
        out = {"step": step, "meta": entry["meta"], "nbytes": nbytes, "tier": "disk"}
        if meta_only:
            return out
        with self.lock:
            self._fetch_seq += 1
            seq = self._fetch_seq
        path = self.dir / "tmp" / f"disk-{os.getpid()}-{seq}"
        try:
            tmp = shm.create(path, max(nbytes, 1), prefault_pages=False)
        except OSError as exc:
            msg = f"no memory to read step {step} rank {rank} from disk: {exc}"
            raise CapacityError(msg) from exc
        try:
            persist.read_rank(
                persist.step_dir(self.persist_root, self.config.job, step), entry, tmp.array
            )
        except StorageError:
            path.unlink(missing_ok=True)
            raise
        finally:
            tmp.close()
        self.stats["disk_reads"] += 1
        return {**out, "path": str(path), "size": max(nbytes, 1), "temp": True}

    def _await_restore(self, step: Any) -> None:
        """A read of the step being put back from disk waits until it is protected again."""
        with self.cond:
            deadline = time.monotonic() + self.config.peer_timeout
            while self.restoring is not None and step in (None, self.restoring):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(f"putting step {self.restoring} back from disk timed out")
                self.cond.wait(min(left, 1.0))

    def _degraded(self, erasures: list[tuple[int, dict[int, Erasures]]]) -> int:
        """Stripes that miss a chunk, over the steps and per-slot erasures given."""
        return sum(
            len(
                recovery.stripe_erasures(
                    self.catalog.steps[step].layouts[g.index],
                    {g.position(sl): er for sl, er in by_slot.items() if sl in g.slots},
                )
            )
            for step, by_slot in erasures
            if step in self.catalog.steps
            for g in self.groups
        )

    def _check_layout(self, layouts: list[dict[str, Any]]) -> None:
        first = layouts[0]
        if any(lay != first for lay in layouts):
            raise ConfigError("hosts hold files of different layouts; wipe the odd ones out")
        want = {
            "hosts": self.nslots,
            "groups": [{"slots": list(g.slots), "k": g.k, "m": g.m} for g in self.groups],
            "chunk_bytes": self.chunk_bytes,
        }
        if first == want:
            return
        if (
            self.config.k is None
            and first["hosts"] == self.nslots
            and first["chunk_bytes"] == self.chunk_bytes
        ):
            g0 = first["groups"][0]
            self.k, self.m = g0["k"], g0["m"]
            self.groups = make_groups(self.nslots, self.k, self.m)
            self.catalog = Catalog(self.groups, self.nslots, self.chunk_bytes, self.config.keep)
            return
        raise ConfigError(
            f"the files under {self.dir.parent} were written by {first['hosts']} hosts with "
            f"groups {[(g['k'], g['m']) for g in first['groups']]} and --chunk-bytes "
            f"{first['chunk_bytes']}; this job runs {self.nslots} hosts with "
            f"{[(g.k, g.m) for g in self.groups]} and --chunk-bytes {self.chunk_bytes}. "
            "Relaunch with the same arguments, or use a new --job (or root) to start afresh."
        )

    def _write_health(self) -> None:
        body = {
            "host": self.host,
            "slot": self.slot,
            "health": self.health,
            "pid": os.getpid(),
            "time": time.time(),
            "rebuilt_chunks": self.stats["rebuilt_chunks"],
            "lost_steps": sorted(s for s, r in self.catalog.steps.items() if r.state == "lost"),
        }
        tmp = self.dir / "health.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.dir / "health.json")

    # -- checking and repairing chunks -------------------------------------------------------------

    def _fault(self, point: str) -> None:
        if faults.ACTIVE:
            faults.hit(point, self.host)

    def _my_layout(self, rec: StepRec) -> tuple[Any, int]:
        g = self.group
        return rec.layouts[g.index], g.position(self.slot)

    def _verify(self, rec: StepRec) -> Erasures:
        """Check this host's chunks of ``rec`` against the manifest's checksums.

        Missing or short files and checksum mismatches are erasures. Adopts files into the pool.
        """
        e = Erasures()
        parity_crc = rec.stored.get(self.slot, {}).get("parity", [])
        for rank in sorted({ref.rank for ref in rec.blobs[self.slot].chunks}):
            e.data.update(self._lost_chunks(rec, rank))
        layout, pos = self._my_layout(rec)
        n = len(layout.parity_stripes[pos])
        if n:
            cb = self.chunk_bytes
            name = rec.parity.get(self.slot)
            buf = self._file(name, n * cb) if name else None
            for i in range(n):
                if (
                    buf is None
                    or i >= len(parity_crc)
                    or checksum(buf.file.array[i * cb : (i + 1) * cb]) != parity_crc[i]
                ):
                    e.parity.add(i)
        if e:
            self.stats["checksum_failures"] += len(e.data) + len(e.parity)
        return e

    def _file(self, name: str, size: int) -> Any:
        """The pool's buffer ``name`` if its file is whole (at least ``size`` bytes), else None."""
        try:
            if self.pool.path(name).stat().st_size < max(size, 1):
                return None  # truncated: never touch the mapping (SIGBUS)
        except OSError:
            return None
        with self.pool.lock:
            buf = self.pool.files.get(name)
        return buf if buf is not None else self.pool.adopt(name, size)

    def _shard_buffer(self, rec: StepRec, rank: int) -> Any:
        shard = rec.shards[rank]
        return self._file(shard.buffer, shard.nbytes)

    def _lost_slots(self, rec: StepRec, erased: dict[int, Erasures]) -> set[int]:
        """The slots with erasures in a group that lost more than m chunks of some stripe."""
        lost: set[int] = set()
        for g in self.groups:
            by_pos = {g.position(s): e for s, e in erased.items() if s in g.slots and e}
            if by_pos and not plan_repair(rec.layouts[g.index], by_pos).recoverable:
                lost |= {s for s, e in erased.items() if s in g.slots and e}
        return lost

    def _repair(self, rec: StepRec, erased: dict[int, Erasures]) -> None:
        """Rebuild the erased chunks of ``rec`` from their stripes (collective: every daemon calls
        this for the same step with the same ``erased``). More than m erasures in any stripe make
        the step lost instead."""
        t0 = time.monotonic()
        lost_slots = self._lost_slots(rec, erased)
        if lost_slots:
            hosts, ranks = recovery.lost_parts(rec, {s: erased[s] for s in lost_slots}, self.hosts)
            rec.state = "lost"
            rec.lost = {"lost_hosts": hosts, "ranks": ranks}
            self.stats["lost_steps"] += 1
            (self.dir / "steps" / f"{rec.step}.json").unlink(missing_ok=True)
            _log(
                self.host,
                f"step {rec.step} cannot be rebuilt: more than m chunks of a stripe "
                f"lost on {hosts} (ranks {ranks})",
            )
            return
        g = self.group
        layout, pos = self._my_layout(rec)
        plan = plan_repair(
            layout, {g.position(s): e for s, e in erased.items() if s in g.slots and e}
        )
        k, cb = g.k, self.chunk_bytes
        rs = self._codec(k, g.m)
        mine = erased.get(self.slot, Erasures())
        # fresh files for what this host lost whole
        changed: dict[str, Any] = {}
        for c in sorted(mine.data):
            rank = rec.blobs[self.slot].chunks[c].rank
            if self._shard_buffer(rec, rank) is None:
                nbytes = rec.shards[rank].nbytes
                buf = self.pool.take(nbytes, f"r{rank}-")
                rec.shards[rank].buffer = buf.name
                changed.setdefault("buffers", {})[str(rank)] = buf.name
        if mine.parity:
            n = len(layout.parity_stripes[pos])
            name = rec.parity.get(self.slot)
            if name is None or self._file(name, n * cb) is None:
                buf = self.pool.take(n * cb, "p")
                rec.parity[self.slot] = buf.name
                changed["parity"] = buf.name
        # Senders wait here without spinning while the rebuilding host makes its files (~0.25 s
        # per 375 MB): busy senders sharing its cores made that 5-10x slower (measured).
        self.links.barrier(f"repair of step {rec.step} (files ready)")
        self._fault("rebuilding")
        # Windows decoded by a second thread while the next one arrives (two sets of receive
        # rows). The senders nap between polls, so the decode has a core to itself (it did not
        # while they spun). A set holds about 64 MiB: a relaunched daemon's rows are fresh
        # pages, faulted in as the bytes arrive. 16 stripes a window instead of 32 (RS(3,1),
        # 1 MiB chunks) rebuilt 1.5 GB in a median 0.73 s instead of 0.81-0.94 s (measured).
        window = max(1, min(self.config.window, _REPAIR_ROWS // ((k + 1) * cb)))
        stripes = sorted(plan.stripes)
        rebuilt = 0
        t_wait = t_dec = 0.0
        t_start = time.monotonic()
        outbox = self._scratch_for("send", window)

        def decode(jobs: list[tuple[int, int, int, dict[int, Any]]], scratch: Any) -> None:
            nonlocal t_dec  # one decode at a time; read after the last one
            t = time.monotonic()
            for s, b, target, avail in jobs:
                dest = self._stripe_chunk(rec, layout, s, target)
                if dest.nbytes == cb:
                    rs.decode_into(avail, {target: dest})
                else:
                    out = scratch[b * (k + 1) + k]
                    rs.decode_into(avail, {target: out})
                    dest[:] = out[: dest.nbytes]
            t_dec += time.monotonic() - t

        decoding: Future[None] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="ecsnap-decode") as decoder:
            for wi, w0 in enumerate(range(0, len(stripes), window)):
                scratch = self._scratch_for(f"repair{wi % 2}", window * (k + 1))
                reqs, jobs = self._post_repair_window(
                    rec, layout, plan, stripes[w0 : w0 + window], scratch, outbox
                )
                tw = time.monotonic()
                try:
                    # a decoding host spins (its polls copy the bytes in); a sender naps
                    self.links.wait(
                        reqs, f"repair of step {rec.step}", busy=bool(jobs), nap=_SENDER_NAP
                    )
                finally:
                    t_wait += time.monotonic() - tw
                    if decoding is not None:
                        decoding.result()  # window i - 1 decoded: its rows are free for i + 1
                        decoding = None
                if jobs:
                    decoding = decoder.submit(decode, jobs, scratch)
                    rebuilt += len(jobs)
                    self.stats["decode_bytes"] += k * cb * len(jobs)
            if decoding is not None:
                decoding.result()
        if self.trace:
            _log(
                self.host,
                f"repair of step {rec.step}: {len(stripes)} stripes, wait "
                f"{t_wait * 1e3:.1f}ms decode {t_dec * 1e3:.1f}ms total "
                f"{(time.monotonic() - t_start) * 1e3:.1f}ms, setup {(t_start - t0) * 1e3:.1f}ms",
            )
        # everyone learns the new file names, and rewrites its manifest
        for r, part in enumerate(self.links.allgather_json(changed, f"repair of {rec.step}")):
            slot = self.slot_of_rank[r]
            for rank, name in part.get("buffers", {}).items():
                rec.shards[int(rank)].buffer = name
            if part.get("parity"):
                rec.parity[slot] = part["parity"]
        if mine:
            # Check what was rebuilt here. Never raise: every daemon ran this repair in step,
            # and one that dies here would take the job down; a reader retries, then fails.
            left = self._verify(rec)
            bad = Erasures(left.data & mine.data, left.parity & mine.parity)
            if bad:
                _log(self.host, f"step {rec.step}: rebuilt chunks fail their checksums: {bad}")
        self.stats["rebuilt_chunks"] += rebuilt
        self.stats["rebuilds"] += 1
        self.stats["rebuild_seconds"] += time.monotonic() - t0
        self.metrics.rebuild.observe(time.monotonic() - t0)
        loc = self.local.get(rec.step)
        if loc is not None:
            loc.buffers = {r: s.buffer for r, s in rec.shards.items() if s.slot == self.slot}
            loc.parity = rec.parity.get(self.slot)
            if rec.state == "protected":
                self._write_manifest(rec, loc)

    def _post_repair_window(
        self, rec: StepRec, layout: Any, plan: Any, batch: list[int], scratch: Any, outbox: Any
    ) -> tuple[list[Any], list[tuple[int, int, int, dict[int, Any]]]]:
        """Post this host's sends (staged in ``outbox``, a row per stripe) and receives (into
        ``scratch``, k + 1 rows per stripe) of one repair window; return the requests and the
        decodes that fall to it (stripe, row, erased index, available chunks by index)."""
        g = self.group
        pos = g.position(self.slot)
        k, cb = g.k, self.chunk_bytes
        reqs: list[Any] = []
        jobs = []
        for b, s in enumerate(batch):
            erased_idx, sources = plan.stripes[s]
            decoders = sorted({holder(layout, s, e) for e in erased_idx})
            staged = None
            for d in decoders:
                avail: dict[int, Any] = {}
                for a_i, a in enumerate(sources):
                    h = holder(layout, s, a)
                    view = None
                    if a < k and layout.data_chunk(s, a) is None:
                        if d == pos:
                            avail[a] = zeros(cb)
                        continue
                    if h == pos:
                        view = self._stripe_chunk(rec, layout, s, a)
                    if d == pos:
                        row = scratch[b * (k + 1) + a_i]
                        if h == pos:
                            assert view is not None
                            if view.nbytes == cb:
                                row = view  # whole: decode from the file in place
                            else:
                                row[: view.nbytes] = view
                                row[view.nbytes :] = 0
                        else:
                            length = self._chunk_length(rec, layout, s, a)
                            row[length:] = 0
                            reqs += self.links.irecv(
                                row[:length], self.rank_of[g.slots[h]], TAG_REPAIR
                            )
                        avail[a] = row
                    elif h == pos:
                        assert view is not None
                        if staged is None:
                            staged = outbox[b, : view.nbytes]
                            staged[:] = view
                        reqs += self.links.isend(staged, self.rank_of[g.slots[d]], TAG_REPAIR)
                if d == pos:
                    target = next(e for e in erased_idx if holder(layout, s, e) == pos)
                    jobs.append((s, b, target, avail))
        return reqs, jobs

    def _chunk_length(self, rec: StepRec, layout: Any, s: int, index: int) -> int:
        if index >= layout.k:
            return self.chunk_bytes
        c = layout.data_chunk(s, index)
        p = layout.data_position(s, index)
        return int(rec.blobs[layout.group.slots[p]].chunks[c].length)

    def _stripe_chunk(self, rec: StepRec, layout: Any, s: int, index: int) -> Any:
        """This host's bytes of chunk ``index`` of stripe ``s`` (a view into its file)."""
        cb = self.chunk_bytes
        pos = layout.group.position(self.slot)
        if index >= layout.k:
            slot_i = layout.parity_slot(pos, s)
            name = rec.parity[self.slot]
            return self.pool.get(name).file.array[slot_i * cb : (slot_i + 1) * cb]
        c = layout.data_chunk(s, index)
        ref = rec.blobs[self.slot].chunks[c]
        buf = self.pool.get(rec.shards[ref.rank].buffer)
        return buf.file.array[ref.offset : ref.offset + ref.length]

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
                self.rounds += 1
                for r, payload in enumerate(everyone):
                    slot = self.slot_of_rank[r]
                    for event in payload["ev"]:
                        kind = event.get("e")
                        if kind == "fetch":
                            self.fetches.append(event)
                            continue
                        if kind == "repair":
                            self.repairs.append(event)
                            continue
                        if kind in ("persisted", "persist_failed"):
                            self._persist_event(event)
                            continue
                        old = None
                        if kind == "staged":
                            rec = self.catalog.steps.get(int(event["step"]))
                            if rec is not None and rec.state == "staging":
                                old = rec.shards.get(int(event["shard"]["rank"]))
                            elif rec is not None and rec.state == "lost":
                                self._forget(rec.step)  # put afresh: the lost one's files go
                        self.catalog.apply(slot, event)
                        if old is not None and old.slot == self.slot:
                            self._drop_shard(int(event["step"]), old.rank, old.buffer)
                        if kind == "staged" and slot == self.slot:
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
            return (
                bool(self.events)
                or bool(self.deferred_repairs)
                or any(r.state in ("ready", "encoding") for r in self.catalog.steps.values())
            )

    def _advance(self) -> None:
        for rec in sorted(self.catalog.steps.values(), key=lambda r: r.step):
            loc = self.local.setdefault(rec.step, _Local())
            if rec.state == "ready" and not loc.prepared:
                self._prepare(rec, loc)
            elif rec.state == "encoding" and not loc.stored:
                self._exchange(rec, loc)
        self._serve_repairs()
        self._serve_fetches()
        with self.cond:
            for rec in list(self.catalog.steps.values()):
                loc = self.local[rec.step]
                if rec.state == "protected" and not loc.manifest:
                    self._fault("committing")
                    self._write_manifest(rec, loc)
                    self._maybe_persist(rec)
                    self.stats["steps_protected"] += 1
                    now = time.monotonic()
                    for rank in loc.buffers:
                        t_alloc = self.t_alloc.pop((rec.step, rank), None)
                        if t_alloc is not None:
                            self.metrics.protect.observe(now - t_alloc)
                    loc.t["protected"] = time.monotonic()
                    if self.trace:
                        t0 = loc.t.get("staged", loc.t.get("ready", 0.0))
                        phases = " ".join(f"{k}=+{(v - t0) * 1e3:.1f}ms" for k, v in loc.t.items())
                        _log(self.host, f"step {rec.step}: {phases}")
                if rec.state == "failed":
                    self._forget(rec.step)
            if self.restoring is not None:
                rec_r = self.catalog.steps.get(self.restoring)
                if rec_r is None or rec_r.state in ("protected", "failed", "lost"):
                    self.restoring = None
            for step in [s for s in self.local if s not in self.catalog.steps]:
                self._forget(step)  # deleted, or evicted by retention
            self.cond.notify_all()

    def _drop_shard(self, step: int, rank: int, buffer: str) -> None:
        """A rank put this unfinished step again: its earlier shard's buffer goes back."""
        loc = self.local.get(step)
        if loc is not None and loc.buffers.get(rank) == buffer:
            del loc.buffers[rank]
        self.pool.release(buffer)

    def _forget(self, step: int) -> None:
        """Give this host's files of ``step`` back to the pool (caller holds the lock)."""
        self.announced.discard(step)
        for key in [key for key in self.t_alloc if key[0] == step]:
            del self.t_alloc[key]
        loc = self.local.pop(step, None)

        if loc is not None:
            for name in loc.buffers.values():
                if self.leases.get(name):
                    self.deferred.add(name)  # a trainer still holds views of it
                else:
                    self.pool.release(name)
            self.pool.release(loc.parity)
        rec = self.catalog.steps.get(step)
        if rec is not None and rec.state == "failed":
            self.catalog.steps.pop(step, None)
            self._failed[step] = rec.error or "failed"
        (self.dir / "steps" / f"{step}.json").unlink(missing_ok=True)

    def _prepare(self, rec: StepRec, loc: _Local) -> None:
        """Reserve parity memory, start checksumming this host's data chunks; report next round.

        The checksums run on a helper thread (ISA-L's CRC drops the GIL) while the exchange moves
        the same bytes; ``stored`` waits for them.
        """
        loc.prepared = True
        loc.t["ready"] = time.monotonic()
        layout, pos = self._my_layout(rec)
        nparity = len(layout.parity_stripes[pos])
        error = None
        try:
            buf = self.pool.take(nparity * self.chunk_bytes, "p")
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

    def _scratch_for(self, purpose: str, rows: int) -> np.ndarray[Any, Any]:
        """Reused private (anonymous) rows of one chunk each, one set per ``purpose``.

        Sends go out of these rows, not straight from the shared-memory files: MPICH moves a
        message out of anonymous memory 1.7-3x faster than out of a tmpfs mapping (measured with
        4 ranks fanning in 1 MiB messages: 2.3 GB/s from the file, 4.0 with the copy, 6.4 anon),
        so the extra copy pays for itself.
        """
        key = (purpose, rows, self.chunk_bytes)
        s = self._scratch.get(key)
        if s is None:
            s = np.zeros((rows, self.chunk_bytes), dtype=np.uint8)
            self._scratch[key] = s
        return s

    def _exchange(self, rec: StepRec, loc: _Local) -> None:
        """Send data chunks to their stripes' encoders, encode, forward parity, window by window.

        Every daemon of the group runs this in the same round. Pairs of daemons post their messages
        in stripe order, so MPI's non-overtaking rule matches them without per-stripe tags.
        """
        loc.stored = True
        loc.t["exchange"] = time.monotonic()
        self._fault("encoding")
        g = self.group
        layout, pos = self._my_layout(rec)
        k, m, cb = g.k, g.m, self.chunk_bytes
        rank_at = [self.rank_of[s] for s in g.slots]  # group position -> MPI rank
        rs = self._codec(k, m)
        parity = self.pool.get(loc.parity).file.array if loc.parity else None
        window = self.config.window
        data_scratch = self._scratch_for("data", window * k)
        out_scratch = self._scratch_for("out", window * max(m - 1, 1) + 1)
        outbox = self._scratch_for("send", window)
        blobs = {p: rec.blobs[g.slots[p]] for p in range(layout.n)}
        replicate = k == 1  # no encoding: the data host sends its chunk to every copy holder
        t_encode = 0.0

        def receive_data(s: int, j: int, dst: np.ndarray[Any, Any]) -> list[Any]:
            """Post the receive of stripe s's data chunk j into ``dst``; zero its virtual pad."""
            dpos, c = layout.data_position(s, j), layout.data_chunk(s, j)
            length = 0 if c is None else blobs[dpos].chunks[c].length
            dst[length:] = 0
            return self.links.irecv(dst[:length], rank_at[dpos], TAG_DATA) if length else []

        def parity_row(s: int) -> np.ndarray[Any, Any]:
            """This host's parity (or copy) chunk of stripe s."""
            assert parity is not None
            i = layout.parity_slot(pos, s)
            return parity[i * cb : (i + 1) * cb]

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
                            view = self._chunk_view(rec, c)
                            row = outbox[s - w0, : view.nbytes]
                            row[:] = view
                            for to in ppos if replicate else (encoder,):
                                data_reqs += self.links.isend(row, rank_at[to], TAG_DATA)
                if replicate:
                    # RS(1, m) keeps copies: each copy holder receives the chunk in place
                    if pos in ppos and parity is not None:
                        data_reqs += receive_data(s, 0, parity_row(s))
                elif encoder == pos:
                    mine_to_encode.append(s)
                    row0 = (s - w0) * k
                    for j in range(k):
                        data_reqs += receive_data(s, j, data_scratch[row0 + j])
                elif pos in ppos and parity is not None:
                    parity_reqs += self.links.irecv(parity_row(s), rank_at[encoder], TAG_PARITY)
            if w0 == 0:
                self._fault("sending")
            self.links.wait(data_reqs, f"data exchange of step {rec.step}", busy=True)
            for s in mine_to_encode:
                row0 = (s - w0) * k
                outs = [parity_row(s)]
                for i in range(1, m):
                    outs.append(out_scratch[(s - w0) * (m - 1) + i - 1])
                t0 = time.perf_counter()
                rs.encode_into([data_scratch[row0 + j] for j in range(k)], outs)
                t_encode += time.perf_counter() - t0
                ppos = layout.parity_positions(s)
                for i in range(1, m):
                    parity_reqs += self.links.isend(outs[i], rank_at[ppos[i]], TAG_PARITY)
            self.links.wait(parity_reqs, f"parity exchange of step {rec.step}", busy=True)
        encoded_stripes = (
            0
            if replicate
            else sum(1 for s in range(layout.stripes) if layout.parity_positions(s)[0] == pos)
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
                    "parity": loc.parity,
                    "crc": {"data": loc.data_crc, "parity": loc.parity_crc},
                }
            )

    def _serve_repairs(self) -> None:
        """Repair chunks a read found bad (every daemon runs the same repairs, in order)."""
        with self.lock:
            repairs, self.repairs = self.repairs, []
        if self.deferred_repairs and not repairs:
            # one older step per round, so puts and reads go on between rebuilds
            step, erased = self.deferred_repairs.pop(0)
            rec = self.catalog.steps.get(step)
            if rec is not None and rec.state == "protected":
                try:
                    self._repair(rec, erased)
                except CapacityError as exc:
                    _log(self.host, f"rebuild of step {step} failed: {exc}")
            self._deferred_changed()
        for r in repairs:
            rec = self.catalog.steps.get(int(r["step"]))
            if rec is None or rec.state != "protected":
                continue
            wanted = {int(r["slot"]): Erasures.from_json(r)}
            # A read found chunks of a step whose start-up rebuild is still queued: rebuild all
            # of it now (the read's chunks and whatever else the loss took), once.
            for i, (step, erased) in enumerate(self.deferred_repairs):
                if step == rec.step:
                    del self.deferred_repairs[i]
                    for slot, e in erased.items():
                        w = wanted.setdefault(slot, Erasures())
                        w.data |= e.data
                        w.parity |= e.parity
                    self._deferred_changed()
                    break
            try:
                self._repair(rec, wanted)
            except CapacityError as exc:
                _log(self.host, f"repair of step {rec.step} failed: {exc}")
        if repairs:
            with self.cond:
                self.repairs_done |= {str(r["id"]) for r in repairs if "id" in r}
                self.cond.notify_all()

    def _deferred_changed(self) -> None:
        self.degraded_stripes = self._degraded(self.deferred_repairs)
        if not self.deferred_repairs:
            self.health = "healthy"
            self.missing_slots = set()
        self._write_health()

    def _serve_fetches(self) -> None:
        """Move shards to the hosts that asked for them (a rank read from another host)."""
        with self.lock:
            fetches, self.fetches = self.fetches, []
        for f in fetches:
            rec = self.catalog.steps.get(int(f["step"]))
            to = int(f["to"])
            if rec is None or rec.state != "protected" or int(f["rank"]) not in rec.shards:
                if to == self.slot:
                    self._fetch_finish(f["id"], {"error": "gone"})
                continue
            shard = rec.shards[int(f["rank"])]
            if shard.slot == self.slot and to != self.slot:
                view = self.pool.get(shard.buffer).file.array[: shard.nbytes]
                self.links.wait(
                    self.links.isend(view, self.rank_of[to], TAG_FETCH),
                    "shard fetch (send)",
                    busy=True,
                )
            elif to == self.slot:
                src = self.rank_of[shard.slot]
                path = self.dir / "tmp" / f"fetch-{f['id']}"
                try:
                    tmp = shm.create(path, max(shard.nbytes, 1), prefault_pages=False)
                except OSError as exc:
                    # the holder sends regardless: drain it into scratch so MPI stays in step
                    sink = np.empty(shard.nbytes, dtype=np.uint8)
                    self.links.wait(
                        self.links.irecv(sink, src, TAG_FETCH), "shard fetch", busy=True
                    )
                    error = f"no memory for the fetched shard: {exc}"
                    self._fetch_finish(f["id"], {"error": error})
                    continue
                self.links.wait(
                    self.links.irecv(tmp.array[: shard.nbytes], src, TAG_FETCH),
                    "shard fetch (receive)",
                    busy=True,
                )
                bad = self._bad_chunks(rec, shard.rank, tmp.array)
                tmp.close()
                result: dict[str, Any] = {"path": str(path), "size": max(shard.nbytes, 1)}
                if bad:
                    self.stats["checksum_failures"] += len(bad)
                    path.unlink(missing_ok=True)
                    result = {"bad": bad, "slot": shard.slot}
                self._fetch_finish(f["id"], result)

    def _lost_chunks(self, rec: StepRec, rank: int) -> list[int]:
        """Blob chunk indexes of ``rank``'s shard here that are missing or fail their checksum."""
        buf = self._shard_buffer(rec, rank)
        if buf is None:
            return [c for c, ref in enumerate(rec.blobs[self.slot].chunks) if ref.rank == rank]
        return self._bad_chunks(rec, rank, buf.file.array)

    def _bad_chunks(self, rec: StepRec, rank: int, data: np.ndarray[Any, Any]) -> list[int]:
        """Blob chunk indexes of ``rank``'s shard (bytes in ``data``) that fail their checksum."""
        shard = rec.shards[rank]
        crc = rec.stored.get(shard.slot, {}).get("data", [])
        bad = []
        for c, ref in enumerate(rec.blobs[shard.slot].chunks):
            if ref.rank == rank and (
                c >= len(crc) or checksum(data[ref.offset : ref.offset + ref.length]) != crc[c]
            ):
                bad.append(c)
        return bad

    def _fetch_finish(self, fid: str, result: dict[str, Any]) -> None:
        with self.cond:
            self.fetch_done[fid] = result
            self.cond.notify_all()

    def _write_manifest(self, rec: StepRec, loc: _Local) -> None:
        loc.manifest = True
        manifest = recovery.manifest_of(rec, self.catalog, self.config.job, self.hosts)
        recovery.write_manifest(self.dir / "steps" / f"{rec.step}.json", manifest)

    # -- trainer requests (control-socket threads) ------------------------------------------------

    def _handle(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any] | None:
        op = msg.get("op")
        msg["_conn"] = id(conn)
        try:
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise StorageError(f"unknown request {op!r}")
            reply: dict[str, Any] = handler(msg)
            reply.setdefault("ok", True)
            return reply
        except StorageError as exc:
            self._count_error(exc)
            return to_wire(exc)
        except (KeyError, TypeError, ValueError) as exc:
            err = StorageError(f"bad request {op!r}: {exc!r}")
            self._count_error(err)
            return to_wire(err)

    def _count_error(self, exc: StorageError) -> None:
        with self.lock:
            kind = type(exc).__name__
            self.errors[kind] = self.errors.get(kind, 0) + 1
            self.last_error = f"{kind}: {exc}"

    def _op_hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("job") != self.config.job:
            raise StorageError(
                f"this daemon serves job {self.config.job!r}, not {msg.get('job')!r}"
            )
        return {
            "host": self.host,
            "slot": self.slot,
            "hosts": self.hosts,
            "health": self.health,
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
        self._fault("staging")
        step, rank = self._int(msg, "step"), self._int(msg, "rank")
        world, nbytes = self._int(msg, "world_size", 1), self._int(msg, "nbytes")
        if rank >= world:
            raise StorageError(f"rank {rank} is not below world_size {world}")
        with self.lock:
            rec = self.catalog.steps.get(step)
            # A rank may put an unfinished step again (a restarted trainer redoing it): its new
            # shard replaces the old one. Once every rank has staged it, the step is written.
            if rec is not None and rec.state not in ("staging", "lost"):
                raise StepExistsError(
                    f"step {step} was already put by every rank (it is {rec.state}; steps are "
                    "write-once); delete it first or put a new step"
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
                self.pending_conn.pop((step, rank), None)
            raise
        with self.lock:
            self.pending[(step, rank)] = buf.name
            self.pending_conn[(step, rank)] = int(msg["_conn"])
            self.t_alloc[(step, rank)] = time.monotonic()
        return {"buffer": buf.name, "path": str(self.pool.path(buf.name)), "size": buf.size}

    def _op_staged(self, msg: dict[str, Any]) -> dict[str, Any]:
        step, rank = self._int(msg, "step"), self._int(msg, "rank")
        with self.lock:
            name = self.pending.pop((step, rank), None)
            self.pending_conn.pop((step, rank), None)
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
            t_alloc = self.t_alloc.get((step, rank))
            if t_alloc is not None:
                self.metrics.stage.observe(time.monotonic() - t_alloc)
            self.events.append(
                {"e": "staged", "step": step, "world_size": msg["world_size"], "shard": shard}
            )
            self.wake.set()
        return {}

    def _op_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        step, rank = self._int(msg, "step"), self._int(msg, "rank")
        with self.lock:
            name = self.pending.pop((step, rank), None)
            self.pending_conn.pop((step, rank), None)
        self.pool.release(name or None)
        return {}

    def _op_wait(self, msg: dict[str, Any]) -> dict[str, Any]:
        step = self._int(msg, "step")
        timeout = float(msg.get("timeout") or self.config.peer_timeout)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                rec = self.catalog.steps.get(step)
                if (rec is not None and rec.state == "protected") or (
                    step in self.catalog.recently_protected and step not in self.announced
                ):
                    self._after_next_round()  # every host has written its manifest
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
                lost = [s for s, r in self.catalog.steps.items() if r.state == "lost"]
                if latest is None and lost:
                    step = max(lost)  # nothing can be read: say what was lost
                elif latest is None:
                    raise StepNotFoundError("no protected step yet", None)
                else:
                    step = latest
            if type(step) is not int or step < 0:
                raise StorageError(f"step must be an int >= 0 or None, got {step!r}")
            rec = self.catalog.steps.get(step)
            if rec is not None and rec.state == "lost":
                newest = self.catalog.latest()
                raise SnapshotUnrecoverableError(
                    f"step {step} cannot be rebuilt: hosts {rec.lost['lost_hosts']} lost more "
                    f"than m={self.m} chunks of a stripe, so ranks {rec.lost['ranks']} are gone. "
                    + (
                        f"The newest step that can be read is {newest}: get(None) returns it."
                        if newest is not None
                        else "No step can be read from memory."
                    ),
                    lost_hosts=rec.lost["lost_hosts"],
                    ranks=rec.lost["ranks"],
                    newest_recoverable=newest,
                    step=step,
                )
            if rec is None or rec.state != "protected":
                held = self.catalog.protected()
                raise StepNotFoundError(
                    f"step {step} is not protected on job {self.config.job!r} "
                    f"(protected steps: {held or 'none'})",
                    step,
                )
            return rec

    def _op_get(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A shard: from this host's memory (checked), or fetched from the host holding it.

        A chunk that fails its checksum (or a truncated file) is repaired from its group by all
        daemons in the next round, and the read tried again.
        """
        rank = self._int(msg, "rank")
        self._await_restore(msg.get("step"))
        for _attempt in range(3):
            disk = self._disk_steps()
            want = msg.get("step")
            if want is None and disk:
                with self.lock:
                    latest = self.catalog.latest()
                if latest is None or disk[-1] > latest:
                    return self._from_disk(disk[-1], rank, bool(msg.get("meta_only")))
            try:
                rec = self._resolve(want)
            except (StepNotFoundError, SnapshotUnrecoverableError):
                if want in disk:  # memory cannot serve it: the persistent tier can
                    return self._from_disk(int(want), rank, bool(msg.get("meta_only")))
                raise
            shard = rec.shards.get(rank)
            if shard is None:
                raise StepNotFoundError(
                    f"step {rec.step} has no rank {rank} (world_size {rec.world_size})", rec.step
                )
            out = {"step": rec.step, "meta": shard.meta, "nbytes": shard.nbytes}
            if msg.get("meta_only"):
                return out  # the structure only: every daemon's catalog holds it
            if shard.slot == self.slot:
                bad = self._lost_chunks(rec, rank)
                if not bad:
                    with self.lock:
                        self._lease(shard.buffer, int(msg["_conn"]))
                    return {
                        **out,
                        "path": str(self.pool.path(shard.buffer)),
                        "size": self.pool.get(shard.buffer).size,
                        "buffer": shard.buffer,
                        "temp": False,
                    }
                self.stats["checksum_failures"] += len(bad)
                _log(
                    self.host,
                    f"step {rec.step} rank {rank}: {len(bad)} chunk(s) fail their "
                    "checksum here; repairing from the group",
                )
                self._repair_and_wait(rec.step, self.slot, bad)
                continue
            result = self._fetch(rec, rank)
            if "bad" in result:
                self._repair_and_wait(rec.step, int(result["slot"]), result["bad"])
                continue
            return {**out, "path": result["path"], "size": result["size"], "temp": True}
        raise StorageError(
            f"step {msg.get('step')} rank {rank}: chunks still fail their checksums after repair"
        )

    def _fetch(self, rec: StepRec, rank: int) -> dict[str, Any]:
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
        return result

    def _repair_and_wait(self, step: int, slot: int, data: list[int]) -> None:
        with self.cond:
            self._fetch_seq += 1
            rid = f"r{self.slot}-{os.getpid()}-{self._fetch_seq}"
            self.events.append(
                {"e": "repair", "id": rid, "step": step, "slot": slot, "data": data, "parity": []}
            )
            self.wake.set()
            deadline = time.monotonic() + self.config.peer_timeout
            while rid not in self.repairs_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(f"repair of step {step} timed out")
                self.cond.wait(min(left, 1.0))
            self.repairs_done.discard(rid)

    def _op_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        path = Path(str(msg.get("path")))
        if path.parent != self.dir / "tmp":
            raise StorageError(f"{path} is not a temporary file of this daemon")
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return {}

    def _op_unlease(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The views of one get of each named buffer are gone (a name once per get; the buffer
        may be reused when every lease on it has ended)."""
        with self.lock:
            for name in msg.get("buffers", []):
                self._unlease(str(name), int(msg["_conn"]))
        return {}

    def _lease(self, name: str, holder: int) -> None:
        holders = self.leases.setdefault(name, {})
        holders[holder] = holders.get(holder, 0) + 1

    def _unlease(self, name: str, holder: int, every: bool = False) -> None:
        """One of ``holder``'s leases on ``name`` ends (``every``: all of them)."""
        holders = self.leases.get(name)
        if holders is not None and holder in holders:
            holders[holder] -= 1
            if every or not holders[holder]:
                del holders[holder]
            if not holders:
                del self.leases[name]
                if name in self.deferred:
                    self.deferred.discard(name)
                    self.pool.release(name)

    def _closed_conn(self, conn: Connection) -> None:
        """A trainer went away: its views went with it, and so did the puts it was staging."""
        with self.lock:
            for name in [n for n, h in self.leases.items() if id(conn) in h]:
                self._unlease(name, id(conn), every=True)
            for key in [k for k, c in self.pending_conn.items() if c == id(conn)]:
                del self.pending_conn[key]
                name = self.pending.pop(key, "")
                self.t_alloc.pop(key, None)
                if name:
                    self.pool.release(name)

    def _op_steps(self, msg: dict[str, Any]) -> dict[str, Any]:
        disk = self._disk_steps()
        with self.lock:
            return {"steps": self.catalog.protected(), "disk": disk}

    def _op_status(self, msg: dict[str, Any]) -> dict[str, Any]:
        step = self._int(msg, "step")
        with self.lock:
            rec = self.catalog.steps.get(step)
            if rec is None and step in self._disk_steps():
                assert self.persist_root is not None
                m = persist.manifest(self.persist_root, self.config.job, step)
                return {
                    "step": step,
                    "world_size": m["world_size"],
                    "state": "persisted",
                    "ranks_staged": sorted(int(r) for r in m["ranks"]),
                    "hosts": sorted({e["host"] for e in m["ranks"].values()}),
                    "data_bytes": sum(int(e["nbytes"]) for e in m["ranks"].values()),
                    "parity_bytes": 0,
                }
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
            if step in self.catalog.steps:
                raise StorageError(f"deleting step {step} timed out")
            self._after_next_round()  # every host has removed its manifest: a restart agrees
        return {}

    def _after_next_round(self) -> None:
        """Wait (holding ``self.cond``) until the round after the current one completes.

        Every daemon applies a round's events and then does that round's local work (manifests
        written or removed) before it joins the next round, so when the next one completes, a
        change seen now is on every host's files: acknowledging protection or deletion only then
        means a storage job killed right after cannot bring back a deleted step or lose one its
        trainers were told is protected."""
        target = self.rounds + 1
        self.wake.set()
        deadline = time.monotonic() + self.config.peer_timeout
        while self.rounds < target:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageError("the storage job did not complete a round in time")
            self.cond.wait(min(left, 0.05))

    def _op_info(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Counters for benchmarks and status: bytes held and moved, health, repairs."""
        return self.metrics_snapshot()

    def metrics_snapshot(self) -> dict[str, Any]:
        """Everything status and metrics report, read under the lock (cheap: no I/O)."""
        with self.lock:
            data = parity = 0
            for r in self.catalog.steps.values():
                if r.state != "protected":
                    continue
                data += sum(s.nbytes for s in r.shards.values() if s.slot == self.slot)
                layout, pos = self._my_layout(r)
                parity += len(layout.parity_stripes[pos]) * self.chunk_bytes
            return {
                "job": self.config.job,
                "host": self.host,
                "slot": self.slot,
                "hosts": self.hosts,
                "k": self.group.k,
                "m": self.group.m,
                "health": self.health,
                "latest": self.catalog.latest(),
                "data_bytes": data,
                "parity_bytes": parity,
                "pool_bytes": self.pool.used,
                "memory_budget": self.config.memory_budget,
                "sent_bytes": self.links.counters.sent,
                "received_bytes": self.links.counters.received,
                "stats": dict(self.stats),
                "protected": self.catalog.protected(),
                "in_flight": sorted(
                    s
                    for s, r in self.catalog.steps.items()
                    if r.state in ("staging", "ready", "encoding")
                ),
                "lost": {
                    str(s): r.lost for s, r in self.catalog.steps.items() if r.state == "lost"
                },
                "errors": dict(self.errors),
                "last_error": self.last_error,
                "degraded_stripes": self.degraded_stripes,
                "hosts_up": self.nslots,
                "hosts_missing": len(self.missing_slots),
                "metrics_port": self.metrics.port,
                "persist_dir": str(self.persist_root) if self.persist_root else None,
                "persisted": self._disk_steps(),
            }

    def close(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
        self.metrics.close()
        for rs in self._codecs.values():
            rs.close()
        self._crc_pool.shutdown(wait=True)
        if self._persister is not None:
            self._persister.shutdown(wait=True)


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
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics here (virtual host i: PORT+i; 0: a free port)",
    )
    p.add_argument("--metrics-addr", default="0.0.0.0")
    p.add_argument("--peer-timeout", type=float, default=120.0)
    p.add_argument(
        "--persist-dir",
        default=None,
        help="persistent tier: protected steps also go to DIR/<job>/step-<step>/ (safetensors)",
    )
    p.add_argument(
        "--persist-every", type=int, default=0, help="persist steps that are multiples of N"
    )
    p.add_argument("--persist-keep", type=int, default=2, help="persisted steps kept on disk")
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
        metrics_addr=a.metrics_addr,
        peer_timeout=a.peer_timeout,
        persist_dir=Path(a.persist_dir).resolve() if a.persist_dir else None,
        persist_every=a.persist_every,
        persist_keep=a.persist_keep,
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
