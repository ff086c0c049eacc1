"""The persistent tier inside the daemon: protected steps written to ``--persist-dir`` in the
background, published once every rank's file is there, put back into memory at start-up, and
read straight from disk when memory cannot serve a step.

Who calls it: the round engine (:meth:`Tier.persist` for every newly protected step,
:meth:`Tier.on_event` for ``persisted`` / ``persist_failed`` events, :meth:`Tier.settle` each
round), adoption at start-up (:meth:`Tier.restore_newest`, collective), the socket service
(:meth:`Tier.read`, :meth:`Tier.steps`, :meth:`Tier.await_restore`). What it owns: the writer
thread, the ranks written so far per step, and the step being put back. Lock: the host's
``lock`` for those; disk I/O runs on the writer thread or the caller's, never under it. The disk
format is :mod:`storage.persist`'s.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from storage import persist
from storage.catalog import StepRec, StepState
from storage.errors import CapacityError, StepNotFoundError, StorageError
from storage.host import Host
from storage.leases import PERSIST, Leases
from transport import shm

__all__ = ["Tier"]


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
        self.acc: dict[int, dict[str, Any]] = {}  # step -> ranks persisted so far
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
        if persist.step_dir(self.root, h.config.job, rec.step).exists():
            return  # put back from disk: it is there already
        mine = [(r, s.buffer, s.meta, s.nbytes) for r, s in rec.shards.items() if s.slot == h.slot]
        for _, name, _, _ in mine:
            self.leases.take(name, PERSIST)  # kept past retention until written
        self._writer.submit(self._write, rec.step, rec.world_size, mine)

    def _write(
        self, step: int, world: int, mine: list[tuple[int, str, dict[str, Any], int]]
    ) -> None:
        """Write this host's shards of ``step`` to the partial directory (writer thread)."""
        h = self.host
        assert self.root is not None
        _lower_priority()
        t0 = time.monotonic()
        event: dict[str, Any] = {"e": "persisted", "step": step, "world_size": world}
        try:
            partial = persist.partial_dir(self.root, h.config.job, step)
            partial.mkdir(mode=0o700, parents=True, exist_ok=True)
            entries = {}
            written = 0
            for rank, name, meta, nbytes in mine:
                data = h.pool.get(name).file.array[:nbytes]
                entry = persist.write_rank(
                    partial / f"rank-{rank}.safetensors", meta, data, self._yield_to_puts
                )
                entry.update(meta=meta, nbytes=nbytes, host=h.name)
                entries[str(rank)] = entry
                written += int(entry["bytes"])
            event["ranks"] = entries
            h.stats["persist_bytes"] += written
            h.stats["persist_seconds"] += time.monotonic() - t0
        except (OSError, StorageError, KeyError) as exc:
            event = {"e": "persist_failed", "step": step, "error": f"{type(exc).__name__}: {exc}"}
        for _, name, _, _ in mine:
            self.leases.end(name, PERSIST)
        h.emit(event)

    def _yield_to_puts(self) -> None:
        """Hold the disk writer while a trainer on this host is staging a put (at most 2 s at a
        time, so a job that puts back to back still gets its steps written between puts)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with self.host.lock:
                if not self.host.pending:
                    return
            time.sleep(0.002)

    def on_event(self, event: dict[str, Any]) -> None:
        """Gather persisted ranks; once all are on disk the leader publishes (the round thread)."""
        h = self.host
        step = int(event["step"])
        if event["e"] == "persist_failed":
            self.acc.pop(step, None)
            h.log(f"step {step} was not persisted: {event.get('error')}")
            if h.rank == 0 and self._writer is not None and self.root is not None:
                partial = persist.partial_dir(self.root, h.config.job, step)
                self._writer.submit(shutil.rmtree, partial, True)
            return
        acc = self.acc.setdefault(step, {"world": int(event["world_size"]), "ranks": {}})
        acc["ranks"].update({int(r): e for r, e in event.get("ranks", {}).items()})
        if len(acc["ranks"]) < acc["world"]:
            return
        del self.acc[step]
        h.stats["persisted_steps"] += 1
        if h.rank == 0 and self._writer is not None:
            self._writer.submit(self._publish, step, acc["world"], acc["ranks"])

    def _publish(self, step: int, world: int, ranks: dict[int, Any]) -> None:
        h = self.host
        assert self.root is not None
        try:
            persist.publish(self.root, h.config.job, step, world, ranks)
            gone = persist.prune(self.root, h.config.job, h.config.persist_keep)
            if h.trace:
                h.log(f"step {step} persisted; removed from disk: {gone or 'none'}")
        except OSError as exc:
            h.log(f"publishing step {step} on disk failed: {exc}")

    # -- putting back and reading -----------------------------------------------------------------

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
        taken: list[tuple[int, Any, dict[str, Any]]] = []
        error = None
        try:
            m = persist.manifest(root, job, step)
            for r, entry in sorted(m["ranks"].items(), key=lambda kv: int(kv[0])):
                host = entry.get("host")
                slot = h.hosts.index(host) if host in h.hosts else int(r) % h.nslots
                if slot != h.slot:
                    continue
                nbytes = int(entry["nbytes"])
                buf = h.pool.take(nbytes, f"r{r}-")
                taken.append((int(r), buf, entry))
                persist.read_rank(persist.step_dir(root, job, step), entry, buf.file.array)
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
            for r, buf, entry in taken:
                shard = {
                    "rank": r,
                    "slot": h.slot,
                    "nbytes": int(entry["nbytes"]),
                    "buffer": buf.name,
                    "meta": entry["meta"],
                }
                h.events.append({"e": "staged", "step": step, "world_size": world, "shard": shard})
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
        """Rank ``rank`` of persisted ``step``: read into a temporary file the caller maps."""
        h = self.host
        assert self.root is not None
        m = persist.manifest(self.root, h.config.job, step)
        entry = m["ranks"].get(str(rank))
        if entry is None:
            raise StepNotFoundError(
                f"step {step} on disk has no rank {rank} (world_size {m['world_size']})", step
            )
        nbytes = int(entry["nbytes"])
        out = {"step": step, "meta": entry["meta"], "nbytes": nbytes, "tier": "disk"}
        if meta_only:
            return out
        path = h.dir / "tmp" / f"disk-{h.next_id('d')}"
        try:
            tmp = shm.create(path, max(nbytes, 1), prefault_pages=False)
        except OSError as exc:
            msg = f"no memory to read step {step} rank {rank} from disk: {exc}"
            raise CapacityError(msg) from exc
        try:
            persist.read_rank(persist.step_dir(self.root, h.config.job, step), entry, tmp.array)
        except StorageError:
            path.unlink(missing_ok=True)
            raise
        finally:
            tmp.close()
        h.stats["disk_reads"] += 1
        return {**out, "path": str(path), "size": max(nbytes, 1), "temp": True}

    def manifest(self, step: int) -> dict[str, Any]:
        assert self.root is not None
        return persist.manifest(self.root, self.host.config.job, step)
