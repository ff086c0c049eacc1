"""What one daemon is and holds: the per-host state that every module of the daemon shares.

:class:`Host` is made once per daemon (by :class:`storage.daemon.Daemon`) and handed to each of
its modules; none of them holds state the others need. It owns:

- who this daemon is: host name, MPI rank, slot, the slot of every rank, the groups;
- the host directory, its shared-memory :class:`~storage.pool.Pool`, its MPI links to the whole
  job (``links``) and to its group alone (``glinks``: group rank = position in the group);
- the catalog (written by the round engine alone, read by every thread under ``lock``), what this
  host holds of each step (:class:`Local`), the events waiting for the next round, counters
  and the CPU clock (``cpu``, :mod:`storage.cpu`);
- ``lock`` (re-entrant) and ``cond`` on it: every field above that changes after start-up is read
  and written under it. Blocking I/O (MPI, the disk) never runs under it.

It also gives the modules their common access to chunk bytes (views into this host's files) and
the one wait helper, :meth:`Host.wait_for`, whose timeout is a :class:`StorageTimeoutError`.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from codec import RSCodec
from storage import discovery, recovery
from storage.catalog import Catalog, StepRec, StepState
from storage.config import ServeConfig, host_dir
from storage.cpu import Clock
from storage.errors import ConfigError, PeerUnreachableError, StorageTimeoutError
from storage.faults import Hooks
from storage.metrics import Latencies
from storage.placement import Group, StripeLayout, default_km, make_groups
from storage.pool import Buffer, Pool
from storage.protocol import Event, ShardRecord
from storage.table import unpack_table
from transport.mpi import Links

__all__ = ["Host", "Local", "log"]


def _populated(shape: tuple[int, int]) -> np.ndarray[Any, Any]:
    """A private anonymous mapping of ``shape`` bytes, every page faulted in by the kernel."""
    n = max(1, shape[0] * shape[1])
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    flags |= getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, n, flags=flags), dtype=np.uint8)[
        : shape[0] * shape[1]
    ].reshape(shape)


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def _process_start() -> int | None:
    """This process's start time in clock ticks since boot (/proc/self/stat field 22): with
    the pid, it tells this process apart from a later one given the same pid."""
    fields = discovery.process_stat("self")
    return None if fields is None else int(fields[19])


def log(host: str, msg: str) -> None:
    """One whole line on stderr, from any thread or process (a single write of the line)."""
    os.write(sys.stderr.fileno(), f"ecsnap[{host}] {msg}\n".encode())


_PID_START = _process_start()


@dataclass
class Local:
    """What this host holds of one step (never replicated)."""

    buffers: dict[int, str] = field(default_factory=dict)  # rank -> buffer name (my shards)
    parity: str | None = None
    prepared: bool = False
    stored: bool = False
    manifest: bool = False
    pinned_manifest: bool = False  # the manifest says the step is pinned
    data_crc: list[int] = field(default_factory=list)
    crc_job: Any = None  # Future[list[int]] of the data checksums, while they run
    parity_crc: list[int] = field(default_factory=list)
    t: dict[str, float] = field(default_factory=dict)  # phase -> monotonic time, for tracing


STATS = (
    "encode_bytes",
    "encode_seconds",
    "decode_bytes",
    "steps_protected",
    "checksum_failures",  # chunks or manifests whose bytes were there but wrong
    "missing_chunks",  # chunks whose file was gone or short (a lost or replaced host)
    "rebuilds",
    "rebuild_seconds",
    "startup_rebuild_seconds",  # the part done before serving: the newest step
    "rebuilt_chunks",
    "adopted_steps",
    "lost_steps",
    "persisted_steps",  # published on disk (every daemon counts them)
    "persist_bytes",  # written by this daemon
    "persist_seconds",
    "restored_steps",  # put back into memory from disk at start-up
    "restore_read_seconds",  # ... reading its files (then the rounds protect it)
    "disk_reads",  # shards served straight from disk
    "reserve_bytes",  # pre-faulted at start for --reserve (set once that is done)
    "warm_files",  # files made ahead of need for the next puts (storage.warm)
    "warm_bytes",
    "staged_bytes",  # bytes of the shards trainers staged here (copied into shared memory)
    "referenced_bytes",  # bytes of their tensors stored as references to a base step instead
)


class Host:
    """One host's daemon state; see the module docstring for what it owns and its lock."""

    def __init__(self, config: ServeConfig, comm: Any, hooks: Hooks) -> None:
        self.config = config
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.nslots: int = comm.Get_size()
        vh = config.virtual_hosts
        if vh is None:
            self.name = socket.gethostname().split(".")[0]
        elif vh:
            if len(vh) != self.nslots:
                raise ConfigError(
                    f"--virtual-hosts names {len(vh)} hosts but {self.nslots} daemons run"
                )
            self.name = vh[self.rank]
        else:
            self.name = f"host{self.rank}"
        if config.k is None or config.m is None:
            self.k, self.m = default_km(self.nslots)
            shrink = True  # the layout ecsnap picks may shrink its last group
        else:
            self.k, self.m = config.k, config.m
            shrink = config.shrink_last_group
        self.groups: list[Group] = make_groups(self.nslots, self.k, self.m, shrink)
        self.chunk_bytes = config.largest_chunk
        self.slot = self.rank  # until adoption says otherwise
        self.rank_of: list[int] = list(range(self.nslots))  # slot -> MPI rank
        self.slot_of_rank: list[int] = list(range(self.nslots))
        self.hosts: list[str] = []  # by slot
        self.dir = host_dir(config.root, config.job, self.name)
        self.hooks = hooks
        self.cpu = Clock()  # CPU seconds by phase (storage.cpu)
        self.pool: Pool = hooks.make_pool(self.dir, config.memory_budget)
        self.pool.clock = self.cpu
        self.links = hooks.make_links(comm, config.peer_timeout, self.name)
        self.links.name = "job"
        self.links.clock = self.cpu
        self.catalog = Catalog(self.groups, self.nslots, self.chunk_bytes, config.keep)
        self.local: dict[int, Local] = {}
        self.events: list[Event] = []  # this host's events for the next round
        self.glinks: Links | None = None  # the group's links, once the slot is known
        self.manifest_bytes: dict[int, int] = {}  # step -> bytes of its manifest here
        self.announced: set[int] = set()  # steps with a shard staged here, until forgotten
        self.pending: dict[tuple[int, int], str] = {}  # (step, rank) -> buffer being staged
        self.pending_conn: dict[tuple[int, int], int] = {}  # ... and the connection staging it
        self.waiters = 0  # trainers waiting for a step's protection and the round that acks it
        self.early_pins: dict[tuple[int, int], tuple[int, int]] = {}  # dry alloc: (base, conn)
        self.wanted: set[int] = set()  # steps allocated here: the next round asks for their lane
        # step -> when this host first saw it in flight (an allocation, a staged shard, a lane):
        # the age ``ecsnap status`` and /metrics show; and when the last round completed
        self.first_seen: dict[int, float] = {}
        self.staged_waiting: set[int] = set()  # staged here, not yet taken by a round
        self.last_round = time.monotonic()
        self.t_alloc: dict[tuple[int, int], float] = {}  # (step, rank) -> when the put began
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.wake = threading.Event()  # a round is wanted now
        self.stopping = False
        self.rounds = 0  # rounds completed (every daemon finished the previous one's work)
        self.trace = bool(os.environ.get("ECSNAP_TRACE"))
        # Virtual hosts share one machine, and MPICH moves their bytes through shared memory,
        # which needs the receiver's polls: a bulk wait spins there. Between real hosts the
        # bytes come over a network that needs no polling to arrive: a bulk wait naps, and the
        # cores go to the kernel's network stack and the encoder instead.
        self.spin = config.virtual_hosts is not None
        # Daemons that share a machine's cores (virtual hosts) encode with as many threads as
        # their share of the cores, at least one: 4 virtual hosts on 2 cores with 2 threads each
        # handed every stripe's second half to a core that was busy anyway (RS(3,1), 1.5 GB, two
        # alternated pairs of 8 puts: 0.714-0.723 CPU s per protected GB with 2 threads,
        # 0.675-0.681 with 1; put->protected 0.614-0.619 s against 0.600-0.612 s).
        self.encode_threads = config.encode_threads
        if self.spin:
            share = len(os.sched_getaffinity(0)) // self.nslots
            self.encode_threads = max(1, min(config.encode_threads, share))
        self.health = "starting"
        self.fatal: PeerUnreachableError | None = None  # the job is going down: why
        # a thread the daemon needs failed (:meth:`fail`): the daemon goes down with this reason
        self.failure: str | None = None
        # one descriptor held in reserve, let go to write health.json when none is left
        self._spare_fd: int | None = _open_spare()
        self.unreachable: list[str] = []  # hosts whose daemons did not answer
        self.missing_slots: set[int] = set()
        self.degraded_stripes = 0
        self.errors: dict[str, int] = {}  # refused requests by error class
        self.last_error: str | None = None
        self.stats: dict[str, float] = dict.fromkeys(STATS, 0)
        self.memory_limit = config.memory_budget or 0  # see measure_memory_limit
        self.latency = Latencies(config.job, self.name)
        self._codecs: dict[tuple[int, int], RSCodec] = {}
        self._scratch: dict[tuple[str, int, int], np.ndarray[Any, Any]] = {}
        self._scratch_lock = threading.Lock()
        self._seq = 0

    # -- identity ----------------------------------------------------------------------------------

    @property
    def group(self) -> Group:
        return next(g for g in self.groups if self.slot in g.slots)

    def join_group(self) -> None:
        """Make the group's communicator (collective over the job, once the slots are known):
        rank i in it is position i of the group."""
        g = self.group
        gcomm = self.comm.Split(g.index, g.position(self.slot))
        self.glinks = self.hooks.make_links(gcomm, self.config.peer_timeout, self.name)
        self.glinks.name = "group"
        self.glinks.clock = self.cpu
        self.catalog.group = g
        self.catalog.hosts = self.hosts

    @property
    def gl(self) -> Links:
        """The group's links (after :meth:`join_group`)."""
        assert self.glinks is not None
        return self.glinks

    def counters(self) -> tuple[int, int, int]:
        """Payload bytes sent, received and gathered over both sets of links."""
        links = [self.links] + ([self.glinks] if self.glinks is not None else [])
        return (
            sum(x.counters.sent for x in links),
            sum(x.counters.received for x in links),
            sum(x.counters.gathered for x in links),
        )

    def set_layout(self, km: tuple[int, int] | None, chunk_bytes: int) -> None:
        """Adopt what the host's files were written with (before any step is known): their
        (k, m) unless None (the groups made as its files were), and their largest chunk."""
        if km is not None:
            self.k, self.m = km
            self.groups = make_groups(self.nslots, self.k, self.m, shrink=True)
        self.chunk_bytes = chunk_bytes
        self.catalog = Catalog(self.groups, self.nslots, self.chunk_bytes, self.config.keep)

    def measure_memory_limit(self) -> None:
        """The effective limit on this host's shared memory: ``--memory-budget``, else what
        the file system under the host directory holds (a tmpfs's size)."""
        if self.config.memory_budget is None:
            st = os.statvfs(self.dir)
            self.memory_limit = st.f_blocks * st.f_frsize

    def log(self, msg: str) -> None:
        log(self.name, msg)

    def phase(self, point: str) -> None:
        """This daemon reached phase ``point`` (a fault may be injected there)."""
        self.hooks.phase(point, self.name)

    def next_id(self, prefix: str) -> str:
        """An id unique in the job: for fetches and repairs that this daemon asks for."""
        with self.lock:
            self._seq += 1
            return f"{prefix}{self.slot}-{os.getpid()}-{self._seq}"

    # -- the next round --------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        """Queue ``event`` for the next round and ask for that round now."""
        with self.lock:
            self.events.append(event)
        self.wake.set()

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait (holding ``cond``) until ``ready()``; :class:`StorageTimeoutError` naming
        ``what`` after ``timeout`` seconds. The round engine notifies ``cond`` every round."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not ready():
                if self.fatal is not None:
                    raise self.fatal
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageTimeoutError(f"{what} did not happen within {timeout:.0f}s")
                self.cond.wait(min(left, 0.5))

    def after_next_round(self) -> None:
        """Wait until the round after the current one completes.

        Every daemon applies a round's events and then does that round's local work (manifests
        written or removed) before it joins the next round, so when the next one completes, a
        change seen now is on every host's files: acknowledging protection or deletion only then
        means a storage job killed right after cannot bring back a deleted step or lose one its
        trainers were told is protected."""
        with self.lock:
            target = self.rounds + 1
        self.wake.set()
        self.wait_for(
            lambda: self.rounds >= target, self.config.peer_timeout, "a round of the storage job"
        )

    # -- codecs and scratch (made under one lock: by the warmer's thread or a step's) -------------

    def codec(self, k: int, m: int) -> RSCodec:
        """The codec for RS(k, m), made once (by the warmer ahead of the first step, or by the
        first step that needs it)."""
        with self._scratch_lock:
            rs = self._codecs.get((k, m))
            if rs is None:
                rs = self._codecs[(k, m)] = RSCodec(k, m, threads=self.encode_threads)
        return rs

    def scratch(
        self, purpose: str, rows: int, chunk: int, fit: bool = False
    ) -> np.ndarray[Any, Any]:
        """Reused private (anonymous) rows of one ``chunk`` each, one set per ``purpose`` (rows
        as wide as the largest chunk, ``--chunk-bytes``, viewed ``chunk`` wide: each row stays
        contiguous, and pages are only touched as far as a step's chunks reach).

        The rows are faulted in when made, by the kernel in one call (``MAP_POPULATE``: 1.0 s per
        GB here, against 3.4 s for numpy's first writes to fresh pages), and made ahead of the
        first step by :class:`storage.warm.Warmer`. Data chunks are sent straight from the
        shared-memory files, not out of rows (see :meth:`storage.exchange.Exchange.run`).

        With ``fit``, the rows are ``chunk`` wide (a repair's, given back afterwards by
        :meth:`drop_scratch`: rows as wide as the largest chunk, counted for the step's chunks,
        held 4x the memory meant and kept it, 837 MB in every daemon of a group after a rebuild
        of 10 MB shards).
        """
        width = chunk if fit else self.chunk_bytes
        key = (purpose, rows, width)
        with self._scratch_lock:
            s = self._scratch.get(key)
            if s is None:
                s = self._scratch[key] = _populated((rows, width))
        return s[:, :chunk]

    def drop_scratch(self, purposes: Iterable[str]) -> None:
        """Give back the rows of ``purposes`` (their memory returns once no view is left)."""
        gone = set(purposes)
        with self._scratch_lock:
            for key in [k for k in self._scratch if k[0] in gone]:
                del self._scratch[key]

    def close(self) -> None:
        for rs in self._codecs.values():
            rs.close()
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    # -- this host's chunks ------------------------------------------------------------------------

    def my_layout(self, rec: StepRec) -> tuple[StripeLayout, int]:
        g = self.group
        return rec.layouts[g.index], g.position(self.slot)

    def chunk_view(self, rec: StepRec, c: int) -> np.ndarray[Any, Any]:
        """Data chunk ``c`` of this host's blob of ``rec``: a view into its shard file."""
        ref = rec.blobs[self.slot].chunks[c]
        buf = self.pool.get(rec.shards[ref.rank].buffer)
        return buf.file.array[ref.offset : ref.offset + ref.length]

    def stripe_chunk(self, rec: StepRec, layout: StripeLayout, s: int, index: int) -> Any:
        """This host's bytes of chunk ``index`` of stripe ``s`` (a view into its file)."""
        cb = rec.chunk_bytes
        pos = layout.group.position(self.slot)
        if index >= layout.k:
            slot_i = layout.parity_slot(pos, s)
            name = rec.parity[self.slot]
            return self.pool.get(name).file.array[slot_i * cb : (slot_i + 1) * cb]
        c = layout.data_chunk(s, index)
        assert c is not None
        return self.chunk_view(rec, c)

    def chunk_length(self, rec: StepRec, layout: StripeLayout, s: int, index: int) -> int:
        if index >= layout.k:
            return rec.chunk_bytes
        c = layout.data_chunk(s, index)
        assert c is not None
        p = layout.data_position(s, index)
        return int(rec.blobs[layout.group.slots[p]].chunks[c].length)

    def file(self, name: str, size: int) -> Buffer | None:
        """The pool's buffer ``name`` if its file is whole (at least ``size`` bytes), else None."""
        try:
            if self.pool.path(name).stat().st_size < max(size, 1):
                return None  # truncated: never touch the mapping (SIGBUS)
        except OSError:
            return None
        with self.pool.lock:
            buf = self.pool.files.get(name)
        return buf if buf is not None else self.pool.adopt(name, size)

    def shard_buffer(self, rec: StepRec, rank: int) -> Buffer | None:
        shard = rec.shards[rank]
        return self.file(shard.buffer, shard.nbytes)

    def write_manifest(self, rec: StepRec, loc: Local) -> None:
        loc.manifest = True
        manifest = recovery.manifest_of(rec, self.catalog, self.config.job, self.hosts)
        n = recovery.write_manifest(self.dir / "steps" / f"{rec.step}.json", manifest)
        with self.lock:
            self.manifest_bytes[rec.step] = n

    def remove_manifest(self, step: int) -> None:
        (self.dir / "steps" / f"{step}.json").unlink(missing_ok=True)
        with self.lock:
            self.manifest_bytes.pop(step, None)

    def table(self, rec: StepRec, rank: int) -> dict[str, Any]:
        """The tensor table of ``rank``'s shard here (its structure, dtypes, shapes, offsets),
        read from the shard's own bytes."""
        return self.shard_table(rec.step, rank, rec.shards[rank])

    def shard_table(self, step: int, rank: int, shard: ShardRecord) -> dict[str, Any]:
        """The tensor table in the bytes of ``shard`` (rank ``rank``'s of ``step``), held here."""
        off, length = shard.table
        raw = self.pool.get(shard.buffer).file.array[off : off + length]
        return unpack_table(raw.tobytes(), f"step {step} rank {rank}")

    # -- health and latencies ----------------------------------------------------------------------

    def going_down(self, exc: Any) -> PeerUnreachableError:
        """A wait on peers timed out (``exc``, a PeerTimeoutError): name the silent hosts (the
        peers of the messages that did not complete; after a collective, those that do not
        answer a ping), tell every waiting trainer why, and record it in ``health.json`` before
        the job aborts."""
        g = self.group
        peers, links = exc.peers, exc.links
        if not peers:  # a collective: ask every daemon directly, briefly
            peers, links = self.links.silent_peers(min(3.0, self.config.peer_timeout)), "job"
        hosts = self.hosts or [f"rank {r}" for r in range(self.nslots)]
        if links == "group":
            silent = [hosts[g.slots[p]] for p in peers if p < len(g.slots)]
        else:
            silent = [hosts[self.slot_of_rank[p]] for p in peers if p < self.nslots]
        who = f"host(s) {', '.join(silent)}" if silent else "a peer daemon"
        return self._going_down(
            f"{who} did not answer within {self.config.peer_timeout:.0f}s (a link down, a "
            "daemon stopped or dead)",
            silent,
        )

    def lost_peer(self, host: str) -> PeerUnreachableError:
        """``host``'s daemon is gone (``storage.watch`` heard its connections close, or a
        neighbour said so): tell every waiting trainer, and ``health.json``, before the daemon
        exits. No MPI call: one touching the dead peer may crash inside MPI."""
        return self._going_down(f"host {host}'s daemon is gone (its connections closed)", [host])

    def _going_down(self, why: str, silent: list[str]) -> PeerUnreachableError:
        self.unreachable = silent
        err = PeerUnreachableError(
            f"the storage job is going down: {why}; what is protected stays on every host: "
            "relaunch the storage job, then put again",
            silent,
        )
        with self.cond:
            self.fatal = err
            self.health = "unreachable peer"
            self.cond.notify_all()
        self.write_health()
        return err

    def fail(self, where: str, exc: BaseException) -> None:
        """A thread the daemon needs (``where``) failed with ``exc``: the daemon must not live
        on without it (half-alive: running, answering nobody). Say why in the log and in
        ``health.json``; the round engine then ends the daemon (``ecsnap serve`` exits 4, and
        MPI ends the job). Any thread; the first failure is the reason given."""
        import traceback

        reason = f"{where} failed: {type(exc).__name__}: {exc}"
        with self.cond:
            first = self.failure is None
            if first:
                self.failure = reason
            self.health = "failed"
            self.cond.notify_all()
        self.wake.set()
        if not first:
            return
        trace = "".join(traceback.format_exception(exc)).rstrip().replace("\n", "\n    ")
        self.log(f"{reason}; the daemon goes down (exit 4)\n    {trace}")
        try:
            self.write_health()
        except OSError as err:
            self.log(f"could not write health.json: {err}")

    def write_health(self) -> None:
        """``health.json`` in the host directory: what ``ecsnap status`` shows while the job is
        down (written atomically, mode 0600). Out of descriptors, the one held in reserve is
        let go for it."""
        try:
            self._write_health()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or self._spare_fd is None:
                raise
            spare, self._spare_fd = self._spare_fd, None
            os.close(spare)
            self._write_health()
            self._spare_fd = _open_spare()

    def _write_health(self) -> None:
        with self.lock:
            body = {
                "host": self.name,
                "slot": self.slot,
                "hosts": self.hosts,
                "health": self.health,
                "reason": self.failure,
                "pid": os.getpid(),
                "pid_start": _PID_START,
                "time": time.time(),
                "rebuilt_chunks": self.stats["rebuilt_chunks"],
                "unreachable": self.unreachable,
                "lost_steps": sorted(
                    s for s, r in self.catalog.steps.items() if r.state == StepState.LOST
                ),
            }
        tmp = self.dir / "health.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.dir / "health.json")

    def observe_rebuild(self, seconds: float) -> None:
        self.latency.rebuild.observe(seconds)
