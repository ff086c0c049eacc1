"""The persistent tier inside the daemon: protected steps written to ``--persist-dir`` in the
background, published once every rank's file is there, put back into memory at start-up, and
read straight from disk when memory cannot serve a step.

Every daemon queues every step to persist (each one writes the ranks it holds, maybe none), in
step order, on one writer thread; its ballot says how far it has written (the job's minimum
travels, fixed size); once every daemon has written a step, the first daemon publishes it,
reading each rank's entry from the step's partial directory (the directory is shared by the
hosts, as a parallel file system is). A write that fails is a rare event: the step is skipped.

Who calls it: the round engine (:meth:`Tier.persist` for every newly protected step,
:meth:`Tier.written_through` for its ballot, :meth:`Tier.written_everywhere` and
:meth:`Tier.failed` with what the round brought, :meth:`Tier.settle` each round), adoption at
start-up (:meth:`Tier.restore_newest`, collective), the socket service (:meth:`Tier.read`,
:meth:`Tier.steps`, :meth:`Tier.await_restore`). What it owns: the writer thread, how far it
wrote, the steps waiting to be published, and the step being put back. Lock: the host's
``lock`` for those; disk I/O runs on the writer thread or the caller's, never under it. The disk
format is :mod:`storage.persist`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from codec import checksum
from storage import persist
from storage.catalog import StepRec, StepState
from storage.cpu import charged
from storage.errors import CapacityError, StepNotFoundError, StorageError
from storage.host import Host
from storage.leases import PERSIST, Leases
from storage.protocol import PersistFailed, ShardRecord, Staged
from storage.table import pack_table, table_place, whole
from transport import shm

__all__ = ["Tier"]


def _write_json(path: Path, body: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, separators=(",", ":"))


def _lower_priority() -> None:
    """Run the calling thread at the lowest CPU priority (nice 19; on Linux, per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class Tier:
    def __init__(self, host: Host, leases: Leases) -> None:
        self.host = host
        self.leases = leases
        self.root = host.config.persist_dir
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="ecsnap-persist")
            if self.root is not None
            else None
        )
        # Writes are counted in the order they are queued, the same order on every daemon (each
        # queues every newly protected step): ``through`` is the count written here. Not step
        # numbers: a step deleted and put again is queued after higher ones, and was published
        # as soon as queued, before its files were written (the higher one's count had passed).
        self.queued = 0
        self.through = 0
        # step -> (world size, its count), written here, not yet public
        self.unpublished: dict[int, tuple[int, int]] = {}
        self.broken: set[int] = set()  # steps some daemon failed to write
        self.restoring: int | None = None  # a step being put back from disk at start-up

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # -- writing ----------------------------------------------------------------------------------

    def persist(self, rec: StepRec) -> None:
        """Queue this host's shards of a newly protected step for the disk (the round thread)."""
        h = self.host
        if self._writer is None or self.root is None:
            return
        if rec.step % h.config.persist_every:
            return
        # a step put back from disk is there already; any other is written, replacing what the
        # disk holds of its number (a step deleted and put again, or lost and put afresh)
        on_disk = rec.step == self.restoring
        mine: list[tuple[int, ShardRecord, ShardRecord | None]] = []
        checks: dict[str, list[tuple[int, int, int, int]]] = {}  # buffer -> StepRec.chunk_checks
        if not on_disk:
            for r, shard in sorted(rec.shards.items()):
                if shard.slot != h.slot:
                    continue
                held = h.catalog.steps.get(shard.base) if shard.base >= 0 else None
                base = held.shards.get(r) if held is not None else None
                mine.append((r, shard, base))
                checks[shard.buffer] = rec.chunk_checks(r)
                if base is not None and held is not None:
                    checks[base.buffer] = held.chunk_checks(r)
        for _, shard, base in mine:
            self.leases.take(shard.buffer, PERSIST)  # kept past retention until written
            if base is not None:
                self.leases.take(base.buffer, PERSIST)
        self.queued += 1
        if not on_disk:
            self.unpublished[rec.step] = (rec.world_size, self.queued)
        self._writer.submit(self._write, rec.step, mine, checks, self.queued)

    @charged("persist")
    def _write(
        self,
        step: int,
        mine: list[tuple[int, ShardRecord, ShardRecord | None]],
        checks: dict[str, list[tuple[int, int, int, int]]] | None = None,
        count: int = 0,
    ) -> None:
        """Write this host's shards of ``step`` to the partial directory (writer thread): each
        rank's safetensors file and its manifest entry beside it. A shard that refers to a base
        step is written whole, its unchanged tensors read from the base's shard: every step on
        disk is readable alone."""
        h = self.host
        assert self.root is not None
        _lower_priority()
        t0 = time.monotonic()
        try:
            if mine:
                partial = persist.partial_dir(self.root, h.config.job, step)
                partial.mkdir(mode=0o700, parents=True, exist_ok=True)
            h.phase("persisting")
            written = 0
            for name, chunks in (checks or {}).items():
                # the bytes are checked before they go to disk under a checksum of their own:
                # a bit flipped in memory is not persisted as good (a read repairs it)
                array = h.pool.get(name).file.array
                for _, off, n, want in chunks:
                    if checksum(array[off : off + n]) != want:
                        h.stats["checksum_failures"] += 1
                        raise StorageError(
                            f"a chunk of {name} fails its checksum here; not persisted"
                        )
            for rank, shard, base in mine:
                array = h.pool.get(shard.buffer).file.array
                meta = h.shard_table(step, rank, shard)
                referred = None
                if shard.base >= 0:
                    if base is None:
                        raise StorageError(f"rank {rank}'s base step {shard.base} is not held")
                    referred = h.pool.get(base.buffer).file.array[: base.table[0]]
                entry = persist.write_rank(
                    partial / f"rank-{rank}.safetensors",
                    meta,
                    array[: shard.table[0]],
                    self._yield_to_puts,
                    base=referred,
                )
                leaves, nbytes = whole(meta["leaves"])
                meta = {"skeleton": meta["skeleton"], "leaves": leaves}
                entry.update(meta=meta, nbytes=nbytes, host=h.name)
                _write_json(partial / f"rank-{rank}.json", entry)
                written += int(entry["bytes"])
            h.stats["persist_bytes"] += written
            h.stats["persist_seconds"] += time.monotonic() - t0
        except (OSError, StorageError, KeyError, ValueError) as exc:
            h.emit(PersistFailed(step, f"{type(exc).__name__}: {exc}"))
        finally:
            for _, shard, base in mine:
                self.leases.end(shard.buffer, PERSIST)
                if base is not None:
                    self.leases.end(base.buffer, PERSIST)
            with h.lock:
                self.through = count
            h.wake.set()

    def _yield_to_puts(self) -> None:
        """Hold the disk writer while a trainer on this host is staging a put (at most 2 s at a
        time, so a job that puts back to back still gets its steps written between puts)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with self.host.lock:
                if not self.host.pending:
                    return
            time.sleep(0.002)

    def written_through(self) -> int | None:
        """For this daemon's ballot: how many of the steps it queued are written, in queue
        order (None without a persistent tier)."""
        return None if self._writer is None else self.through

    def failed(self, event: PersistFailed) -> None:
        """A daemon could not write its part of ``event.step``: it is not published (the round
        thread)."""
        h = self.host
        self.broken.add(event.step)
        h.log(f"step {event.step} was not persisted: {event.error}")
        if h.rank == 0 and self._writer is not None and self.root is not None:
            partial = persist.partial_dir(self.root, h.config.job, event.step)
            self._writer.submit(shutil.rmtree, partial, True)

    def deleted(self, step: int) -> None:
        """``step`` was deleted (the round thread, every daemon): never published, and the first
        daemon removes it from disk after whatever its writer had queued (a publish of it)."""
        h = self.host
        if self._writer is None or self.root is None:
            return
        if step in self.unpublished:
            self.broken.add(step)
        if h.rank == 0:
            self._writer.submit(self.remove, step)

    def remove(self, step: int) -> bool:
        """Remove ``step``'s directories from disk now; whether it was published there."""
        if self.root is None:
            return False
        job = self.host.config.job
        final = persist.step_dir(self.root, job, step)
        was = (final / "manifest.json").is_file()
        shutil.rmtree(final, ignore_errors=True)
        shutil.rmtree(persist.partial_dir(self.root, job, step), ignore_errors=True)
        return was

    def written_everywhere(self, upto: int) -> None:
        """Every daemon has written the first ``upto`` steps it queued: the first daemon
        publishes them (the round thread)."""
        h = self.host
        for step in sorted(s for s, (_, n) in self.unpublished.items() if n <= upto):
            world = self.unpublished.pop(step)[0]
            if step in self.broken:
                self.broken.discard(step)
                continue
            h.stats["persisted_steps"] += 1
            if h.rank == 0 and self._writer is not None:
                self._writer.submit(self._publish, step, world)

    def _publish(self, step: int, world: int) -> None:
        h = self.host
        assert self.root is not None
        partial = persist.partial_dir(self.root, h.config.job, step)
        try:
            ranks = {r: json.loads((partial / f"rank-{r}.json").read_text()) for r in range(world)}
            for r in range(world):
                (partial / f"rank-{r}.json").unlink()
            persist.publish(self.root, h.config.job, step, world, ranks)
            gone = persist.prune(self.root, h.config.job, h.config.persist_keep)
            if h.trace:
                h.log(f"step {step} persisted; removed from disk: {gone or 'none'}")
        except (OSError, ValueError) as exc:
            h.log(f"publishing step {step} on disk failed: {exc}")

    # -- putting back and reading -----------------------------------------------------------------

    @charged("persist")
    def restore_newest(self) -> None:
        """Put the newest persisted step back into memory if memory holds nothing as new
        (collective, at start-up). Each daemon reads the ranks whose host it is (or that fall to
        its slot) and stages them as a trainer would; the usual rounds then protect the step."""
        h = self.host
        if self.root is None:
            return
        t0 = time.monotonic()
        root, job = self.root, h.config.job
        if h.rank == 0:
            persist.remove_partials(root, job)
            disk = persist.complete_steps(root, job)
        else:
            disk = None
        disk = h.links.allgather_json(disk, "persisted steps")[0]
        latest = h.catalog.latest()
        if not disk or (latest is not None and disk[-1] <= latest):
            return
        step = int(disk[-1])
        taken: list[tuple[int, Any, tuple[int, int, int]]] = []
        error = None
        try:
            m = persist.manifest(root, job, step)
            for r, entry in sorted(m["ranks"].items(), key=lambda kv: int(kv[0])):
                host = entry.get("host")
                slot = h.hosts.index(host) if host in h.hosts else int(r) % h.nslots
                if slot != h.slot:
                    continue
                nbytes = int(entry["nbytes"])
                table = pack_table(entry["meta"]["skeleton"], entry["meta"]["leaves"])
                off, total = table_place(nbytes, len(table))
                buf = h.pool.take(total, f"r{r}-")
                taken.append((int(r), buf, (off, len(table), total)))
                persist.read_rank(persist.step_dir(root, job, step), entry, buf.file.array)
                buf.file.array[off:total] = np.frombuffer(table, dtype=np.uint8)
        except StorageError as exc:
            error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in h.links.allgather_json(error, f"restore of {step}") if e]
        if errors:
            for _, buf, _ in taken:
                h.pool.release(buf.name)
            h.log(f"cannot put step {step} back from {root}: {errors[0]}")
            return
        world = int(m["world_size"])
        with h.lock:
            for r, buf, (off, length, total) in taken:
                shard = ShardRecord(r, h.slot, total, buf.name, (off, length))
                h.events.append(Staged(step, world, shard))
                h.announced.add(step)
            self.restoring = step
        h.stats["restored_steps"] += 1
        h.stats["restore_read_seconds"] = time.monotonic() - t0
        h.log(f"putting step {step} back from {root} ({len(taken)} rank(s) here)")

    def settle(self) -> None:
        """The step being put back is done once protected, failed or lost (the round thread)."""
        h = self.host
        with h.lock:
            if self.restoring is not None:
                rec = h.catalog.steps.get(self.restoring)
                if rec is None or rec.state in (
                    StepState.PROTECTED,
                    StepState.FAILED,
                    StepState.LOST,
                ):
                    self.restoring = None

    def steps(self) -> list[int]:
        """Steps published on disk, ascending (disk I/O: never under the lock)."""
        if self.root is None:
            return []
        return persist.complete_steps(self.root, self.host.config.job)

    def await_restore(self, step: int | None) -> None:
        """A read of the step being put back from disk waits until it is protected again."""
        h = self.host
        h.wait_for(
            lambda: self.restoring is None or step not in (None, self.restoring),
            h.config.peer_timeout,
            f"putting step {self.restoring} back from disk",
        )

    def read(self, step: int, rank: int, meta_only: bool) -> dict[str, Any]:
        """Rank ``rank`` of persisted ``step``: read into a temporary file the caller maps, laid
        out as a shard in memory (its table after its leaves)."""
        h = self.host
        assert self.root is not None
        m = persist.manifest(self.root, h.config.job, step)
        entry = m["ranks"].get(str(rank))
        if entry is None:
            raise StepNotFoundError(
                f"step {step} on disk has no rank {rank} (world_size {m['world_size']})", step
            )
        nbytes = int(entry["nbytes"])
        if meta_only:
            return {"step": step, "meta": entry["meta"], "tier": "disk"}
        table = pack_table(entry["meta"]["skeleton"], entry["meta"]["leaves"])
        off, total = table_place(nbytes, len(table))
        path = h.dir / "tmp" / f"disk-{h.next_id('d')}"
        try:
            tmp = shm.create(path, max(total, 1), prefault_pages=False)
        except OSError as exc:
            msg = f"no memory to read step {step} rank {rank} from disk: {exc}"
            raise CapacityError(msg) from exc
        h.pool.temp_made(path, max(total, 1))
        try:
            persist.read_rank(persist.step_dir(self.root, h.config.job, step), entry, tmp.array)
            tmp.array[off:total] = np.frombuffer(table, dtype=np.uint8)
        except StorageError:
            h.pool.temp_gone(path)
            raise
        finally:
            tmp.close()
        h.stats["disk_reads"] += 1
        return {
            "step": step,
            "nbytes": total,
            "table": [off, len(table)],
            "tier": "disk",
            "path": str(path),
            "size": max(total, 1),
            "temp": True,
        }

    def manifest(self, step: int) -> dict[str, Any]:
        assert self.root is not None
        return persist.manifest(self.root, self.host.config.job, step)
