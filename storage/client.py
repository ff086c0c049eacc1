"""The trainer's side: ``connect`` to the host's daemon, then ``put`` / ``get`` snapshots.

Call sequence, on every training rank::

    store = storage.connect("myjob", rank=rank, world_size=world_size)
    handle = store.put(step, state_dict)   # returns while the copy into shared memory runs
    handle.staged.result()                 # before the next optimizer step changes the tensors
    ...
    state = store.get()                    # the newest protected step, this rank's shard

Each rank puts only its own shard; a step becomes protected (visible to ``get``, ``steps`` and
``latest_step`` on every host) once all ``world_size`` ranks have put it and its parity is stored.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storage import discovery
from storage import state as _state
from storage.config import DEFAULT_ROOT, check_name, host_dir
from storage.errors import (
    DaemonUnavailableError,
    DaemonUntrustedError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    from_wire,
)
from storage.gpu import to_device
from storage.maps import Maps
from storage.protocol import MAX_STEP, MAX_WORLD
from storage.table import aligned, digest, unpack_table
from transport import control, shm
from transport.errors import ProtocolError

__all__ = ["SaveHandle", "StepStatus", "Store", "connect"]

# requests the daemon answers only after a round of the storage job (a base kept, a delete
# applied everywhere, a shard fetched or repaired): they may take up to its peer timeout
_JOB_WAITS = frozenset({"alloc", "staged", "delete", "get", "status"})
# requests a restarted daemon can answer as well as the one that died
_RETRYABLE = frozenset({"hello", "alloc", "get", "steps", "status", "info", "delete"})
AHEAD_POLL = 0.2  # seconds between a Store's ``ahead`` requests while its daemon makes files,
AHEAD_ADOPTED = 1.0  # ... while it maps files a restarted daemon will delete once freed,
AHEAD_FOR = 600.0  # ... and the longest it goes on asking after a put mapped its own file


@dataclass(frozen=True)
class StepStatus:
    """Where a step stands: which ranks are staged, whether it is protected, where and how big.

    A protected step lists every rank and host. For a step in flight, no daemon knows which
    ranks the other groups of hosts staged (that would cost every daemon in proportion to the
    job): ``ranks_staged`` lists those of the asking host's group, ``staged_count`` counts all."""

    step: int
    state: str  # staging | ready | encoding | protected | lost | persisted
    world_size: int
    ranks_staged: list[int]  # in flight: those of this host's group (staged_count counts all)
    hosts: list[str]
    data_bytes: int
    parity_bytes: int
    staged_count: int = 0

    @property
    def protected(self) -> bool:
        return self.state == "protected"


