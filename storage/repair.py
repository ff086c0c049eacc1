"""Checking this host's chunks and rebuilding lost ones from their stripes.

Who calls it: adoption at start-up (:meth:`Repairer.verify` on every adopted step, then
:meth:`Repairer.repair`), the round engine (:meth:`Repairer.serve`: repairs a read asked for, and
the older steps adoption left for later, one per round), and the socket service (a ``get`` that
finds a bad chunk asks for its repair with :meth:`Repairer.request` and waits). A repair is
collective over the group: every daemon of the group runs it for the same step with the same
erasures, in the same round, over the group's links; the first host of the group then tells
the job which requested repairs ran and which steps were lost (:class:`Repaired`, :class:`Lost`).
What it owns: the queue of requested repairs, the queue of rebuilds left from start-up, and which
requested repairs are done. Lock: the host's ``lock`` for those queues; the transfers run
without it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from codec import checksum
from codec.layout import zeros
from storage import recovery
from storage.catalog import StepRec, StepState
from storage.cpu import charged
from storage.errors import CapacityError
from storage.host import Host
from storage.placement import StripeLayout
from storage.protocol import Lost, Repair
from storage.recovery import Erasures, RepairPlan, holder, plan_repair

__all__ = ["REBUILD_FLOOR", "TAG_REPAIR", "Repairer", "allowance", "moved_bytes"]

TAG_REPAIR = 14
TAG_CHAIN = 1 << 10  # + the stripe's row in its window: a chain repair's partial sums
# A bulk sender's sleep between polls. MPICH's shared-memory transfer needs the sender's progress
# every few tens of microseconds: 3 ranks into 1 on 2 cores moved 9 GB/s napping 50 us, 5 GB/s
# spinning (which takes the receiver's cores) and 1.2 GB/s sleeping 2 ms (measured).
SENDER_NAP = 5e-5
_REPAIR_ROWS = 64 << 20  # bytes of receive rows per set in a repair window
_REPAIR_SCRATCH = ("repair0", "repair1", "send", "chain-in", "chain-own")  # given back after
# bytes a second a rebuild is counted on at least, for how long the job waits for it (measured
# here: 0.7-1.5 GB/s on 4 virtual hosts; a network of 1 Gbit/s moves 120 MB/s)
REBUILD_FLOOR = 50e6


def moved_bytes(rec: StepRec, k: int, erased: dict[int, Erasures]) -> int:
    """Bytes a repair of ``erased`` moves: k chunks for each one rebuilt."""
    return sum(len(e.data) + len(e.parity) for e in erased.values()) * rec.chunk_bytes * k


def allowance(nbytes: int) -> float:
    """Seconds past the peer timeout that a peer waits for local work moving ``nbytes``."""
    return nbytes / REBUILD_FLOOR


class Repairer:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.requests: list[Repair] = []  # this round's repairs of the group's chunks
        self.done: set[str] = set()  # ids of requested repairs that ran, for waiting readers
        self.lost: list[Lost] = []  # steps this round's repairs found beyond repair
        # (step, erasures by slot) still to rebuild after start-up, oldest last; same everywhere
        self.deferred: list[tuple[int, dict[int, Erasures]]] = []

    # -- checking ---------------------------------------------------------------------------------

    def verify(self, rec: StepRec) -> Erasures:
        """Check this host's chunks of ``rec`` against the manifest's checksums.

        Missing or short files (``missing_chunks``) and checksum mismatches
        (``checksum_failures``) are erasures, counted apart. Adopts files into the pool.
        """
        h = self.host
        e = Erasures()
        parity_crc = rec.stored.get(h.slot, {}).get("parity", [])
        for rank in sorted({ref.rank for ref in rec.blobs[h.slot].chunks}):
            e.data.update(self.lost_chunks(rec, rank))
        layout, pos = h.my_layout(rec)
        n = len(layout.parity_stripes[pos])
        if n:
            cb = rec.chunk_bytes
            name = rec.parity.get(h.slot)
            buf = h.file(name, n * cb) if name else None
            for i in range(n):
                view = None if buf is None else buf.file.array[i * cb : (i + 1) * cb]
                if self._fails(view, parity_crc, i):
                    e.parity.add(i)
        return e

    def _fails(self, data: np.ndarray[Any, Any] | None, crcs: list[int], i: int) -> bool:
        """Whether chunk ``i``, its bytes ``data`` (None: no file), is missing (or has no
        checksum ``crcs[i]`` to match) or fails its checksum; counted as ``missing_chunks`` or
        ``checksum_failures``."""
        if data is None or i >= len(crcs):
            self.host.stats["missing_chunks"] += 1
            return True
        if checksum(data) != crcs[i]:
            self.host.stats["checksum_failures"] += 1
            return True
        return False

    def lost_chunks(self, rec: StepRec, rank: int) -> list[int]:
        """Blob chunk indexes of ``rank``'s shard here that are missing or fail their checksum
        (counted as ``missing_chunks`` and ``checksum_failures``)."""
        h = self.host
        buf = h.shard_buffer(rec, rank)
        if buf is None:
            lost = [c for c, ref in enumerate(rec.blobs[h.slot].chunks) if ref.rank == rank]
            h.stats["missing_chunks"] += len(lost)
            return lost
        bad = self.bad_chunks(rec, rank, buf.file.array)
        h.stats["checksum_failures"] += len(bad)
        return bad

    @staticmethod
    def bad_chunks(rec: StepRec, rank: int, data: np.ndarray[Any, Any]) -> list[int]:
        """Blob chunk indexes of ``rank``'s shard (bytes in ``data``) that fail their checksum."""
        return [
            c for c, off, n, want in rec.chunk_checks(rank) if checksum(data[off : off + n]) != want
        ]

    def lost_slots(self, rec: StepRec, erased: dict[int, Erasures]) -> set[int]:
        """The slots with erasures in a group that lost more than m chunks of some stripe."""
        g = self.host.group
        by_pos = {g.position(s): e for s, e in erased.items() if s in g.slots and e}
        if by_pos and not plan_repair(rec.layouts[g.index], by_pos).recoverable:
            return {s for s, e in erased.items() if s in g.slots and e}
        return set()

    def degraded(self, erasures: list[tuple[int, dict[int, Erasures]]]) -> int:
        """Stripes of this host's group that miss a chunk, over the steps and erasures given."""
        steps = self.host.catalog.steps
        g = self.host.group
        return sum(
            len(
                recovery.stripe_erasures(
                    steps[step].layouts[g.index],
                    {g.position(sl): er for sl, er in by_slot.items() if sl in g.slots},
                )
            )
            for step, by_slot in erasures
            if step in steps
        )

    # -- rebuilding -------------------------------------------------------------------------------

    def bad_sources(self, rec: StepRec, plan: RepairPlan) -> Erasures:
        """This host's chunks that ``plan`` reads and that are missing or fail their checksum
        (counted as ``missing_chunks`` and ``checksum_failures``)."""
        h = self.host
        layout, pos = h.my_layout(rec)
        cb = rec.chunk_bytes
        crc = rec.stored.get(h.slot, {})
        data_crc, parity_crc = crc.get("data", []), crc.get("parity", [])
        bad = Erasures()
        n = len(layout.parity_stripes[pos])
        name = rec.parity.get(h.slot)
        pbuf = h.file(name, n * cb) if name and n else None
        shards: dict[int, Any] = {}  # rank -> its shard's buffer here (one look at its file)
        for s, (_, sources) in plan.stripes.items():
            for a in sources:
                if holder(layout, s, a) != pos:
                    continue
                if a >= layout.k:
                    i = layout.parity_slot(pos, s)
                    view = None if pbuf is None else pbuf.file.array[i * cb : (i + 1) * cb]
                    if self._fails(view, parity_crc, i):
                        bad.parity.add(i)
                    continue
                c = layout.data_chunk(s, a)
                if c is None:
                    continue  # a pad chunk: zeros, nothing stored
                ref = rec.blobs[h.slot].chunks[c]
                if ref.rank not in shards:
                    shards[ref.rank] = h.shard_buffer(rec, ref.rank)
                buf = shards[ref.rank]
                view = None if buf is None else buf.file.array[ref.offset : ref.offset + ref.length]
                if self._fails(view, data_crc, c):
                    bad.data.add(c)
        return bad

    def checked_sources(self, rec: StepRec, erased: dict[int, Erasures]) -> dict[int, Erasures]:
        """``erased`` with every chunk the repair would read and that fails its checksum on its
        host added (collective over the group: every host checks what it would send, and all
        learn what all found). A rebuild from a bad source writes bad bytes under the good
        checksum's name; instead the bad source is rebuilt too, or the stripe is lost when
        more than m of its chunks are bad. Repeats while new sources turn up bad."""
        h = self.host
        g = h.group
        layout = rec.layouts[g.index]
        erased = {s: Erasures(set(e.data), set(e.parity)) for s, e in erased.items()}
        for _ in range(g.k + g.m):  # each pass erases another chunk of some stripe, or ends
            by_pos = {g.position(s): e for s, e in erased.items() if s in g.slots and e}
            bad = self.bad_sources(rec, plan_repair(layout, by_pos)).to_json()
            found = h.gl.allgather_json(bad, f"repair of step {rec.step} (sources checked)")
            if not any(f["data"] or f["parity"] for f in found):
                break
            for p, f in enumerate(found):
                e = erased.setdefault(g.slots[p], Erasures())
                e.data |= set(f["data"])
                e.parity |= set(f["parity"])
                if f["data"] or f["parity"]:
                    h.log(
                        f"step {rec.step}: chunks {f} on {h.hosts[g.slots[p]]} that its repair "
                        "would read fail their checksums: rebuilt too"
                    )
        return erased

    @charged("repair")
    def repair(self, rec: StepRec, erased: dict[int, Erasures], checked: bool = False) -> None:
        """Rebuild the erased chunks of ``rec`` from their stripes (collective over the group:
        every daemon of the group calls this for the same step with the same ``erased``). More
        than m erasures in any stripe make the step lost instead (and :attr:`lost` says so).
        The chunks read are checked first (:meth:`checked_sources`) unless ``checked`` says
        every host verified all its chunks of the step just now (adoption)."""
        h = self.host
        t0 = time.monotonic()
        if not checked:
            erased = self.checked_sources(rec, erased)
        lost_slots = self.lost_slots(rec, erased)
        if lost_slots:
            hosts, ranks = recovery.lost_parts(rec, {s: erased[s] for s in lost_slots}, h.hosts)
            rec.state = StepState.LOST
            rec.lost = {"lost_hosts": hosts, "ranks": ranks}
            self.lost.append(Lost(rec.step, hosts, ranks))
            h.stats["lost_steps"] += 1
            h.remove_manifest(rec.step)
            h.log(
                f"step {rec.step} cannot be rebuilt: more than m chunks of a stripe "
                f"lost on {hosts} (ranks {ranks})"
            )
            for later, refs in h.catalog.lose_referrers(rec.step, hosts):
                self.lost.append(Lost(later.step, hosts, refs))
                h.stats["lost_steps"] += 1
                h.remove_manifest(later.step)
                h.log(f"step {later.step} is lost with it: ranks {refs} refer to its tensors")
            return
        g = h.group
        layout, pos = h.my_layout(rec)
        plan = plan_repair(
            layout, {g.position(s): e for s, e in erased.items() if s in g.slots and e}
        )
        k, cb = g.k, rec.chunk_bytes
        rs = h.codec(k, g.m)
        mine = erased.get(h.slot, Erasures())
        # fresh files for what this host lost whole
        changed: dict[str, Any] = {}
        before = (dict(rec.shards), dict(rec.parity))
        taken: list[str] = []
        short: CapacityError | None = None
        try:
            for c in sorted(mine.data):
                rank = rec.blobs[h.slot].chunks[c].rank
                if h.shard_buffer(rec, rank) is None:
                    nbytes = rec.shards[rank].nbytes
                    buf = h.pool.take(nbytes, f"r{rank}-")
                    taken.append(buf.name)
                    rec.shards[rank] = replace(rec.shards[rank], buffer=buf.name)
                    changed.setdefault("buffers", {})[str(rank)] = buf.name
            if mine.parity:
                n = len(layout.parity_stripes[pos])
                name = rec.parity.get(h.slot)
                if name is None or h.file(name, n * cb) is None:
                    buf = h.pool.take(n * cb, "p")
                    taken.append(buf.name)
                    rec.parity[h.slot] = buf.name
                    changed["parity"] = buf.name
        except CapacityError as exc:
            short = exc
        # Senders wait here without spinning while the rebuilding host makes its files (~0.25 s
        # per 375 MB): busy senders sharing its cores made that 5-10x slower (measured). The
        # wait says whether every host could make its files: one that could not fails the
        # repair on every host of the group alike (a host that left the wait alone, raising,
        # left its peers waiting on it until the peer timeout ended the job).
        if h.gl.max_of(int(short is not None), f"repair of step {rec.step} (files ready)"):
            for name in taken:
                h.pool.release(name)
            rec.shards.clear()
            rec.shards.update(before[0])
            rec.parity.clear()
            rec.parity.update(before[1])
            raise short or CapacityError(
                f"repair of step {rec.step}: a host of the group had no memory for the files "
                "it rebuilds (over --memory-budget or /dev/shm full)"
            )
        h.phase("rebuilding")
        # Windows decoded by a second thread while the next one arrives (two sets of receive
        # rows). The senders nap between polls, so the decode has a core to itself (it did not
        # while they spun). A set holds about 64 MiB: a relaunched daemon's rows are fresh
        # pages, faulted in as the bytes arrive. 16 stripes a window instead of 32 (RS(3,1),
        # 1 MiB chunks) rebuilt 1.5 GB in a median 0.73 s instead of 0.81-0.94 s (measured).
        window = max(1, min(h.config.window, _REPAIR_ROWS // ((k + 1) * cb)))
        # One erasure in a stripe: its helpers add their scaled chunks along a chain, so the
        # rebuilding host receives one chunk per stripe instead of k (see _chain_window)
        chained = k > 1 and h.config.repair == "chain"
        single = {s for s, (e, _) in plan.stripes.items() if chained and len(e) == 1}
        chain = sorted(single)
        stripes = sorted(s for s in plan.stripes if s not in single)
        rebuilt = 0
        t_wait = t_dec = 0.0
        t_start = time.monotonic()
        # a chain window holds two rows a stripe (the partial sum received, and a short own
        # chunk padded), not k + 1: twice the stripes in flight for RS(3,1) in the same memory
        cwin = max(1, min(h.config.window, _REPAIR_ROWS // (2 * cb)))
        chain_out = h.scratch("send", cwin, cb, fit=True) if chain else None
        for w0 in range(0, len(chain), cwin):
            tw = time.monotonic()
            rebuilt += self._chain_window(rec, layout, plan, chain[w0 : w0 + cwin], chain_out, cwin)
            t_wait += time.monotonic() - tw

        def decode(jobs: list[tuple[int, int, int, dict[int, Any]]], scratch: Any) -> None:
            nonlocal t_dec  # one decode at a time; read after the last one
            t = time.monotonic()
            helpers = rs.helper_seconds()
            with h.cpu.phase("repair"):  # this thread's, and the codec's helpers' below
                for s, b, target, avail in jobs:
                    dest = h.stripe_chunk(rec, layout, s, target)
                    if dest.nbytes == cb:
                        rs.decode_into(avail, {target: dest})
                    else:
                        out = scratch[b * (k + 1) + k]
                        rs.decode_into(avail, {target: out})
                        dest[:] = out[: dest.nbytes]
            h.cpu.add("repair", rs.helper_seconds() - helpers)
            t_dec += time.monotonic() - t

        decoding: Future[None] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="ecsnap-decode") as decoder:
            for wi, w0 in enumerate(range(0, len(stripes), window)):
                scratch = h.scratch(f"repair{wi % 2}", window * (k + 1), cb, fit=True)
                reqs, jobs = self._post_window(
                    rec, layout, plan, stripes[w0 : w0 + window], scratch
                )
                tw = time.monotonic()
                try:
                    # a decoding host spins (its polls copy the bytes in); a sender naps
                    h.gl.wait(
                        reqs,
                        f"repair of step {rec.step}",
                        busy=h.spin and bool(jobs),
                        nap=SENDER_NAP,
                        transfer=True,
                    )
                finally:
                    t_wait += time.monotonic() - tw
                    if decoding is not None:
                        decoding.result()  # window i - 1 decoded: its rows are free for i + 1
                        decoding = None
                if jobs:
                    decoding = decoder.submit(decode, jobs, scratch)
                    rebuilt += len(jobs)
                    h.stats["decode_bytes"] += k * cb * len(jobs)
            if decoding is not None:
                decoding.result()
        if h.trace:
            h.log(
                f"repair of step {rec.step}: {len(stripes)} stripes, wait "
                f"{t_wait * 1e3:.1f}ms decode {t_dec * 1e3:.1f}ms total "
                f"{(time.monotonic() - t_start) * 1e3:.1f}ms, setup {(t_start - t0) * 1e3:.1f}ms"
            )
        # everyone learns the new file names, and rewrites its manifest
        for pos_r, part in enumerate(h.gl.allgather_json(changed, f"repair of {rec.step}")):
            slot = g.slots[pos_r]
            for rank, name in part.get("buffers", {}).items():
                rec.shards[int(rank)] = replace(rec.shards[int(rank)], buffer=name)
            if part.get("parity"):
                rec.parity[slot] = part["parity"]
        if mine:
            # Check what was rebuilt here. Never raise: every daemon ran this repair in step,
            # and one that dies here would take the job down; a reader retries, then fails.
            left = self.verify(rec)
            bad = Erasures(left.data & mine.data, left.parity & mine.parity)
            if bad:
                h.log(f"step {rec.step}: rebuilt chunks fail their checksums: {bad}")
        # the rows go back: a daemon returns to its size after a rebuild (they are made again,
        # 64 MiB a set, for the next one)
        h.drop_scratch(_REPAIR_SCRATCH)
        h.stats["rebuilt_chunks"] += rebuilt
        h.stats["rebuilds"] += 1
        h.stats["rebuild_seconds"] += time.monotonic() - t0
        h.observe_rebuild(time.monotonic() - t0)
        loc = h.local.get(rec.step)
        if loc is not None:
            loc.buffers = {r: s.buffer for r, s in rec.shards.items() if s.slot == h.slot}
            loc.parity = rec.parity.get(h.slot)
            if rec.state.held:
                h.write_manifest(rec, loc)

    def _chain_window(
        self,
        rec: StepRec,
        layout: StripeLayout,
        plan: RepairPlan,
        batch: list[int],
        outbox: Any,
        window: int,
    ) -> int:
        """Rebuild one window of stripes with one erasure each, the helpers in a chain
        (partial-parallel repair, Mitra et al., EuroSys 2016, as a chain instead of a tree):
        the first helper sends ``c1 * x1``, each next one adds ``ci * xi`` to what it received
        and sends that on, the last sends the rebuilt chunk to the host that lost it, which
        receives it straight into its file. Every host's link carries at most one chunk per
        stripe each way, so the rebuilding host receives what it lost, not k times that. The
        chain's order turns with the stripe, so every helper is first, middle and last alike.
        Returns the chunks rebuilt here."""
        h = self.host
        g = h.group
        pos = g.position(h.slot)
        k, cb = g.k, rec.chunk_bytes
        rs = h.codec(k, g.m)
        partials = h.scratch("chain-in", window, cb, fit=True)
        own_rows = h.scratch("chain-own", window, cb, fit=True)
        waiting: dict[int, list[Any]] = {}  # row -> the receives of its partial sum
        steps: dict[int, tuple[int, Any, int]] = {}  # row -> (coefficient, own chunk, next)
        finals: list[Any] = []
        trims: list[tuple[Any, Any]] = []  # (received row, short destination)
        sends: list[Any] = []
        rebuilt = scaled = 0
        for b, s in enumerate(batch):
            (target,), sources = plan.stripes[s]
            d = holder(layout, s, target)
            row = rs.repair_row(sources, target)
            # a data index past the blob's end is a zero chunk: it adds nothing
            helpers = [
                (holder(layout, s, a), int(c), a)
                for a, c in zip(sources, row, strict=True)
                if not (a < k and layout.data_chunk(s, a) is None) and c
            ]
            turn = s % len(helpers) if helpers else 0
            helpers = helpers[turn:] + helpers[:turn]
            hops = [hp for hp, _, _ in helpers] + [d]
            tag = TAG_CHAIN + b
            if d == pos:
                rebuilt += 1
                dest = h.stripe_chunk(rec, layout, s, target)
                if not helpers:
                    dest[:] = 0
                elif dest.nbytes == cb:
                    finals += h.gl.irecv(dest, hops[-2], tag)
                else:
                    finals += h.gl.irecv(partials[b], hops[-2], tag)
                    trims.append((partials[b], dest))
                continue
            i = next((i for i, (hp, _, _) in enumerate(helpers) if hp == pos), None)
            if i is None:
                continue
            _, coeff, a = helpers[i]
            view = h.stripe_chunk(rec, layout, s, a)
            if view.nbytes < cb:  # a blob's last chunk: zeros past its end
                own_rows[b][: view.nbytes] = view
                own_rows[b][view.nbytes :] = 0
                view = own_rows[b]
            if i == 0:
                rs.scale_add(coeff, view, outbox[b])
                scaled += 1
                sends += h.gl.isend(outbox[b], hops[1], tag)
            else:
                waiting[b] = h.gl.irecv(partials[b], hops[i - 1], tag)
                steps[b] = (coeff, view, hops[i + 1])
        what = f"repair of step {rec.step}"
        while waiting:
            for b in h.gl.wait_any(waiting, what, nap=SENDER_NAP):
                coeff, view, nxt = steps[b]
                rs.scale_add(coeff, view, outbox[b], partials[b])
                scaled += 1
                sends += h.gl.isend(outbox[b], nxt, TAG_CHAIN + b)
        h.gl.wait(sends + finals, what, nap=SENDER_NAP, transfer=True)
        for got, dest in trims:
            dest[:] = got[: dest.nbytes]
        h.stats["decode_bytes"] += cb * scaled
        return rebuilt

    def _post_window(
        self,
        rec: StepRec,
        layout: StripeLayout,
        plan: RepairPlan,
        batch: list[int],
        scratch: Any,
    ) -> tuple[list[Any], list[tuple[int, int, int, dict[int, Any]]]]:
        """Post this host's sends (from its chunks' mappings) and receives (into ``scratch``,
        k + 1 rows per stripe) of one repair window; return the requests and the
        decodes that fall to it (stripe, row, erased index, available chunks by index)."""
        h = self.host
        g = h.group
        pos = g.position(h.slot)
        k, cb = g.k, rec.chunk_bytes
        reqs: list[Any] = []
        jobs = []
        for b, s in enumerate(batch):
            erased_idx, sources = plan.stripes[s]
            decoders = sorted({holder(layout, s, e) for e in erased_idx})
            for d in decoders:
                avail: dict[int, Any] = {}
                for a_i, a in enumerate(sources):
                    hp = holder(layout, s, a)
                    view = None
                    if a < k and layout.data_chunk(s, a) is None:
                        if d == pos:
                            avail[a] = zeros(cb)
                        continue
                    if hp == pos:
                        view = h.stripe_chunk(rec, layout, s, a)
                    if d == pos:
                        row = scratch[b * (k + 1) + a_i]
                        if hp == pos:
                            assert view is not None
                            if view.nbytes == cb:
                                row = view  # whole: decode from the file in place
                            else:
                                row[: view.nbytes] = view
                                row[view.nbytes :] = 0
                        else:
                            length = h.chunk_length(rec, layout, s, a)
                            row[length:] = 0
                            reqs += h.gl.irecv(row[:length], hp, TAG_REPAIR)
                        avail[a] = row
                    elif hp == pos:
                        assert view is not None
                        # from the mapping, as the exchange sends (see storage/exchange.py)
                        reqs += h.gl.isend(view, d, TAG_REPAIR)
                if d == pos:
                    target = next(e for e in erased_idx if holder(layout, s, e) == pos)
                    jobs.append((s, b, target, avail))
        return reqs, jobs

    # -- repairs while serving ------------------------------------------------------------------

    def request(self, step: int, slot: int, data: list[int]) -> None:
        """Ask the group of ``slot`` to repair data chunks ``data`` of its blob of ``step``, and
        wait until it ran (a socket-service thread; :class:`StorageTimeoutError` after the peer
        timeout)."""
        h = self.host
        rid = h.next_id("r")
        with h.lock:
            rec = h.catalog.steps.get(step)
            k = h.catalog.group_of[slot].k
        extra = allowance(moved_bytes(rec, k, {slot: Erasures(set(data))})) if rec else 0.0
        h.emit(Repair(rid, step, slot, data))
        # as long as the group's rounds may take for it (Rounds.allowance)
        wait = h.config.peer_timeout + extra
        h.wait_for(lambda: rid in self.done, wait, f"the repair of step {step}")
        with h.lock:
            self.done.discard(rid)

    def serve(self) -> tuple[list[str], list[Lost]]:
        """Run this round's requested repairs of the group's chunks, or else one rebuild left from
        start-up (the round thread; every daemon of the group runs the same ones, in order).
        Returns the ids of the requests that ran and the steps found lost."""
        h = self.host
        with h.lock:
            repairs, self.requests = self.requests, []
        self.lost = []
        if self.deferred and not repairs:
            # one older step per round, so puts and reads go on between rebuilds
            step, erased = self.deferred.pop(0)
            rec = h.catalog.steps.get(step)
            if rec is not None and rec.state.held:
                try:
                    self.repair(rec, erased)
                except CapacityError as exc:
                    h.log(f"rebuild of step {step} failed: {exc}")
            self.deferred_changed()
        for r in repairs:
            rec = h.catalog.steps.get(r.step)
            if rec is None or not rec.state.held:
                continue
            wanted = {r.slot: Erasures(set(r.data), set(r.parity))}
            # A read found chunks of a step whose start-up rebuild is still queued: rebuild all
            # of it now (the read's chunks and whatever else the loss took), once.
            for i, (step, erased) in enumerate(self.deferred):
                if step == rec.step:
                    del self.deferred[i]
                    for slot, e in erased.items():
                        w = wanted.setdefault(slot, Erasures())
                        w.data |= e.data
                        w.parity |= e.parity
                    self.deferred_changed()
                    break
            try:
                self.repair(rec, wanted)
            except CapacityError as exc:
                h.log(f"repair of step {rec.step} failed: {exc}")
        ids = [r.id for r in repairs]
        if ids:
            with h.cond:
                self.done |= set(ids)
                h.cond.notify_all()
        return ids, self.lost

    def deferred_changed(self) -> None:
        h = self.host
        h.degraded_stripes = self.degraded(self.deferred)
        if not self.deferred:
            h.health = "healthy"
            h.missing_slots = set()
        h.write_health()
