"""Moving a shard to the host whose trainer reads it, when another host holds it.

Who calls it: the socket service (a ``get`` of a rank held elsewhere: :meth:`Fetcher.fetch`
queues a ``fetch`` event and waits), and the round engine (:meth:`Fetcher.serve`: every daemon
sees every fetch of the round; the holder sends, the reader receives into a temporary file under
``tmp/`` and checks the shard's checksums). What it owns: the round's fetches and the results
waiting for their readers. Lock: the host's ``lock`` for those; the transfer runs without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from storage.catalog import StepRec, StepState
from storage.errors import StepNotFoundError
from storage.host import Host
from storage.repair import Repairer
from transport import shm

__all__ = ["TAG_FETCH", "Fetcher"]

TAG_FETCH = 13


class Fetcher:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.requests: list[dict[str, Any]] = []  # fetch events of this round, every daemon's
        self.results: dict[str, dict[str, Any]] = {}  # fetch id -> result, for its reader

    def fetch(self, rec: StepRec, rank: int) -> dict[str, Any]:
        """``rank``'s shard of ``rec`` in a temporary file here (a socket-service thread):
        ``{"path", "size"}``, or ``{"bad": [chunks], "slot"}`` if it failed its checksums."""
        h = self.host
        fid = h.next_id("f")
        h.emit({"e": "fetch", "id": fid, "step": rec.step, "rank": rank, "to": h.slot})
        h.wait_for(
            lambda: fid in self.results,
            h.config.peer_timeout,
            f"fetching step {rec.step} rank {rank}",
        )
        with h.lock:
            result = self.results.pop(fid)
        if "error" in result:
            raise StepNotFoundError(f"step {rec.step} rank {rank}: {result['error']}", rec.step)
        return result

    def serve(self) -> None:
        """Move this round's fetched shards (the round thread; every daemon, the same fetches)."""
        h = self.host
        with h.lock:
            fetches, self.requests = self.requests, []
        for f in fetches:
            rec = h.catalog.steps.get(int(f["step"]))
            to = int(f["to"])
            if rec is None or rec.state != StepState.PROTECTED or int(f["rank"]) not in rec.shards:
                if to == h.slot:
                    self._finish(f["id"], {"error": "gone"})
                continue
            shard = rec.shards[int(f["rank"])]
            if shard.slot == h.slot and to != h.slot:
                view = h.pool.get(shard.buffer).file.array[: shard.nbytes]
                h.links.wait(
                    h.links.isend(view, h.rank_of[to], TAG_FETCH), "shard fetch (send)", busy=True
                )
            elif to == h.slot:
                src = h.rank_of[shard.slot]
                path = h.dir / "tmp" / f"fetch-{f['id']}"
                try:
                    tmp = shm.create(path, max(shard.nbytes, 1), prefault_pages=False)
                except OSError as exc:
                    # the holder sends regardless: drain it into scratch so MPI stays in step
                    sink = np.empty(shard.nbytes, dtype=np.uint8)
                    h.links.wait(h.links.irecv(sink, src, TAG_FETCH), "shard fetch", busy=True)
                    self._finish(f["id"], {"error": f"no memory for the fetched shard: {exc}"})
                    continue
                h.links.wait(
                    h.links.irecv(tmp.array[: shard.nbytes], src, TAG_FETCH),
                    "shard fetch (receive)",
                    busy=True,
                )
                bad = Repairer.bad_chunks(rec, shard.rank, tmp.array)
                tmp.close()
                result: dict[str, Any] = {"path": str(path), "size": max(shard.nbytes, 1)}
                if bad:
                    h.stats["checksum_failures"] += len(bad)
                    path.unlink(missing_ok=True)
                    result = {"bad": bad, "slot": shard.slot}
                self._finish(f["id"], result)

    def _finish(self, fid: str, result: dict[str, Any]) -> None:
        h = self.host
        with h.cond:
            self.results[fid] = result
            h.cond.notify_all()