class SaveHandle:
    """The two futures of one ``put``.

    ``staged`` resolves (to the step) when this rank's bytes are in daemon memory: from then on the
    caller may change its tensors. ``protected`` resolves when every rank's shard of the step is
    staged and its parity is stored: the step then survives any m host losses per group. Either
    future carries the :class:`StorageError` if that stage fails.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.staged: Future[int] = Future()
        self.protected: Future[int] = Future()
        self.t_put = time.perf_counter()
        self.copy_done: list[Any] = []  # CUDA events of the device-to-host copies, if any
        self.cpu_leaves = True
        self.rank = 0
        # what the put stored (storage.delta.Plan) and will hold once protected (Kept)
        self.plan: Any = None
        self.kept: Any = None
        self.t_staged: float | None = None
        self.t_protected: float | None = None
        # whether staging mapped its file itself (its first use in this process) rather than
        # finding it mapped by an earlier put or ahead of need (None: no file mapped yet)
        self.first_map: bool | None = None
        self.new_file = False  # no earlier put of this Store had its file (mapped or not)

    def wait(self, timeout: float | None = None) -> int:
        """Wait until protected; return the step or raise the failure (``TimeoutError`` if it
        is neither protected nor failed within ``timeout`` seconds: it may still be)."""
        try:
            return self.protected.result(timeout)
        except TimeoutError:
            if self.protected.done():
                raise  # the put's own failure
            raise TimeoutError(
                f"step {self.step} was not protected within {timeout} s (it may still be: wait "
                "again; `ecsnap status` shows where its steps are)"
            ) from None

    def __repr__(self) -> str:
        state = (
            "protected" if self.protected.done() else "staged" if self.staged.done() else "staging"
        )
        return f"SaveHandle(step={self.step}, {state})"


class Store:
    """A trainer rank's connection to its host's daemon. Thread-safe; a context manager.

    Use :func:`connect` to make one.
    """

    def __init__(
        self,
        job: str,
        *,
        rank: int,
        world_size: int,
        host: str,
        root: Path,
        timeout: float,
        incremental: bool = True,
    ) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self.incremental = incremental
        self._kept: dict[int, Any] = {}  # rank -> storage.delta.Kept of its newest protected put
        self.host, self.root, self.timeout = host, root, timeout
        self._job_wait = timeout  # for requests that wait on the job (set by the hello)
        self.socket_path = host_dir(root, job, host) / "ctl.sock"
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child shares the socket, but not the threads
        self._stale = False  # the connection's last request timed out
        self._conn, info = self._handshake()
        self._ahead_threads: dict[int, threading.Thread] = {}  # rank -> its files' mapper
        self._copy_pool = ThreadPoolExecutor(2, thread_name_prefix="ecsnap-copy")
        self._bg = ThreadPoolExecutor(4, thread_name_prefix="ecsnap-put")
        self._closed = False
        self._waiters: set[control.Connection] = set()  # connections waiting for protection
        self._unprotected: set[SaveHandle] = set()  # staged, protection not known yet
        self._unleases: list[str] = []  # buffers whose views are all gone (appended by GC)
        # ... sent with the next request, or by the unleaser thread soon after they go: an idle
        # reader's leases kept retired steps' memory out of the daemon's pool for good
        self._unlease_wake = threading.Event()
        self._unleaser: threading.Thread | None = None
        self._last_put: SaveHandle | None = None
        self._copier: Any = None  # storage.gpu.DeviceCopier, made on the first CUDA put
        self._registry: Any = None
        _LIVE.add(self)
        self.daemon_host: str = info["host"]
        # the daemon's host directory as the daemon names it: paths it gives are under it
        self._daemon_dir: str = str(info.get("dir", self.socket_path.parent))
        self._maps = Maps(self._daemon_dir, str(self.socket_path.parent), self._forget)
        self.hosts: list[str] = info["hosts"]
        self.k, self.m = int(info["k"]), int(info["m"])
        if info.get("reserve"):
            threading.Thread(target=self._premap, name="ecsnap-premap", daemon=True).start()

    # -- plumbing ---------------------------------------------------------------------------------

    def _open(self) -> control.Connection:
        """A connection to the daemon, retried within ``timeout``."""
        return self._connect(hello=False)[0]

    def _handshake(self) -> tuple[control.Connection, dict[str, Any]]:
        """A connection on which the daemon has said hello to this job and rank, and its reply."""
        conn, reply = self._connect(hello=True)
        assert reply is not None
        conn.sock.settimeout(self.timeout)  # a daemon that stops answering fails the call
        # a request that waits on the storage job (a round, a peer) may take as long as the
        # daemon gives its peers, and then the time to name the silent ones: never less
        peer = float(reply.get("peer_timeout") or 0.0)
        self._job_wait = max(self.timeout, 2 * peer + 5.0)
        return conn, reply

    def _connect(self, hello: bool) -> tuple[control.Connection, dict[str, Any] | None]:
        """Connect (and say hello), retrying within ``timeout``. A daemon that accepts and then
        drops the connection (one dying right now) counts as no daemon; a refusal (another job)
        raises its own error at once. Nothing is left open when it raises."""
        deadline = time.monotonic() + self.timeout
        delay = 0.02
        last: Exception | None = None
        while True:
            conn = None
            try:
                # a daemon that accepts and then says nothing (stopped) counts as none
                conn = control.connect(
                    self.socket_path, timeout=max(deadline - time.monotonic(), 0.1)
                )
                server = control.peer_uid(conn.sock)
                if server != os.getuid():
                    conn.close()
                    raise DaemonUntrustedError(
                        f"{self.socket_path} is served by uid {server}, not by this user "
                        f"(uid {os.getuid()}): not your daemon, and nothing is sent to it; "
                        "use a root of your own (--root, ECSNAP_ROOT), owned by you, mode 0700"
                    )
                if not hello:
                    conn.sock.settimeout(None)  # a wait for protection takes its own time
                    return conn, None
                reply = conn.request({"op": "hello", "job": self.job, "rank": self.rank})
                if reply is None:
                    raise ConnectionResetError("the daemon closed the connection")
                if not reply.get("ok", False):
                    conn.close()
                    raise from_wire(reply)
                return conn, reply
            except DaemonUntrustedError:
                raise  # a PermissionError, so an OSError: never one to wait out
            except (OSError, ProtocolError) as exc:
                if conn is not None:
                    conn.close()
                last = exc
            if time.monotonic() >= deadline:
                raise DaemonUnavailableError(self._none_answered(last))
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _none_answered(self, last: Exception | None) -> str:
        """Why no daemon answered, and what to do: another host's daemon answers (a wrong host
        name), this host's daemon ended (the storage job is down), or none ever ran here."""
        said = (
            f"no ecsnap daemon for job {self.job!r} on host {self.host!r} answered at "
            f"{self.socket_path} within {self.timeout:.0f}s ({last}); "
        )
        live = discovery.answering(self.socket_path.parent.parent)
        if live:
            return said + (
                f"daemons of this job answer on host(s) {', '.join(live)}: pass host= or set "
                "ECSNAP_HOST to one of them (virtual hosts: the names given to --virtual-hosts)"
            )
        gone = discovery.ended(self.socket_path.parent)
        if gone is not None:
            return said + (
                f"the daemon that served this host has ended ({gone}) and no other took its "
                "place: the storage job is down (under mpirun, Hydra stops every daemon when "
                "one dies). Launch it again with the same job name: the hosts that kept their "
                "files give the snapshot back, and a host that lost them is rebuilt"
            )
        return said + f"start it with `mpiexec -n HOSTS ecsnap serve --job {self.job}`"

    def _reconnect(self) -> None:
        """A fresh connection and hello in place of the current one (holding ``_lock``)."""
        self._conn.close()
        self._conn, hello = self._handshake()
        self.hosts, self._stale = hello["hosts"], False

    def _request(
        self, message: dict[str, Any], conn: control.Connection | None = None
    ) -> dict[str, Any]:
        """Send one request and return the reply, raising the daemon's error as its own class.

        On the Store's own connection, a request the daemon can repeat safely is retried once
        after reconnecting (a restarted daemon, within ``timeout``); anything else that loses
        its daemon raises :class:`DaemonUnavailableError`.
        """
        self._check_process()
        try:
            if conn is not None:
                reply = conn.request(message)
            else:
                with self._lock:
                    if self._stale:  # the last request timed out: its reply may still come
                        self._reconnect()
                    limit = self.timeout
                    try:
                        if message.get("op") != "unlease":
                            self._send_unleases()
                        waits = message.get("op") in _JOB_WAITS
                        limit = self._job_wait if waits else self.timeout
                        if waits:
                            self._conn.sock.settimeout(limit)
                        try:
                            reply = self._conn.request(message)
                        finally:
                            if waits:
                                self._conn.sock.settimeout(self.timeout)
                    except TimeoutError as exc:
                        self._stale = True
                        raise DaemonUnavailableError(
                            f"the daemon at {self.socket_path} did not answer "
                            f"{message.get('op')!r} within {limit:.0f}s (stopped, or "
                            "stuck); nothing was changed by this call on this side. The next "
                            "call reconnects"
                        ) from exc
                    except (OSError, ProtocolError):
                        reply = None
                    if reply is None and message.get("op") in _RETRYABLE and not self._closed:
                        self._reconnect()
                        reply = self._conn.request(message)
        except (OSError, ProtocolError) as exc:
            raise DaemonUnavailableError(f"lost the daemon at {self.socket_path}: {exc}") from exc
        if reply is None:
            raise DaemonUnavailableError(f"the daemon at {self.socket_path} closed the connection")
        if not reply.get("ok", False):
            raise from_wire(reply)
        return reply

    def _forget(self, array: Any) -> None:
        """A mapping let go: the CUDA registry forgets its pinned host memory."""
        if self._registry is not None:
            self._registry.forget(array)

    def _put_map(self, handle: SaveHandle, alloc: dict[str, Any]) -> shm.MappedFile:
        """The mapping of the file a put's ``alloc`` gave; the handle says whether the put
        mapped it itself (``first_map``)."""
        path, size = alloc["path"], int(alloc["size"])
        if handle.first_map is None:
            handle.new_file = not self._maps.mapped(path, size)
            handle.first_map = handle.new_file and self._maps.premapped(path, size) is None
        return self._maps.map(path, size)

    def _premap(self) -> None:
        """Map the reserve files (``--reserve``) that the daemon claims for this Store's rank
        before its first put, on a thread of its own started at connect, while training loads.

        A reserve file has no owner until a put's take turns it into the file it needs
        (renamed, and cut later or grown: :meth:`storage.pool.Pool.take`), so the first put
        after a start with ``--reserve`` mapped its file inside the put (``MAP_POPULATE``: 36-71
        ms for 375 MB with four trainers mapping at once on 2 cores, staging 0.125-0.141 s
        against 0.054 in steady state). The daemon claims files for this rank, at most its share
        of the reserve, and its takes prefer them; :meth:`storage.maps.Maps.map` then takes over
        the mapping of the renamed file (same inode). It asks every ``AHEAD_POLL`` seconds
        while the reserve is being made, until this Store's first put. Mappings no put took
        are let go once the rank's files made ahead are mapped (:meth:`_ahead`) or the Store
        closes: till then they keep the pages of a reserve file the daemon dropped."""
        self._aside(self._premap_on)

    def _premap_on(self, conn: control.Connection) -> None:
        request = {"op": "premap", "rank": self.rank, "world_size": self.world_size}
        while not self._closed and self._last_put is None:
            reply = self._request(request, conn)
            for path, size in reply["files"]:
                if not self._maps.premap(path, int(size)):
                    return  # closed
            if not reply["making"]:
                return
            time.sleep(AHEAD_POLL)

    def _aside(self, body: Callable[[control.Connection], None]) -> None:
        """Run a mapping thread's ``body`` on a connection of its own, which :meth:`close`
        shuts. No daemon now, the daemon going or the Store closing ends it quietly: the puts
        map their own files."""
        try:
            conn = self._open()
        except StorageError:
            return
        with self._lock:
            self._waiters.add(conn)
        try:
            body(conn)
        except (StorageError, OSError, ProtocolError):
            pass
        finally:
            with self._lock:
                self._waiters.discard(conn)
            conn.close()

    def _start_ahead(self, rank: int) -> None:
        """Map the files the daemon makes ahead for ``rank``'s next puts before they ask for
        them, on a thread of its own (one per rank at a time).

        A put whose file this process never mapped maps it inside the put (``MAP_POPULATE``): a
        file's first mapping in a process costs 21-35 ms for 375 MB here, against 8 ms for a
        file mapped before (four trainers mapping at once on 2 cores: 36-71 ms), which the first
        ``keep + 1`` puts after a start paid on their staging. Called once a put whose file no
        earlier put had (mapped inside it, or before it from the reserve) is protected: its
        daemon then knows the rank's shard size and makes the next puts' files
        (:mod:`storage.warm`); the thread asks for them every ``AHEAD_POLL`` seconds and maps
        each one as soon as it is whole (never a partial one: that would fault its missing
        pages in here, at the trainer's priority), until the daemon makes no more, at most
        ``AHEAD_FOR`` seconds. Steady state reuses mapped files and asks nothing.

        The same thread lets go of the rank's files that the daemon deleted, whose memory this
        Store's mappings alone would keep: the files a restarted daemon adopted, deleted once
        retention frees them (it asks every ``AHEAD_ADOPTED`` seconds while it maps one), and
        free files dropped to keep within ``--memory-budget``."""
        with self._lock:
            if self._closed:
                return
            t = self._ahead_threads.get(rank)
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=self._ahead, args=(rank,), name="ecsnap-ahead", daemon=True)
            self._ahead_threads[rank] = t
        t.start()

    def _ahead(self, rank: int) -> None:
        try:
            self._aside(functools.partial(self._ahead_on, rank))
        finally:
            self._maps.drop_premaps()

    def _ahead_on(self, rank: int, conn: control.Connection) -> None:
        deadline = time.monotonic() + AHEAD_FOR
        failed: set[str] = set()  # listed, but could not be mapped: not tried again
        while not self._closed and time.monotonic() < deadline:
            # mapped before asking: a file a put maps meanwhile may be newer than the reply
            before = self._maps.rank_maps(rank)
            reply = self._request({"op": "ahead", "rank": rank}, conn)
            held = {self._maps.here(p) for p in reply["held"]}
            self._maps.unmap(before - held)  # deleted by the daemon
            new = [
                (p, int(n))
                for p, n in reply["files"]
                if p not in failed and not self._maps.mapped(p, int(n))
            ]
            for path, size in new:
                try:
                    self._maps.map(path, size)
                except (OSError, ValueError):
                    failed.add(path)  # dropped since, or unmappable: a put maps its own
            if new:
                continue
            if reply["making"]:
                time.sleep(AHEAD_POLL)
            elif {self._maps.here(p) for p in reply["adopted"]} & self._maps.rank_maps(rank):
                time.sleep(AHEAD_ADOPTED)
            else:
                return

    # -- the public calls -------------------------------------------------------------------------

    def put(
        self,
        step: int,
        state_dict: Any,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> SaveHandle:
        """Snapshot this rank's ``state_dict`` as ``step``; return at once with a handle.

        ``rank`` and ``world_size`` (default: this Store's) number the step's shards otherwise,
        for a step whose shards are not one per training rank (the DCP writer's commit record).

        Raises now, before anything is stored: :class:`UnsupportedTypeError` (naming the key path),
        :class:`StepExistsError` (this rank already put ``step``), :class:`CapacityError` (over the
        host's memory budget), ``ValueError`` for a step that is no int in 0..2**63 - 1. Tensors
        must not change until ``handle.staged`` resolves.

        >>> h = store.put(10, {"w": torch.zeros(4)})   # doctest: +SKIP
        >>> h.wait()                                     # doctest: +SKIP
        10
        """
        self._check_open()
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be an int in 0..{MAX_STEP} (2**63 - 1), got {step!r}")
        skeleton, leaves, nbytes = _state.flatten(state_dict)
        handle = SaveHandle(step)
        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..world_size-1 ({world_size})")
        handle.rank = rank
        cuda = any(leaf.device.startswith("cuda") for leaf in leaves)
        with self._lock:
            last = self._kept.get(rank) if self.incremental and not cuda else None
        request = {"op": "alloc", "step": step, "rank": rank, "world_size": world_size}
        meta: dict[str, Any] = {"skeleton": skeleton, "rank": rank, "world": world_size}
        if last is not None:
            # what changed is known once the leaves are hashed: the buffer is allocated then
            # a bad put still raises here, and so does one whose certain bytes exceed the budget
            certain = last.certain(leaves)
            dry = dict(request, nbytes=certain, dry=True)
            likely = last.likely_base(nbytes - certain)
            if likely is not None:  # kept on every host while this put hashes
                dry.update(base=likely, base_table=last.table_of(likely))
            self._request(dry)
            handle.cpu_leaves = True
            self._last_put = handle
            self._bg.submit(self._stage, handle, leaves, None, meta, last)
            return handle
        # the shard's tensor table travels inside its bytes, after its leaves; room is left for
        # the digests the background thread computes
        room = [dict(leaf.meta(), h="0" * 32) for leaf in leaves] if self.incremental else None
        table = _state.pack_table(skeleton, room or [leaf.meta() for leaf in leaves])
        table_at, total = _state.table_place(nbytes, len(table))
        alloc = self._request(dict(request, nbytes=total))
        meta.update(at=table_at, length=len(table), nbytes=total)
        if cuda:
            # device-to-host copies are enqueued here, on the side stream, without a host sync
            mf = self._put_map(handle, alloc)
            handle.copy_done = self._device_copier().enqueue(leaves, mf.array)
        handle.cpu_leaves = any(not leaf.device.startswith("cuda") for leaf in leaves)
        self._last_put = handle
        self._bg.submit(self._stage, handle, leaves, alloc, meta, None)
        return handle

    def _device_copier(self) -> Any:
        if self._copier is None:
            from storage import gpu

            self._registry = gpu.HostRegistry(gpu.CudaRegistrar())
            self._copier = gpu.DeviceCopier(self._registry)
        return self._copier

    def guard(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` wait for the last ``put``'s copies; returns the hook handle.

        The pattern for training loops: ``store.guard(opt)`` once, then ``put`` every step right
        after ``opt.step()``; the next step's forward and backward overlap the snapshot's copy.
        Parameters on the GPU are protected with a stream wait (the current stream waits for the
        copy stream's event: no host synchronisation); parameters on the CPU by waiting for
        ``handle.staged``, since host threads read them.
        """

        def wait_for_snapshot(opt: Any, args: Any, kwargs: Any) -> None:
            handle = self._last_put
            if handle is None:
                return
            if handle.copy_done:
                import torch

                for event in handle.copy_done:
                    torch.cuda.current_stream().wait_event(event)
            if handle.cpu_leaves and any(
                p.device.type == "cpu" for g in opt.param_groups for p in g["params"]
            ):
                handle.staged.result()

        return optimizer.register_step_pre_hook(wait_for_snapshot)

    def _stage(
        self,
        handle: SaveHandle,
        leaves: list[_state.Leaf],
        alloc: dict[str, Any] | None,
        meta: dict[str, Any],
        last: Any,
    ) -> None:
        """Hash the leaves that may be unchanged, allocate (a put with references), copy the
        changed leaves and the table into the shard buffer, say so, wait for protection (a
        background thread)."""
        try:
            sources = [_state.source_bytes(leaf) for leaf in leaves]
            plan = None
            t_hash = time.thread_time()
            if self.incremental:
                from storage import delta  # xxhash and the planner: only where they are used

                plan = delta.plan(leaves, last, sources)
            cpu_hash = time.thread_time() - t_hash
            if alloc is None:
                assert plan is not None
                alloc, table, base = self._alloc_delta(handle, plan, meta, last)
            else:
                base = None
                metas = [leaf.meta() for leaf in leaves]
                table = _state.pack_table(meta["skeleton"], metas)
                table += b" " * (meta["length"] - len(table))  # the room left for digests
            at = aligned(plan.own_bytes if plan is not None else meta["at"])
            nbytes = at + len(table)
            mf = self._put_map(handle, alloc)
            cpu_stage = _state.stage(
                leaves,
                mf.array[:at],
                self._copy_pool,
                skip_cuda=bool(handle.copy_done),
                sources=sources,
            )
            t_table = time.thread_time()
            mf.array[at : at + len(table)] = np.frombuffer(table, dtype=np.uint8)
            cpu_stage += time.thread_time() - t_table
            for event in handle.copy_done:
                event.synchronize()  # this background thread waits, never the training stream
            staged: dict[str, Any] = {
                "op": "staged",
                "step": handle.step,
                "rank": meta["rank"],
                "world_size": meta["world"],
                "buffer": alloc["buffer"],
                "nbytes": nbytes,
                "table": [at, len(table)],
                "cpu_stage": cpu_stage,  # for ecsnap_cpu_seconds{phase}
                "cpu_hash": cpu_hash,
            }
            if base is not None:
                staged.update(base=base, refs=plan.ref_bytes if plan is not None else 0)
            meta["buffer"] = alloc["buffer"]
            self._request(staged)
            if plan is not None:
                handle.plan = plan
                handle.kept = plan.kept(
                    handle.step, last if base is not None else None, digest(table)
                )
        except BaseException as exc:
            try:  # refused before it allocated (the step exists): nothing to give back
                if not isinstance(exc, StepExistsError):
                    self._request({"op": "abort", "step": handle.step, "rank": meta["rank"]})
            except StorageError:
                pass
            handle.staged.set_exception(exc)
            handle.protected.set_exception(exc)
            return
        handle.t_staged = time.perf_counter()
        handle.staged.set_result(handle.step)
        # The wait for protection runs on a daemon thread of its own: a process that ends (a
        # script that returns, or raises) does not wait for it; it says what it abandoned.
        with self._lock:
            self._unprotected.add(handle)
        threading.Thread(
            target=self._await_protection, args=(handle,), name="ecsnap-wait", daemon=True
        ).start()

    def _alloc_delta(
        self, handle: SaveHandle, plan: Any, meta: dict[str, Any], last: Any
    ) -> tuple[dict[str, Any], bytes, int | None]:
        """Allocate the buffer of a put planned with references; if the daemon could not keep
        its base (gone meanwhile, or a restarted daemon), the whole shard is put instead.
        Returns (the alloc reply, the table, the base kept)."""
        request: dict[str, Any] = {
            "op": "alloc",
            "step": handle.step,
            "rank": meta["rank"],
            "world_size": meta["world"],
        }
        for _attempt in range(2):
            base = plan.base
            table = _state.pack_table(meta["skeleton"], [leaf.meta() for leaf in plan.leaves], base)
            _, total = _state.table_place(plan.own_bytes, len(table))
            refer = {} if base is None else {"base": base, "base_table": last.table_of(base)}
            alloc = self._request(dict(request, nbytes=total, **refer))
            if base is None or alloc.get("base") == base:
                return alloc, table, base
            # refused: give the buffer back, lay the shard out whole, and put that
            self._request({"op": "abort", "step": handle.step, "rank": meta["rank"]})
            plan.whole()
        raise AssertionError("unreachable")

    def _await_protection(self, handle: SaveHandle) -> None:
        try:
            conn = self._open()
            with self._lock:
                self._waiters.add(conn)
            try:
                if self._closed:
                    raise StorageError("the Store was closed before the step was protected")
                self._request({"op": "wait", "step": handle.step, "timeout": None}, conn)
            finally:
                with self._lock:
                    self._waiters.discard(conn)
                conn.close()
        except BaseException as exc:
            self._settled(handle)
            handle.protected.set_exception(exc)
            return
        handle.t_protected = time.perf_counter()
        self._settled(handle)
        if handle.new_file:  # the daemon makes the next puts' files now: map them ahead
            self._start_ahead(handle.rank)
        if handle.kept is not None:
            with self._lock:
                now = self._kept.get(handle.rank)
                if now is None or handle.step > now.step:
                    self._kept[handle.rank] = handle.kept  # the next put refers to this one
        handle.protected.set_result(handle.step)

    def _settled(self, handle: SaveHandle) -> None:
        with self._lock:
            self._unprotected.discard(handle)

    def _abandoned(self) -> list[int]:
        """Steps this Store staged whose protection it still waits for (at exit: abandoned)."""
        with self._lock:
            return sorted(h.step for h in self._unprotected if not h.protected.done())

    def get(self, step: int | None = None, *, rank: int | None = None, device: Any = None) -> Any:
        """The state dict ``rank`` (default: this rank) put at ``step`` (default: newest protected).

        Works from any host: a shard held elsewhere is fetched by the daemons, and one whose
        chunks fail their checksums is repaired first. Returns the same nested structure,
        bit-exact, with CPU tensors and arrays that are *copy-on-write views* of the shard in
        shared memory: nothing is copied until you write, a write copies that page privately,
        and the snapshot itself never changes. While any of them lives, the daemon keeps that
        memory out of reuse (even past retention); it is given back once they are all gone.

        With ``device`` (say ``"cuda"``), tensors come back on that device instead: copied from
        the shard's pinned shared memory with ``non_blocking=True`` on the current stream, so
        later work on that stream sees them; the memory is held until the copies are done.

        Raises :class:`StepNotFoundError` if the step is not protected, and
        :class:`SnapshotUnrecoverableError` if it was lost beyond repair (with ``step=None``:
        only when no step at all can be read; otherwise the newest readable one is returned).
        """
        self._check_open()
        rank = self.rank if rank is None else rank
        reply = self._request({"op": "get", "step": step, "rank": rank})
        if device is not None and str(device).startswith("cuda"):
            return self._getto_device(reply, device, rank)
        mm = self._map_reply(reply)
        table = _table(mm, reply, rank)
        based = self._base_reply(table, rank, reply)
        base = self._map_reply(based) if based is not None else None
        return _state.unflatten_views(table["skeleton"], table["leaves"], mm, base)

    def _base_reply(
        self, table: dict[str, Any], rank: int, reply: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The get reply for the base step the shard's table names (where its unchanged
        tensors lie), or None for a whole shard."""
        if table.get("base") is None:
            return None
        return self._request(
            {"op": "get", "step": int(table["base"]), "rank": rank, "base_of": reply["step"]}
        )

    def _map_reply(self, reply: dict[str, Any]) -> Any:
        """A private mapping of the shard a get reply names (its lease ends with the mapping)."""
        path, nbytes = reply["path"], int(reply["nbytes"])
        try:
            mm = shm.map_private(self._maps.here(path), max(nbytes, 1))
        finally:
            if reply.get("temp"):
                self._request({"op": "release", "path": path})  # the mapping keeps the bytes
        if not reply.get("temp"):
            # the lease ends when the mapping goes: with its last view (torch, numpy, memoryview)
            self._start_unleaser()
            weakref.finalize(
                shm.mapping_owner(mm),
                _lease_gone,
                self._unleases,
                self._unlease_wake,
                reply["buffer"],
            )
        return mm

    def _start_unleaser(self) -> None:
        if self._unleaser is None or not self._unleaser.is_alive():
            self._unleaser = threading.Thread(
                target=_unleaser,
                args=(weakref.ref(self), self._unlease_wake),
                name="ecsnap-unlease",
                daemon=True,
            )
            self._unleaser.start()

    def _send_unleases(self) -> None:
        """Tell the daemon which leased buffers this process holds no view of any more (holding
        ``_lock``; OSError and ProtocolError as the connection's)."""
        if self._unleases:
            # leases live as long as their daemon: if it is gone, so are they
            names, self._unleases[:] = list(self._unleases), []
            self._conn.request({"op": "unlease", "buffers": names})

    def _flush_unleases(self) -> None:
        """:meth:`_send_unleases` from the unleaser's thread."""
        with self._lock:
            if self._closed or self._stale:
                return
            try:
                self._send_unleases()
            except (OSError, ProtocolError):
                pass  # a daemon gone: its leases went with it

    def structure(self, step: int | None = None, *, rank: int | None = None) -> tuple[int, Any]:
        """(step, structure) of what ``rank`` put at ``step``, touching none of its tensors.

        The structure is the state dict as put, with a :class:`storage.state.Leaf` (dtype,
        shape, size) in place of each tensor or array and every other value as it was. It is
        read from the shard's tensor table: from this host's memory, or (a rank held elsewhere)
        fetched alone from the host that holds it, some kB whatever the tensors' size.
        """
        self._check_open()
        rank = self.rank if rank is None else rank
        reply = self._request({"op": "get", "step": step, "rank": rank, "meta_only": True})
        leaves = [_state.Leaf.from_meta(m) for m in reply["meta"]["leaves"]]
        return int(reply["step"]), _state.build(reply["meta"]["skeleton"], leaves)

    def _getto_device(self, reply: dict[str, Any], device: Any, rank: int) -> Any:
        import torch

        mapped = [self._pinned(reply)]
        table = _table(mapped[0][1].array, reply, rank)
        based = self._base_reply(table, rank, reply)
        if based is not None:
            mapped.append(self._pinned(based))
        arrays = [mf.array for _, mf in mapped]
        host = _state.unflatten_views(
            table["skeleton"], table["leaves"], arrays[0], arrays[1] if len(arrays) > 1 else None
        )
        out = to_device(host, torch.device(device))
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(torch.device(device)))

        def release() -> None:
            done.synchronize()
            for r, mf in mapped:
                if r.get("temp"):
                    self._registry.forget(mf.array)
                    mf.close()
                    self._request({"op": "release", "path": r["path"]})
                else:
                    self._unleases.append(r["buffer"])

        self._bg.submit(release)
        return out

    def _pinned(self, reply: dict[str, Any]) -> tuple[dict[str, Any], shm.MappedFile]:
        """The shard a get reply names, mapped and registered for device copies."""
        path, size = reply["path"], int(reply["size"])
        mf = (
            self._maps.map(path, size)
            if not reply.get("temp")
            else shm.MappedFile(self._maps.here(path), size)
        )
        self._device_copier().registry.ensure(mf.array)
        return reply, mf

    def latest_step(self) -> int | None:
        """The newest step some tier can serve (memory, or the persistent tier), or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def steps(self) -> list[int]:
        """Steps that can be read, ascending: protected in memory, or published on disk (with
        ``ecsnap serve --persist-dir``). :meth:`status` says which tier holds a step."""
        self._check_open()
        r = self._request({"op": "steps"})
        return sorted({int(s) for s in r["steps"]} | {int(s) for s in r.get("disk", [])})

    def status(self, step: int) -> StepStatus:
        """Where ``step`` stands; :class:`StepNotFoundError` if no daemon holds it."""
        self._check_open()
        r = self._request({"op": "status", "step": step})
        return StepStatus(
            step=r["step"],
            state=r["state"],
            world_size=r["world_size"],
            ranks_staged=r["ranks_staged"],
            hosts=r["hosts"],
            data_bytes=r["data_bytes"],
            parity_bytes=r["parity_bytes"],
            staged_count=r["staged_count"],
        )

    def delete(self, step: int) -> None:
        """Drop ``step`` on every host; :class:`StepNotFoundError` if no daemon holds it."""
        self._check_open()
        self._request({"op": "delete", "step": step})

    def rollback(self, to: int) -> list[int]:
        """Delete every step newer than ``to``, in memory and on disk, so that the job can put
        those numbers again (steps go forward: a put of a number older than the newest held step
        is refused). Returns the steps deleted. Call it from one rank, or from every rank (a step
        another rank deleted first is skipped), before any rank puts again."""
        gone = []
        for step in sorted((s for s in self.steps() if s > to), reverse=True):
            try:
                self.delete(step)
            except StepNotFoundError:
                continue
            gone.append(step)
        return sorted(gone)

    def info(self) -> dict[str, Any]:
        """The host daemon's counters (bytes held and moved), for benchmarks and status."""
        return self._request({"op": "info"})

    def close(self) -> None:
        """Wait for puts in flight to finish staging, then close. Idempotent.

        Puts whose steps are not protected yet keep going in the daemons; their ``protected``
        futures fail with :class:`DaemonUnavailableError` here, since this Store stops listening.
        Views that :meth:`get` returned stay readable, but the daemon no longer keeps their memory
        out of reuse once their step retires: copy what must outlive the Store.
        """
        if self._closed:
            return
        self._closed = True
        self._unlease_wake.set()  # its thread ends
        if os.getpid() != self._pid:
            return  # the parent's connection and mappings: this process must not shut them
        with self._lock:
            waiters = list(self._waiters)
        for conn in waiters:
            conn.shutdown()
        self._bg.shutdown(wait=True)
        self._copy_pool.shutdown(wait=True)
        self._conn.close()
        if self._registry is not None:
            self._registry.close()
        self._maps.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("this Store is closed")
        self._check_process()

    def _check_process(self) -> None:
        """A Store serves the process that connected: a forked child (a data loader's worker)
        would share its socket with the parent, their replies crossed, and has none of its
        threads, so its puts would never stage."""
        if os.getpid() != self._pid:
            raise StorageError(
                f"this Store was connected in process {self._pid}, and this is process "
                f"{os.getpid()} (forked from it): call storage.connect() again in this process"
            )

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _table(buffer: Any, reply: dict[str, Any], rank: int) -> dict[str, Any]:
    """The tensor table of the shard in ``buffer`` (where the get reply says it lies)."""
    at, length = reply["table"]
    raw = memoryview(buffer)[at : at + length]
    return unpack_table(bytes(raw), f"step {reply['step']} rank {rank}")


# Where a rank's place in the job comes from when connect() is not told: torchrun's variables,
# then MPI's (Open MPI's, MPICH's PMI), then Slurm's, for a trainer started by plain `srun python`
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size`` as given, else from the first of :data:`RANK_VARS` and
    :data:`WORLD_VARS` that is set; :class:`StorageError` naming them if either is unknown."""
    if rank is None:
        rank = discovery.env_int(*RANK_VARS)
    if world_size is None:
        world_size = discovery.env_int(*WORLD_VARS)
    if rank is None or world_size is None:
        raise StorageError(
            "rank and world_size unknown: pass them, or set RANK and WORLD_SIZE (torchrun sets "
            f"them; also read: {', '.join(RANK_VARS[1:])} and {', '.join(WORLD_VARS[1:])})"
        )
    return rank, world_size


_LIVE: weakref.WeakSet[Store] = weakref.WeakSet()


@atexit.register
def _say_what_was_abandoned() -> None:
    """At exit, name the steps staged here whose protection nobody waited for (their wait ran
    on a daemon thread, so the process did not hang on it)."""
    for store in list(_LIVE):
        if store._pid != os.getpid():
            continue  # a forked child's copy: the parent says what it abandoned
        steps = store._abandoned()
        if steps:
            print(
                f"ecsnap: rank {store.rank} of job {store.job!r} ended with step(s) "
                f"{', '.join(map(str, steps))} staged but not yet protected; their protection "
                "was abandoned here (the storage job still protects a step once every rank has "
                "put it)",
                file=sys.stderr,
            )


UNLEASE_AFTER = 0.2  # seconds the unleaser waits after a view goes (others of a get go too)


def _lease_gone(names: list[str], wake: threading.Event, name: str) -> None:
    """The last view of a leased buffer went (a finalizer: any thread, never blocking)."""
    names.append(name)
    wake.set()


def _unleaser(ref: weakref.ref[Store], wake: threading.Event) -> None:
    """A Store's thread that sends its ended leases soon after their views go."""
    while True:
        wake.wait()
        time.sleep(UNLEASE_AFTER)
        wake.clear()
        store = ref()
        if store is None or store._closed:
            return
        store._flush_unleases()
        del store


def connect(
    job: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    host: str | None = None,
    root: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
    incremental: bool | None = None,
) -> Store:
    """Connect this training rank to the daemon of its host.

    Defaults: ``job`` from ``ECSNAP_JOB``; ``rank`` / ``world_size`` from ``RANK`` / ``WORLD_SIZE``
    (torchrun), ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` (Open MPI) or ``PMI_RANK`` / ``PMI_SIZE``
    (MPICH); ``host`` from ``ECSNAP_HOST``, else the machine's hostname, else, where the daemons
    run ``--virtual-hosts`` on this machine, virtual host ``rank % H`` (in the order they name
    them); ``root`` from ``ECSNAP_ROOT``, else ``/dev/shm/ecsnap-<user>``. Waits up to ``timeout``
    seconds for the daemon, then raises :class:`DaemonUnavailableError` naming the hosts whose
    daemons do answer; a job that never ran under ``root`` fails within 5 s, naming the jobs
    that did.

    With ``incremental`` (default: on, unless ``ECSNAP_INCREMENTAL=0``), a put stores the
    tensors unchanged since this rank's last protected put as references to that step's bytes
    (see :mod:`storage.delta`).

    >>> with connect("myjob", rank=0, world_size=1) as store:   # doctest: +SKIP
    ...     store.put(0, {"w": torch.ones(3)}).wait()
    """
    job = job or os.environ.get("ECSNAP_JOB")
    if not job:
        raise StorageError("no job name: pass job= or set ECSNAP_JOB")
    check_name("job", job)
    rank, world_size = rank_and_world(rank, world_size)
    if not 0 <= rank < world_size:
        raise StorageError(f"rank {rank} is not in 0..world_size-1 ({world_size})")
    if world_size > MAX_WORLD:
        raise StorageError(f"world_size {world_size} is over the {MAX_WORLD} ranks a job may have")
    root_path = Path(root or os.environ.get("ECSNAP_ROOT") or DEFAULT_ROOT)
    start = time.monotonic()
    host = discovery.host_of(job, root_path, rank, host or os.environ.get("ECSNAP_HOST"), timeout)
    left = max(timeout - (time.monotonic() - start), 0.1)
    if incremental is None:
        incremental = os.environ.get("ECSNAP_INCREMENTAL", "1") != "0"
    return Store(
        job,
        rank=rank,
        world_size=world_size,
        host=host,
        root=root_path,
        timeout=left,
        incremental=incremental,
    )
