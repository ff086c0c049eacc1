"""Moving a shard (or only its tensor table) to the host whose trainer reads it, when another host
holds it.

No daemon knows where every rank's shard lies (that would grow with the job), so a read from
elsewhere asks the whole job, and the holder answers; both are rare events (see
:mod:`storage.rounds`):

1. the reader's daemon emits a :class:`Fetch` (step, rank, the reader's slot);
2. in the round that carries it, the daemon holding that shard emits an :class:`Offer`: its size
   and the checksum of each of its chunks;
3. in the round that carries the offer, the holder sends the bytes and the reader receives them
   into a temporary file under ``tmp/`` and checks every chunk. A fetch that no daemon offered
   in the round after it (the step was deleted meanwhile) fails as gone.

Who calls it: the socket service (:meth:`Fetcher.fetch`, which waits), and the round engine
(:meth:`Fetcher.serve`, the round's local work). What it owns: the round's fetches and offers,
the fetches this host waits for, and their results. Lock: the host's ``lock`` for those; the
transfer runs without it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from codec import checksum
from storage.catalog import StepState
from storage.cpu import charged
from storage.errors import StepNotFoundError, StorageError
from storage.host import Host
from storage.protocol import Fetch, Offer
from transport import shm

__all__ = ["TAG_FETCH", "Fetcher"]

TAG_FETCH = 13


class Fetcher:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.requests: list[Fetch] = []  # fetches the last round carried, every daemon's
        self.offers: list[Offer] = []  # offers the last round carried
        self.waiting: dict[str, tuple[Fetch, int]] = {}  # my fetches -> the round they were seen
        self.results: dict[str, dict[str, Any]] = {}  # fetch id -> result, for its reader
        # offers made: fetch id -> (buffer, the table's place if only the table is sent)
        self._sending: dict[str, tuple[str, tuple[int, int] | None]] = {}
        self.abandoned: set[str] = set()  # fetch ids whose readers stopped waiting

    def busy(self) -> bool:
        return bool(self.requests or self.offers or self.waiting)

    def fetch(
        self, step: int, rank: int, table_only: bool = False, base_of: int = -1
    ) -> dict[str, Any]:
        """``rank``'s shard of ``step`` here (a socket-service thread): ``{"path", "size",
        "table"}`` of a temporary file; with ``table_only``, ``{"meta"}``, its tensor table; or
        ``{"bad": [chunks], "slot"}`` if it failed its checksums on the way."""
        h = self.host
        fid = h.next_id("f")
        h.emit(Fetch(fid, step, rank, h.slot, table_only, base_of))
        try:
            h.wait_for(
                lambda: fid in self.results,
                h.config.peer_timeout,
                f"fetching step {step} rank {rank}",
            )
        except StorageError:
            with h.lock:
                done = self.results.pop(fid, None)
                if done is None:
                    self.abandoned.add(fid)  # its file, if one comes, goes
            if done is not None and "path" in done:
                h.pool.temp_gone(done["path"])
            raise
        with h.lock:
            result = self.results.pop(fid)
        if "error" in result:
            raise StepNotFoundError(f"step {step} rank {rank}: {result['error']}", step)
        return result

    def serve(self) -> None:
        """The round's local work (the round thread): offer what this host holds of the last
        round's fetches, and move the shards of its offers."""
        h = self.host
        with h.lock:
            fetches, self.requests = self.requests, []
            offers, self.offers = self.offers, []
            for f in fetches:
                if f.to == h.slot:
                    self.waiting[f.id] = (f, h.rounds)
                else:
                    offer = self._offer(f)
                    if offer is not None:
                        h.emit(offer)
        for o in offers:
            if o.holder == h.slot:
                self._send(o)
            elif o.to == h.slot:
                self._receive(o)
        with h.lock:
            for fid, (_f, seen) in list(self.waiting.items()):
                if h.rounds > seen + 1 and fid not in self.results:
                    del self.waiting[fid]
                    self._finish(fid, {"error": "gone (deleted, or not held by any host)"})

    @charged("fetch")
    def _offer(self, f: Fetch) -> Offer | None:
        """The offer of a shard this host holds (under the lock), else None."""
        h = self.host
        rec = h.catalog.steps.get(f.step)
        loc = h.local.get(f.step)
        if rec is None or not rec.state.held or loc is None:
            return None
        shard = rec.shards.get(f.rank)
        if shard is None or shard.slot != h.slot or f.rank not in loc.buffers:
            return None
        if rec.state == StepState.PINNED:
            # gone for readers: only through a protected step whose shard of the rank names it
            ref = h.catalog.steps.get(f.base_of)
            mine = ref.shards.get(f.rank) if ref is not None else None
            if ref is None or ref.state != StepState.PROTECTED or mine is None:
                return None
            if mine.base != f.step:
                return None
        chunks = [list(check) for check in rec.chunk_checks(f.rank)]
        if f.table_only:
            # only the table travels: the chunks it lies in are checked here, before it goes
            # (the reader parses it), and a bad one is named instead, for the group to repair
            off, length = shard.table
            array = h.pool.get(shard.buffer).file.array
            bad = [
                c
                for c, o, n, want in chunks
                if o < off + length and off < o + n and checksum(array[o : o + n]) != want
            ]
            if bad:
                h.stats["checksum_failures"] += len(bad)
                return Offer(f.id, f.to, h.slot, 0, [-1, -1], [[c] for c in bad], "checksum")
        self._sending[f.id] = (shard.buffer, shard.table if f.table_only else None)
        nbytes = shard.table[1] if f.table_only else shard.nbytes
        return Offer(f.id, f.to, h.slot, nbytes, list(shard.table), [] if f.table_only else chunks)

    @charged("fetch")
    def _send(self, o: Offer) -> None:
        h = self.host
        if o.error == "checksum":
            return  # nothing is sent: the reader asks for a repair
        buffer, table = self._sending.pop(o.id)
        array = h.pool.get(buffer).file.array
        view = array[table[0] : table[0] + table[1]] if table is not None else array[: o.nbytes]
        h.links.wait(
            h.links.isend(view, h.rank_of[o.to], TAG_FETCH),
            "shard fetch (send)",
            busy=True,
            transfer=True,
        )

    @charged("fetch")
    def _receive(self, o: Offer) -> None:
        h = self.host
        src = h.rank_of[o.holder]
        with h.lock:
            f, _ = self.waiting.pop(o.id, (None, 0))
        if f is None:
            return
        if o.error == "checksum":
            self._finish(o.id, {"bad": [c[0] for c in o.chunks], "slot": o.holder})
            return
        if f.table_only:
            raw = np.empty(o.nbytes, dtype=np.uint8)
            h.links.wait(
                h.links.irecv(raw, src, TAG_FETCH), "table fetch", busy=True, transfer=True
            )
            try:  # checked by its holder; a bad table is the reader's error, not the daemon's
                meta = json.loads(raw.tobytes())
            except ValueError as exc:
                self._finish(o.id, {"error": f"its tensor table does not parse: {exc}"})
                return
            self._finish(o.id, {"meta": meta})
            return
        path = h.dir / "tmp" / f"fetch-{o.id}"
        try:
            tmp = shm.create(path, max(o.nbytes, 1), prefault_pages=False)
        except OSError as exc:
            # the holder sends regardless: drain it into scratch so MPI stays in step
            sink = np.empty(o.nbytes, dtype=np.uint8)
            h.links.wait(
                h.links.irecv(sink, src, TAG_FETCH), "shard fetch", busy=True, transfer=True
            )
            self._finish(o.id, {"error": f"no memory for the fetched shard: {exc}"})
            return
        h.links.wait(
            h.links.irecv(tmp.array[: o.nbytes], src, TAG_FETCH),
            "shard fetch (receive)",
            busy=True,
            transfer=True,
        )
        h.pool.temp_made(path, max(o.nbytes, 1))
        bad = [c for c, off, n, crc in o.chunks if checksum(tmp.array[off : off + n]) != crc]
        tmp.close()
        result: dict[str, Any] = {"path": str(path), "size": max(o.nbytes, 1), "table": o.table}
        if bad:
            h.stats["checksum_failures"] += len(bad)
            h.pool.temp_gone(path)
            result = {"bad": bad, "slot": o.holder}
        self._finish(o.id, result)

    def _finish(self, fid: str, result: dict[str, Any]) -> None:
        h = self.host
        with h.cond:
            if fid in self.abandoned:  # its reader gave up waiting: nobody will map the file
                self.abandoned.discard(fid)
                if "path" in result:
                    h.pool.temp_gone(result["path"])
                return
            self.results[fid] = result
            h.cond.notify_all()
