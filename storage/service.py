"""The socket service: what a trainer's :class:`storage.Store` asks its host's daemon.

Who calls it: the control server (:class:`transport.control.Server`), one thread per trainer
connection, with each framed JSON request. What it owns: the puts being staged on this host
(``host.pending``) and the refused-request counters. Lock: the host's ``lock`` around every read
or change of shared state; it waits for rounds through :meth:`Host.wait_for`, never holding the
lock across I/O.

Requests (``op``, typed in :mod:`storage.protocol`): ``hello``, ``alloc``, ``staged``,
``abort``, ``wait``, ``get``, ``release``, ``unlease``, ``steps``, ``status``, ``delete``,
``info``, ``ahead``, ``premap``. Each frame is checked against its type before its handler
sees it: one that breaks the protocol is answered with a :class:`StorageError` naming the field
("bad request: ..."); a bug in the daemon is answered as an internal error and logged with its
traceback, never as a bad request.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from storage.catalog import StepRec, StepState
from storage.cpu import charged
from storage.errors import (
    SnapshotUnrecoverableError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    StorageTimeoutError,
    from_wire,
    to_wire,
)
from storage.fetch import Fetcher
from storage.host import Host
from storage.leases import Leases
from storage.protocol import (
    AbortRequest,
    AheadRequest,
    AllocRequest,
    Delete,
    GetRequest,
    HelloRequest,
    Pin,
    PlainRequest,
    PremapRequest,
    ReleaseRequest,
    RequestError,
    ShardRecord,
    Snapshot,
    Staged,
    StagedRequest,
    StepRequest,
    UnleaseRequest,
    Unpin,
    WaitRequest,
    parse_request,
)
from storage.repair import Repairer
from storage.table import digest
from storage.tier import Tier
from storage.warm import Warmer
from transport.control import Connection

__all__ = ["Service"]


class Service:
    def __init__(
        self,
        host: Host,
        leases: Leases,
        tier: Tier,
        fetcher: Fetcher,
        repairer: Repairer,
        snapshot: Any,
    ) -> None:
        self.host = host
        self.leases = leases
        self.tier = tier
        self.fetcher = fetcher
        self.repairer = repairer
        self.snapshot = snapshot  # () -> Snapshot
        self.warmer: Warmer | None = None  # set by the daemon; ``ahead`` asks it
        # temporary files handed to each connection's reads, until it releases them (or goes)
        self.temps: dict[int, set[str]] = {}

    @charged("serve")
    def handle(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any] | None:
        op = msg.get("op")
        try:
            try:
                op, request = parse_request(msg)
            except RequestError as exc:
                raise StorageError(f"bad request: {exc}") from exc
            reply: dict[str, Any] = getattr(self, f"_op_{op}")(request, id(conn))
            if reply.get("temp"):  # the reader releases it once mapped, or it goes with it
                with self.host.lock:
                    self.temps.setdefault(id(conn), set()).add(str(reply["path"]))
            reply.setdefault("ok", True)
            return reply
        except StorageError as exc:
            self._count(exc)
            return to_wire(exc)
        except Exception as exc:  # a bug here: say so, and keep serving
            self.host.log(f"internal error answering {op!r}:\n{traceback.format_exc()}")
            err = StorageError(
                f"internal error in the daemon of host {self.host.name} answering {op!r}: "
                f"{type(exc).__name__}: {exc} (a bug: its log has the traceback)"
            )
            self._count(err)
            return to_wire(err)

    def closed(self, conn: Connection) -> None:
        """A trainer went away: its views went with it, and so did the puts it was staging."""
        h = self.host
        self.leases.end_all(id(conn))
        with h.lock:
            temps = self.temps.pop(id(conn), set())
        for path in temps:  # handed to a reader that went before it mapped them
            h.pool.temp_gone(path)
        with h.lock:
            for key in [k for k, c in h.pending_conn.items() if c == id(conn)]:
                del h.pending_conn[key]
                name = h.pending.pop(key, "")
                h.t_alloc.pop(key, None)
                if name:
                    h.pool.release(name)
                if key in h.catalog.pins:
                    h.events.append(Unpin(*key))
            for key in [k for k, (_, c) in h.early_pins.items() if c == id(conn)]:
                del h.early_pins[key]
                h.events.append(Unpin(*key))  # asked for by a dry alloc, never allocated

    def _count(self, exc: StorageError) -> None:
        h = self.host
        with h.lock:
            kind = type(exc).__name__
            h.errors[kind] = h.errors.get(kind, 0) + 1
            h.last_error = f"{kind}: {exc}"

    # -- putting ----------------------------------------------------------------------------------

    def _op_hello(self, msg: HelloRequest, conn: int) -> dict[str, Any]:
        h = self.host
        if msg.get("job") != h.config.job:
            raise StorageError(f"this daemon serves job {h.config.job!r}, not {msg.get('job')!r}")
        return {
            "host": h.name,
            "slot": h.slot,
            "hosts": h.hosts,
            "health": h.health,
            "k": h.group.k,
            "m": h.group.m,
            "chunk_bytes": h.chunk_bytes,
            "dir": str(h.dir),
            "reserve": h.config.reserve,
            "peer_timeout": h.config.peer_timeout,
        }

    def _op_alloc(self, msg: AllocRequest, conn: int) -> dict[str, Any]:
        h = self.host
        h.phase("staging")
        step, rank, world, nbytes = msg["step"], msg["rank"], msg["world_size"], msg["nbytes"]
        with h.lock:
            h.first_seen.setdefault(step, time.monotonic())
            rec = h.catalog.steps.get(step)
            # A rank may put an unfinished step again (a restarted trainer redoing it): its new
            # shard replaces the old one. Once every rank has staged it, the step is written.
            why = h.catalog.refusal(step)
            if why is not None:
                raise StepExistsError(why)
            if (step, rank) in h.pending:
                raise StepExistsError(f"rank {rank} is already putting step {step}")
            if rec is not None and rec.world_size and rec.world_size != world:
                raise StorageError(
                    f"step {step} is being put with world_size {rec.world_size}, not {world}"
                )
            reserve = -(-nbytes * h.m // h.group.k)  # its parity, soon after
            if msg.get("dry"):
                # checked only: the put allocates once it knows what changed, at least nbytes
                h.pool.check(nbytes, reserve)
                self._want(step)
                # the base the trainer expects to refer to, kept while it hashes: the round that
                # keeps it is then off the put's path (its alloc checks it is the one)
                base = msg.get("base")
                if base is not None and self._pin(
                    step, rank, base, msg.get("base_table", ""), wait=False
                ):
                    h.early_pins[(step, rank)] = (base, conn)
                return {}
            h.pending[(step, rank)] = ""
        try:
            buf = h.pool.take(nbytes, f"r{rank}-", reserve=reserve)
        except StorageError:
            with h.lock:
                h.pending.pop((step, rank), None)
                h.pending_conn.pop((step, rank), None)
            raise
        with h.lock:
            h.pending[(step, rank)] = buf.name
            h.pending_conn[(step, rank)] = conn
            h.t_alloc[(step, rank)] = time.monotonic()
            early = h.early_pins.pop((step, rank), None)
        self._want(step)
        base = msg.get("base")
        asked = early is not None and early[0] == base
        if base is not None and not self._pin(
            step, rank, base, msg.get("base_table", ""), asked=asked
        ):
            base = None
        return {
            "buffer": buf.name,
            "path": str(h.pool.path(buf.name)),
            "size": buf.size,
            "base": base,
        }

    def _want(self, step: int) -> None:
        """The step gets its lane in the next round, while its shard is still being staged
        (hashed, copied) instead of a round after it was: a put's first round is off its path."""
        h = self.host
        with h.lock:
            h.wanted.add(step)
        h.wake.set()

    def _pin(
        self, step: int, rank: int, base: int, table: str, wait: bool = True, asked: bool = False
    ) -> bool:
        """Keep ``base`` for a put of ``step`` that refers to it, on every host of the group
        alike (one round); False if it is gone already, or is not the shard the trainer put
        (its table's digest differs: deleted and put again by another process): the rank then
        puts its whole shard. ``asked``: the put's dry alloc asked for this base already (its
        round is under way or done); without ``wait``, the round is not waited for."""
        h = self.host
        key = (step, rank)
        with h.lock:
            held = h.catalog.steps.get(base)
            shard = held.shards.get(rank) if held is not None else None
            if held is None or not held.state.held or shard is None or shard.slot != h.slot:
                return False
            off, length = shard.table
            if digest(h.pool.get(shard.buffer).file.array[off : off + length]) != table:
                return False
            if not asked:
                h.catalog.pin_refused.discard(key)
        if not asked:
            h.emit(Pin(step, rank, base))  # (it replaces a pin of another base the dry one made)
        if not wait:
            return True
        h.wait_for(
            lambda: h.catalog.pins.get(key) == base or key in h.catalog.pin_refused,
            h.config.peer_timeout,
            f"keeping step {base} for step {step} rank {rank}",
        )
        with h.lock:
            if key in h.catalog.pin_refused:
                h.catalog.pin_refused.discard(key)
                return False
        return True

    def _op_ahead(self, msg: AheadRequest, conn: int) -> dict[str, Any]:
        """For rank ``rank``'s trainer (:meth:`storage.Store._start_ahead`): the files made ahead
        that its next puts will be given (``files``: [path, size], the first given first),
        whether more are being made (``making``), and every file of the rank here (``held``:
        paths; one it mapped that is not among them was deleted, and its mapping alone keeps
        its memory) with those adopted from an earlier daemon (``adopted``: deleted once freed).
        """
        h = self.host
        prefix = f"r{msg['rank']}-"
        files = [[str(h.pool.path(b.name)), b.size] for b in h.pool.made(prefix)]
        making = self.warmer is not None and self.warmer.making(prefix)
        held, adopted = h.pool.held(prefix)
        return {
            "files": files,
            "making": making,
            "held": [str(h.pool.path(n)) for n in held],
            "adopted": [str(h.pool.path(n)) for n in adopted],
        }

    def _op_premap(self, msg: PremapRequest, conn: int) -> dict[str, Any]:
        """For rank ``rank``'s trainer before its first put (:meth:`storage.Store._premap`):
        the reserve files claimed for it (``files``: [path, size]; :meth:`Pool.claim`), at most
        its share of ``--reserve`` (the reserve over this host's ranks, ``world_size`` ranks
        spread evenly over the hosts), and whether the reserve is still being made (``making``).
        """
        h = self.host
        per_host = -(-msg["world_size"] // len(h.hosts))
        bufs = h.pool.claim(f"r{msg['rank']}-", h.config.reserve // per_host)
        making = self.warmer is not None and self.warmer.reserving
        return {"files": [[str(h.pool.path(b.name)), b.size] for b in bufs], "making": making}

    def _op_staged(self, msg: StagedRequest, conn: int) -> dict[str, Any]:
        h = self.host
        step, rank, world, nbytes = msg["step"], msg["rank"], msg["world_size"], msg["nbytes"]
        table = msg["table"]
        if len(table) != 2:
            raise StorageError(f"bad request 'staged': table must be [offset, length], got {table}")
        if table[0] + table[1] > nbytes:
            raise StorageError(f"bad request 'staged': table {table} lies past the shard's end")
        with h.lock:
            name = h.pending.get((step, rank))
            if not name or name != msg.get("buffer"):
                raise StorageError(f"step {step} rank {rank} was not allocated on this host")
            if h.pending_conn.get((step, rank)) != conn:
                raise StorageError(
                    f"step {step} rank {rank} was allocated by another connection: two processes "
                    f"put as rank {rank} (check RANK / the rank given to storage.connect)"
                )
            size = h.pool.get(name).size
            if nbytes > size:
                # its chunks would lie past the file's end, and the group's exchange would hang
                # on them: the put stays allocated, for a staged that says what it copied
                raise StorageError(
                    f"bad request 'staged': nbytes {nbytes} is more than the {size} bytes of "
                    f"the buffer alloc gave step {step} rank {rank}"
                )
            base = msg.get("base", -1)
            if base >= 0 and h.catalog.pins.get((step, rank)) != base:
                # the put stays allocated: its abort (or its connection's end) frees the buffer
                raise StorageError(
                    f"step {step} rank {rank} refers to step {base}, which this put did not "
                    "announce in its alloc; put the whole shard"
                )
            del h.pending[(step, rank)]
            h.pending_conn.pop((step, rank), None)
            h.announced.add(step)
            t_alloc = h.t_alloc.get((step, rank))
            if t_alloc is not None:
                h.latency.stage.observe(time.monotonic() - t_alloc)
            shard = ShardRecord(rank, h.slot, nbytes, name, (table[0], table[1]), base)
            h.events.append(Staged(step, world, shard))
            h.stats["staged_bytes"] += nbytes
            h.stats["referenced_bytes"] += msg.get("refs", 0)
        h.cpu.add("stage", msg.get("cpu_stage", 0.0))
        h.cpu.add("hash", msg.get("cpu_hash", 0.0))
        h.wake.set()
        return {}

    def _op_abort(self, msg: AbortRequest, conn: int) -> dict[str, Any]:
        h = self.host
        step, rank = msg["step"], msg["rank"]
        key = (step, rank)
        with h.lock:
            # only the connection that allocated a put may give it up (another process with
            # the same rank, or a put refused before it allocated, leaves it alone)
            name = None
            early = None
            mine = h.pending_conn.get(key) == conn
            if mine:
                name = h.pending.pop(key, None)
                h.pending_conn.pop(key, None)
                h.t_alloc.pop(key, None)
            if key in h.early_pins and h.early_pins[key][1] == conn:
                early = h.early_pins.pop(key)
            pinned = (mine and key in h.catalog.pins) or early is not None
        h.pool.release(name or None)
        if pinned:
            h.emit(Unpin(step, rank))
        return {}

    def _op_wait(self, msg: WaitRequest, conn: int) -> dict[str, Any]:
        h = self.host
        step = msg["step"]
        # a round stalled by a peer is given up after the peer timeout, and naming the silent
        # hosts takes up to 3 s more: wait past both, so that the waiter hears why
        timeout = float(msg["timeout"] or 2 * h.config.peer_timeout + 5.0)
        outcome: dict[str, Any] = {}

        def settled() -> bool:
            rec = h.catalog.steps.get(step)
            if (rec is not None and rec.state == StepState.PROTECTED) or (
                step in h.catalog.recently_protected and step not in h.announced
            ):
                outcome["ok"] = True
            elif step in h.catalog.failed:
                outcome["error"] = from_wire(h.catalog.failed[step])
            elif (
                rec is None and step not in h.announced and not any(s == step for s, _ in h.pending)
            ):
                outcome["error"] = StepNotFoundError(
                    f"step {step} is not being put (deleted?)", step
                )
            return bool(outcome)

        with h.lock:
            h.waiters += 1  # live work: the warmer waits (storage.warm)
        try:
            try:
                h.wait_for(settled, timeout, f"the protection of step {step}")
            except StorageTimeoutError as exc:
                raise StorageTimeoutError(
                    f"{exc}; the storage job may be stuck or a rank never put it"
                ) from exc
            if "error" in outcome:
                raise outcome["error"]
            h.after_next_round()  # every host has written its manifest
        finally:
            with h.lock:
                h.waiters -= 1
        return {"step": step}

    # -- reading ----------------------------------------------------------------------------------

    def _resolve(self, step: Any) -> StepRec:
        h = self.host
        cat = h.catalog
        with h.lock:
            if step is None:
                latest = cat.latest()
                lost = [s for s, r in cat.steps.items() if r.state == StepState.LOST]
                if latest is None and lost:
                    step = max(lost)  # nothing can be read: say what was lost
                elif latest is None:
                    raise StepNotFoundError("no protected step yet", None)
                else:
                    step = latest
            if type(step) is not int or step < 0:
                raise StorageError(f"step must be an int >= 0 or None, got {step!r}")
            rec = cat.steps.get(step)
            if rec is not None and rec.state == StepState.LOST:
                newest = cat.latest()
                raise SnapshotUnrecoverableError(
                    f"step {step} cannot be rebuilt: hosts {rec.lost['lost_hosts']} lost more "
                    f"than m={h.m} chunks of a stripe, so ranks {rec.lost['ranks']} are gone. "
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
            if rec is None or rec.state != StepState.PROTECTED:
                held = cat.protected()
                raise StepNotFoundError(
                    f"step {step} is not protected on job {h.config.job!r} "
                    f"(protected steps: {held or 'none'})",
                    step,
                )
            return rec

    def _op_get(self, msg: GetRequest, conn: int) -> dict[str, Any]:
        """A shard: from this host's memory (checked), or fetched from the host holding it.

        A chunk that fails its checksum (or a truncated file) is repaired from its group by all
        daemons in the next round, and the read tried again.
        """
        h = self.host
        if "rank" not in msg:
            raise StorageError("bad request: request 'get' lacks 'rank'")
        rank = msg["rank"]
        want = msg.get("step")
        meta_only = bool(msg.get("meta_only"))
        if "base_of" in msg:
            return self._get_base(msg["base_of"], want, rank, meta_only, conn)
        self.tier.await_restore(want)
        for _attempt in range(3):
            disk = self.tier.steps()
            if want is None and disk:
                with h.lock:
                    latest = h.catalog.latest()
                if latest is None or disk[-1] > latest:
                    return self.tier.read(disk[-1], rank, meta_only)
            try:
                rec = self._resolve(want)
            except (StepNotFoundError, SnapshotUnrecoverableError):
                if want in disk:  # memory cannot serve it: the persistent tier can
                    return self.tier.read(int(want), rank, meta_only)
                raise
            if rank >= rec.world_size:
                raise StepNotFoundError(
                    f"step {rec.step} has no rank {rank} (world_size {rec.world_size})", rec.step
                )
            reply = self._serve(rec.step, rec.shards.get(rank), rank, meta_only, conn)
            if reply is not None:
                return reply
        raise StorageError(
            f"step {want} rank {rank}: chunks still fail their checksums after repair"
        )

    def _get_base(
        self, referrer: int, base: Any, rank: int, meta_only: bool, conn: int
    ) -> dict[str, Any]:
        """Rank ``rank``'s shard of ``base``, which its shard of the protected step ``referrer``
        refers to for its unchanged tensors (``base`` itself may be gone for readers: pinned)."""
        h = self.host
        if type(base) is not int or base < 0:
            raise StorageError(f"step must be an int >= 0, got {base!r}")
        for _attempt in range(3):
            ref = self._resolve(referrer)  # kept, so its base is kept too
            with h.lock:
                # only the base the referrer's shard names (a pinned step is no one else's to
                # read); a shard of another group's rank is checked by the host that holds it
                mine = ref.shards.get(rank)
                if mine is not None and mine.base != base:
                    raise StepNotFoundError(
                        f"step {referrer} rank {rank} does not refer to step {base}", base
                    )
                rec = h.catalog.steps.get(base)
                shard = rec.shards.get(rank) if rec is not None and rec.state.held else None
            reply = self._serve(base, shard, rank, meta_only, conn, base_of=referrer)
            if reply is not None:
                return reply
        raise StorageError(
            f"step {base} rank {rank}: chunks still fail their checksums after repair"
        )

    def _serve(
        self,
        step: int,
        shard: ShardRecord | None,
        rank: int,
        meta_only: bool,
        conn: int,
        base_of: int = -1,
    ) -> dict[str, Any] | None:
        """The reply for ``rank``'s shard of ``step``: from this host's memory if ``shard`` is
        here, else fetched from the host holding it; None if chunks failed their checksums
        (a repair was asked for: try again)."""
        h = self.host
        if shard is not None and shard.slot == h.slot:
            # The lease first, then the checks: retention may retire the step meanwhile, and
            # a buffer freed before its lease was taken went to the next put, whose bytes the
            # reader's views then showed. Under the lock the step is still held with this shard
            # (else None: the caller resolves again), and its buffer leased stays out of reuse.
            with h.lock:
                rec = h.catalog.steps.get(step)
                held = rec.shards.get(rank) if rec is not None and rec.state.held else None
                if rec is None or held is None or held.buffer != shard.buffer:
                    return None
                if not meta_only:
                    self.leases.take(shard.buffer, conn)
            bad = self.repairer.lost_chunks(rec, rank)
            if not bad:
                h.phase("serving")
                if meta_only:
                    return {"step": step, "meta": h.table(rec, rank)}
                return {
                    "step": step,
                    "nbytes": shard.nbytes,
                    "table": list(shard.table),
                    "path": str(h.pool.path(shard.buffer)),
                    "size": h.pool.get(shard.buffer).size,
                    "buffer": shard.buffer,
                    "temp": False,
                }
            if not meta_only:
                self.leases.end(shard.buffer, conn)
            h.log(
                f"step {step} rank {rank}: {len(bad)} chunk(s) missing or failing "
                "their checksum here; repairing from the group"
            )
            self.repairer.request(step, h.slot, bad)
            return None
        # held by another host (of this group or another): it is fetched
        result = self.fetcher.fetch(step, rank, table_only=meta_only, base_of=base_of)
        if "bad" in result:
            self.repairer.request(step, int(result["slot"]), result["bad"])
            return None
        if meta_only:
            return {"step": step, "meta": result["meta"]}
        return {
            "step": step,
            "nbytes": result["size"],
            "table": result["table"],
            "path": result["path"],
            "size": result["size"],
            "temp": True,
        }

    def _op_release(self, msg: ReleaseRequest, conn: int) -> dict[str, Any]:
        path = Path(msg["path"])
        if path.parent != self.host.dir / "tmp":
            raise StorageError(f"{path} is not a temporary file of this daemon")
        with self.host.lock:
            self.temps.get(conn, set()).discard(str(path))
        self.host.pool.temp_gone(path)
        return {}

    def _op_unlease(self, msg: UnleaseRequest, conn: int) -> dict[str, Any]:
        """The views of one get of each named buffer are gone (a name once per get; the buffer
        may be reused when every lease on it has ended)."""
        for name in msg["buffers"]:
            self.leases.end(name, conn)
        return {}

    # -- the catalog -------------------------------------------------------------------------------

    def _op_steps(self, msg: PlainRequest, conn: int) -> dict[str, Any]:
        disk = self.tier.steps()
        with self.host.lock:
            return {"steps": self.host.catalog.protected(), "disk": disk}

    def _op_status(self, msg: StepRequest, conn: int) -> dict[str, Any]:
        h = self.host
        step = msg["step"]
        disk = self.tier.steps()
        with h.lock:
            rec = h.catalog.steps.get(step)
            if rec is not None and rec.state != StepState.PINNED:
                done = rec.state in (StepState.PROTECTED, StepState.LOST)
                return {
                    "step": step,
                    "world_size": rec.world_size,
                    "state": str(rec.state),
                    # in flight, this host's group knows its own ranks; the count is everyone's
                    "ranks_staged": list(range(rec.world_size)) if done else sorted(rec.shards),
                    "staged_count": rec.world_size if done else rec.staged,
                    "hosts": sorted(h.hosts)
                    if done
                    else sorted({h.hosts[s.slot] for s in rec.shards.values()}),
                    "data_bytes": rec.data_bytes,
                    "parity_bytes": rec.parity_bytes,
                }
        if step not in disk:
            raise StepNotFoundError(f"step {step} is not held on job {h.config.job!r}", step)
        m = self.tier.manifest(step)
        return {
            "step": step,
            "world_size": m["world_size"],
            "state": "persisted",
            "ranks_staged": sorted(int(r) for r in m["ranks"]),
            "staged_count": len(m["ranks"]),
            "hosts": sorted({e["host"] for e in m["ranks"].values()}),
            "data_bytes": sum(int(e["nbytes"]) for e in m["ranks"].values()),
            "parity_bytes": 0,
        }

    def _op_delete(self, msg: StepRequest, conn: int) -> dict[str, Any]:
        h = self.host
        step = msg["step"]

        def gone() -> bool:
            rec = h.catalog.steps.get(step)
            return rec is None or rec.state == StepState.PINNED

        disk = step in self.tier.steps()
        with h.lock:
            if gone() and not disk:
                raise StepNotFoundError(f"step {step} is not held on job {h.config.job!r}", step)
        h.emit(Delete(step))
        h.wait_for(gone, h.config.peer_timeout, f"deleting step {step}")
        # every daemon has applied the delete; the next round's local work removes the manifests
        # (storage.rounds.Rounds.retiring), so the round after it completes once every host has:
        # a restart then agrees that the step is gone
        h.after_next_round()
        h.after_next_round()
        self.tier.remove(step)  # the disk is shared: gone before the answer (and no restart
        return {}  # puts it back); the first daemon removes it again after a queued publish

    def _op_info(self, msg: PlainRequest, conn: int) -> dict[str, Any]:
        """Counters for benchmarks and status: bytes held and moved, health, repairs."""
        snap: Snapshot = self.snapshot()
        return snap.to_json()
