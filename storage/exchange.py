"""The erasure-coding exchange of one step: parity memory, data chunks to their stripes' encoders,
encode, parity to its holders, checksums.

Who calls it: the round engine, in the local work of a round, for every step the catalog moved to
``ready`` (:meth:`Exchange.prepare`) or to ``encoding`` (:meth:`Exchange.run`); every daemon of a
group runs them for the same step in the same round. What it owns: the checksum thread and the
encode time counters. Lock: it takes the host's ``lock`` only to queue its events; the bulk
transfers run without it.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from codec import checksum
from storage.catalog import StepRec
from storage.cpu import charged
from storage.errors import CapacityError
from storage.host import Host, Local
from storage.placement import HostBlob, StripeLayout
from storage.protocol import Prepared, Stored

__all__ = ["TAG_DATA", "TAG_PARITY", "Exchange", "Plan"]

TAG_DATA, TAG_PARITY = 11, 12
NET_NAP = 2e-4  # a bulk wait's sleep between polls when the bytes come over a network
_PLANS_KEPT = 8  # plans a daemon keeps (a steady job uses one)

# What a host does in a stripe, besides sending its own data chunks there
ENCODE, COPY, PARITY = 1, 2, 3  # encodes it; holds a copy (k = 1); receives a parity chunk


class _Work:
    """One stripe of a window, as one host takes part in it (see :class:`Plan`)."""

    __slots__ = ("e", "forward", "pslot", "receives", "report", "role", "s", "sends", "source")

    def __init__(self, s: int) -> None:
        self.s = s
        self.sends: list[tuple[int, int]] = []  # (chunk of this host's blob, to position)
        self.role = 0  # ENCODE, COPY, PARITY or none
        # the data chunks it receives: (index j, from position, their host's slot, chunk, bytes;
        # 0 bytes: a virtual pad, zeros, not sent)
        self.receives: list[tuple[int, int, int, int | None, int]] = []
        self.pslot = -1  # its parity (or copy) among this host's parity chunks
        self.e = -1  # ENCODE: the parity index encoded in place, into this host's parity chunk
        self.forward: list[tuple[int, int]] = []  # ENCODE: (parity index, to position)
        self.source = -1  # PARITY: the encoder's position
        self.report = False  # COPY: this host reports the data chunk's CRC (its first holder)


class Plan:
    """What one host sends, receives and encodes in each window of one layout, worked out once
    for a layout and its shards' sizes (every step of a steady job has the same), not again for
    every stripe of every step: posting a window asked the layout about every stripe of the
    group, about 20 us of Python each here."""

    def __init__(self, layout: StripeLayout, pos: int, blobs: list[HostBlob], window: int):
        k = layout.k
        replicate = k == 1  # no encoding: the data host sends its chunk to every copy holder
        slots = layout.group.slots
        self.windows: list[list[_Work]] = []
        self.encodes = 0  # stripes this host encodes
        for w0 in range(0, layout.stripes, window):
            works = []
            for s in range(w0, min(w0 + window, layout.stripes)):
                w = _Work(s)
                ppos = layout.parity_positions(s)
                encoder = layout.encoder_position(s)
                for j in range(k):
                    if layout.data_position(s, j) == pos:
                        c = layout.data_chunk(s, j)
                        if c is not None:
                            w.sends += [(c, to) for to in (ppos if replicate else [encoder])]
                if pos in ppos:
                    w.pslot = layout.parity_slot(pos, s)
                    if replicate:
                        w.role, w.report = COPY, ppos[0] == pos
                    elif encoder == pos:
                        w.role, w.e = ENCODE, layout.encoder(s)
                        w.forward = [(i, p) for i, p in enumerate(ppos) if i != w.e]
                        self.encodes += 1
                    else:
                        w.role, w.source = PARITY, encoder
                    if w.role in (ENCODE, COPY):
                        for j in range(k):
                            dpos, c = layout.data_position(s, j), layout.data_chunk(s, j)
                            length = 0 if c is None else blobs[dpos].chunks[c].length
                            w.receives.append((j, dpos, slots[dpos], c, length))
                if w.sends or w.role:
                    works.append(w)
            self.windows.append(works)

    _made: ClassVar[dict[tuple[Any, ...], Plan]] = {}  # the last plans made in this process

    @classmethod
    def of(cls, layout: StripeLayout, pos: int, blobs: list[HostBlob], window: int) -> Plan:
        """The plan of ``layout`` for position ``pos``, made once for equal layouts and shard
        sizes (only the round thread makes plans)."""
        key = (layout.group, tuple(layout.counts), pos, window, tuple(blobs))
        plan = cls._made.get(key)
        if plan is None:
            if len(cls._made) >= _PLANS_KEPT:
                cls._made.clear()
            plan = cls._made[key] = cls(layout, pos, blobs, window)
        return plan


def half_window(rows: int, k: int, n: int, chunk_bytes: int, network: bool) -> int:
    """Stripes a set of rows holds, half an exchange window: as many of k rows, each
    ``chunk_bytes`` wide, as ``rows`` bytes hold (``ServeConfig.exchange_rows``; see
    :meth:`Exchange.run`); over a ``network`` at least ``n``, the group's hosts, so that every
    host encodes in every window.

    The encoders take turns stripe by stripe (:meth:`storage.placement.StripeLayout.encoder`),
    and a window's data all go to its encoders: a window of one stripe sends every byte to one
    host while the others' incoming links idle. With 4 MiB chunks a half window of RS(3,1) is one
    stripe, and puts over 2 Gbit/s links (bench store --lab --schemes rs31, 1.5 GB) took
    3.24-3.27 s, 2.16-2.18x the network floor, against 1.84 s (1.23x) with 1 MiB chunks and four
    stripes a half window. Between virtual hosts there are no links to keep busy, and smaller rows
    stay in the caches.
    """
    stripes = max(1, rows // (k * chunk_bytes))
    return max(stripes, n) if network else stripes


class Exchange:
    def __init__(self, host: Host) -> None:
        self.host = host
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="ecsnap-crc")

    def close(self) -> None:
        self._crc_pool.shutdown(wait=True)

    def window(self, k: int, m: int) -> int:
        """This host's half window of RS(k, m), in stripes (:func:`half_window`)."""
        h = self.host
        return half_window(h.config.exchange_rows, k, k + m, h.chunk_bytes, network=not h.spin)

    def scratch(self, k: int, m: int, cb: int) -> list[tuple[Any, Any]]:
        """The two half windows' rows: data in, parity out (see :meth:`run`)."""
        h = self.host
        window = self.window(k, m)
        return [
            (
                h.scratch(f"data{i}", window * k, cb),
                h.scratch(f"out{i}", window * max(m - 1, 1) + 1, cb),
            )
            for i in range(2)
        ]

    def warm(self) -> None:
        """Make the exchange's rows and codec before the first step needs them (the warmer's
        thread). The first codec of a process loads ISA-L (17-22 ms here), inside the first step's
        exchange otherwise."""
        g = self.host.group
        self.scratch(g.k, g.m, self.host.chunk_bytes)
        self.host.codec(g.k, g.m)

    def encoders_checksum(self) -> bool:
        """Whether each data chunk's CRC is taken where it arrives, by its stripe's encoder (with
        copies, k = 1: its first copy holder), not by the chunk's own host: between virtual
        hosts (see :meth:`run`)."""
        return self.host.spin

    def prepare(self, rec: StepRec, loc: Local) -> None:
        """Reserve parity memory; report next round. Unless the encoders do it, start
        checksumming this host's data chunks.

        Those checksums run on a helper thread (ISA-L's CRC drops the GIL) while the exchange
        moves the same bytes; ``stored`` waits for them.
        """
        h = self.host
        loc.prepared = True
        loc.t["ready"] = time.monotonic()
        layout, pos = h.my_layout(rec)
        nparity = len(layout.parity_stripes[pos])
        ok = True
        try:
            buf = h.pool.take(nparity * rec.chunk_bytes, "p")
            loc.parity = buf.name
        except CapacityError as exc:
            ok = False
            h.log(f"step {rec.step}: no memory for this host's parity: {exc}")
        if ok and not self.encoders_checksum():
            views = [h.chunk_view(rec, c) for c in range(len(rec.blobs[h.slot].chunks))]
            loc.crc_job = self._crc_pool.submit(self._checksums, views)
        loc.t["prepared"] = time.monotonic()
        h.emit(Prepared(rec.step, ok))

    @charged("checksum")
    def _checksums(self, views: list[np.ndarray[Any, Any]]) -> list[int]:
        return [checksum(v) for v in views]

    @charged("exchange")
    def run(self, rec: StepRec, loc: Local) -> None:
        """Send data chunks to their stripes' encoders, encode, forward parity, window by window.

        Every daemon of the group runs this in the same round, over the group's links (group rank
        = position). Pairs of daemons post their messages in stripe order, so MPI's non-overtaking
        rule matches them without per-stripe tags.
        """
        h = self.host
        loc.stored = True
        loc.t["exchange"] = time.monotonic()
        h.phase("encoding")
        g = h.group
        layout, pos = h.my_layout(rec)
        k, m, cb = g.k, g.m, rec.chunk_bytes
        rank_at = list(range(len(g.slots)))  # group position -> rank on the group's links
        rs = h.codec(k, m)
        parity = h.pool.get(loc.parity).file.array if loc.parity else None
        # Half windows, two sets of rows used in turn: while one window is encoded and its
        # parity sent, the next windows' data move, so the links never idle between windows (an
        # idle TCP connection starts slow again). A set's data rows are reused once encoded,
        # its out rows once their parity has gone out.
        # Small windows keep the rows in the caches: 12 MiB of data rows a half window
        # (``ServeConfig.exchange_rows``; 24 MiB a host) the bytes MPI copies in, encodes and
        # checksums are still there from the last use of the rows, and the parity lands beside
        # them. Measured in stripes of 1 MiB chunks (RS(3,1): 8 stripes a window, 4 a half),
        # two alternated pairs of 8 puts, 4 virtual hosts on 2 cores, 1.5 GB, CPU s per
        # protected GB: 0.642-0.649 with 8 (encode 0.074, checksum 0.059-0.060, receive 0.213)
        # against 0.703-0.753 with 64 (0.109-0.113, 0.085-0.087, 0.236-0.242), put->protected
        # 0.50-0.51 s against 0.56-0.60 s; with 4, 0.651-0.661 (each window's waits and posts
        # cost more than the smaller rows saved). Over a network (bench store --lab --schemes
        # rs31, two alternated runs each): put->protected / network floor 1.23-1.24 against
        # 1.31-1.33, CPU s per protected GB 1.72-1.92 against 1.87-1.91 (more of it in
        # exchange, less in receive: over TCP the posts move bytes too). With 4 MiB chunks
        # (the default) a half window between virtual hosts is one stripe of RS(3,1) (over a
        # network, at least k+m: see half_window); its data checksums cost more
        # than with 1 MiB (0.080-0.087 against 0.062-0.064: a chunk no longer fits this core's
        # L2 when it is checksummed), and receiving each in 1 MiB pieces, checksummed as each
        # arrived, cost more in receive than it saved there (total 0.653-0.673 against
        # 0.611-0.634 whole, two alternated runs each).
        window = self.window(k, m)
        sets = self.scratch(k, m, cb)
        plan = Plan.of(layout, pos, [rec.blobs[g.slots[p]] for p in range(layout.n)], window)
        links = h.gl
        nap = None if h.spin else NET_NAP
        # A data chunk is sent from the shard's /dev/shm mapping, not copied into a private row
        # first. Both ways on an Intel Xeon machine (4 virtual hosts on 2 cores, RS(3,1),
        # 1.5 GB, two alternated pairs of 8 puts): with the copy 0.90-0.92 CPU s per protected
        # GB and 0.77 s put->protected, without it 0.68-0.69 and 0.61. Between two ranks alone
        # (bench/transfer_floor.py --source shm|shm-copied, 256 MiB each way) the copy cost
        # 0.143 s against 0.105 there, but saved some on an AMD EPYC machine (0.135 against
        # 0.154), where it had been kept. Over TCP the kernel copies either way.
        clock = h.cpu
        t_encode = 0.0
        hot_crc: dict[int, int] = {}  # parity slot -> CRC taken hot: encoded here, or a copy
        helpers = rs.helper_seconds()  # the codec's helper threads' CPU is charged to encode

        # Between virtual hosts an encoder checksums each data chunk it receives as its receive
        # completes, while the bytes MPI just copied are in this core's cache, and reports the
        # CRCs with its own (``Stored.data_crc``); the chunk's host does not read it back from
        # memory for them. Two alternated pairs of 8 puts, 4 virtual hosts on 2 cores, RS(3,1),
        # 1.5 GB: checksum 0.075-0.076 CPU s per protected GB against 0.087-0.089, total
        # 0.667-0.669 against 0.680-0.707, put->protected 0.533-0.544 s against 0.544-0.564 (in
        # one process: a CRC right after a 1 MiB process_vm_readv 0.035 s/GB, one read from
        # memory 0.058). Over a network each host checksums its own: there the encoder's CRCs
        # cost more than the host's (bench store --lab, RS(3,1), two alternated runs each:
        # checksum 0.170-0.174 against 0.130-0.147, the total within the runs' spread). The
        # CRC covers the bytes the parity is encoded from; one copy lies between them and the
        # shard's (the kernel's, or the network's, which TCP checks), as one copy, the put's,
        # lies between the shard and the trainer's tensors, which no CRC covers either.
        # With copies (k = 1) a copy holder checksums the copy it receives likewise, and the
        # first holder of each reports it as the data chunk's CRC too. Two alternated pairs of
        # 8 puts, 2-way replication, 4 virtual hosts, 1.5 GB: checksum 0.048 CPU s per
        # protected GB against 0.135-0.139 (the host's data and the copies read back from
        # memory), total 0.530-0.550 against 0.602-0.629, put->protected 0.423-0.436 s against
        # 0.472-0.494.
        encoded: list[list[int]] = []  # [slot, chunk, CRC] of the data chunks encoded here
        # row key -> [pieces left, slot, chunk, row, the copy's parity slot or None, report]
        unsummed: dict[int, list[Any]] = {}
        piece_row: dict[int, int] = {}  # a data receive piece's id -> its row key
        row_keys = itertools.count()
        checksummed_here = self.encoders_checksum()

        def summed(key: int) -> None:
            _, slot, c, row, copy, report = unsummed.pop(key)
            with clock.phase("checksum"):
                crc = checksum(row)
                if report:
                    encoded.append([slot, c, crc])
                if copy is not None:  # the copy's CRC is of its whole row, the zero pad too
                    pad = parity_row_at(copy)[len(row) :]
                    hot_crc[copy] = checksum(pad, crc) if len(pad) else crc

        def arrived(req: Any) -> None:
            key = piece_row.pop(id(req), None)
            if key is not None:
                unsummed[key][0] -= 1
                if not unsummed[key][0]:
                    summed(key)

        def receive_data(
            w: _Work, got: tuple[int, int, int, int | None, int], dst: np.ndarray[Any, Any]
        ) -> list[Any]:
            """Post the receive of one of stripe w's data chunks into ``dst``; zero its pad."""
            _, dpos, slot, c, length = got
            if length < cb:
                dst[length:] = 0
            if not length:
                return []
            row = dst[:length] if length < cb else dst
            reqs = links.irecv(row, rank_at[dpos], TAG_DATA)
            if checksummed_here:
                copy, report = None, True
                if w.role == COPY:  # dst is this host's copy
                    copy, report = w.pslot, w.report
                key = next(row_keys)
                unsummed[key] = [len(reqs), slot, c, row, copy, report]
                piece_row.update((id(r), key) for r in reqs)
            return reqs

        def parity_row_at(i: int) -> np.ndarray[Any, Any]:
            """This host's parity (or copy) chunk in parity slot i."""
            assert parity is not None
            return parity[i * cb : (i + 1) * cb]

        def post(wi: int) -> tuple[list[Any], list[Any], list[Any], list[_Work]]:
            """Post window ``wi``'s data receives and sends and its parity receives."""
            data_scratch, _ = sets[wi % 2]
            w0 = wi * window
            data_recvs: list[Any] = []
            data_sends: list[Any] = []
            parity_reqs: list[Any] = []
            mine_to_encode = []
            for w in plan.windows[wi]:
                for c, to in w.sends:
                    data_sends += links.isend(h.chunk_view(rec, c), rank_at[to], TAG_DATA)
                if w.role == ENCODE:
                    mine_to_encode.append(w)
                    row0 = (w.s - w0) * k
                    for got in w.receives:
                        data_recvs += receive_data(w, got, data_scratch[row0 + got[0]])
                elif parity is None:
                    continue
                elif w.role == COPY:  # RS(1, m) keeps copies: received in place
                    data_recvs += receive_data(w, w.receives[0], parity_row_at(w.pslot))
                elif w.role == PARITY:
                    parity_reqs += links.irecv(
                        parity_row_at(w.pslot), rank_at[w.source], TAG_PARITY
                    )
            return data_recvs, data_sends, parity_reqs, mine_to_encode

        # Pairs post each tag's messages in stripe order on both sides (windows in order, parity
        # sends after their encode), so MPI's non-overtaking rule still matches them without
        # per-stripe tags. Two windows' data are in flight from the start; a window's data rows
        # are free once it is encoded, so the window after next is posted right then, and a
        # window's parity is waited for only before its out rows are used again, two windows
        # later. The links carry data and parity of up to two windows each at every moment:
        # waiting for each window's parity before posting more data had every link carry only
        # the last parity bytes at each window's end, the slowest pair's, with nothing queued
        # behind them (bench store --lab, RS(2,2): 0.11-0.13 s a window of 24 MiB per link at
        # 2 Gbit/s, whose floor is 0.1 s).
        #
        # Between virtual hosts a window waits for its data receives alone, and the data sends
        # are waited for once, at the end: they read the shard, which nothing writes during the
        # exchange. There MPICH's single-copy path has the receiver copy, and a host waiting for
        # each window's sends too held its next windows back until every receiver had copied
        # and its own napping polls had seen it. Two alternated pairs of 6 puts, 4 virtual hosts
        # on 2 cores, RS(3,1), 1.5 GB: put->protected 0.490-0.495 s against 0.602-0.615 s, CPU
        # per protected GB 0.63-0.64 s against 0.68 (in send waits: 0.005 against 0.068). Over
        # a network each window still waits for its sends, which paces the links alike: waiting
        # once at the end there (bench store --lab, one run) made 2-way replication 5 % slower
        # (2.64 s against 2.47-2.51) and RS(2,2) 2 % (2.78 s against 2.72-2.74).
        windows = len(plan.windows)
        posted = {wi: post(wi) for wi in range(min(2, windows))}
        parity_wait: dict[int, list[Any]] = {}
        sends_left: list[Any] = []  # between virtual hosts: every window's data sends
        h.phase("sending")

        data_what, parity_what = (
            f"data exchange of step {rec.step}",
            f"parity exchange of step {rec.step}",
        )

        def wait_parity(wi: int) -> None:
            links.wait(
                parity_wait.pop(wi, []),
                parity_what,
                busy=h.spin,
                nap=nap,
                transfer=True,
            )

        for wi in range(windows):
            w0 = wi * window
            data_recvs, data_sends, parity_reqs, mine_to_encode = posted.pop(wi)
            data_scratch, out_scratch = sets[wi % 2]
            if h.spin:
                sends_left += data_sends
            links.wait(
                data_recvs if h.spin else data_recvs + data_sends,
                data_what,
                busy=h.spin,
                nap=nap,
                transfer=True,
                arrived=arrived,
            )
            wait_parity(wi - 2)  # its parity sends read the out rows this window encodes into
            for w in mine_to_encode:
                s, e = w.s, w.e  # e: this host's own parity index, encoded in place
                row0 = (s - w0) * k
                others = iter(out_scratch[(s - w0) * (m - 1) : (s - w0 + 1) * (m - 1)])
                outs = [parity_row_at(w.pslot) if i == e else next(others) for i in range(m)]
                t0 = time.perf_counter()
                with clock.phase("encode"):
                    rs.encode_into([data_scratch[row0 + j] for j in range(k)], outs)
                t_encode += time.perf_counter() - t0
                # Its CRC now, while encode_into's output is in cache, not read back from memory
                # at the end (ISA-L's CRC runs at memory speed there: 16.5 GB/s against 59-79
                # from L2). Two alternated pairs of 8 puts, 4 virtual hosts, RS(3,1), 1.5 GB:
                # checksum 0.082-0.083 CPU s per protected GB against 0.088-0.090.
                with clock.phase("checksum"):
                    hot_crc[w.pslot] = checksum(outs[e])
                for i, to in w.forward:
                    parity_reqs += links.isend(outs[i], rank_at[to], TAG_PARITY)
            parity_wait[wi] = parity_reqs
            if wi + 2 < windows:
                posted[wi + 2] = post(wi + 2)  # into this window's rows, encoded now
        for wi in sorted(parity_wait):
            wait_parity(wi)
        # checksummed_here only between virtual hosts: their busy waits hand each receive to arrived
        assert not unsummed, f"{len(unsummed)} data chunks of step {rec.step} not checksummed"
        links.wait(
            sends_left,
            data_what,
            busy=h.spin,
            nap=nap,
            transfer=True,
        )
        clock.add("encode", rs.helper_seconds() - helpers)
        h.stats["encode_bytes"] += plan.encodes * k * cb
        h.stats["encode_seconds"] += t_encode
        n = len(layout.parity_stripes[pos])
        if parity is not None:
            cold = [i for i in range(n) if i not in hot_crc]  # received (m > 1), copies by TCP
            crcs = self._checksums([parity_row_at(i) for i in cold])
            hot_crc.update(zip(cold, crcs, strict=True))
            loc.parity_crc = [hot_crc[i] for i in range(n)]
        if loc.crc_job is not None:
            loc.data_crc = loc.crc_job.result()
        loc.t["stored"] = time.monotonic()
        h.emit(
            Stored(
                rec.step,
                loc.parity,
                {"data": loc.data_crc, "parity": loc.parity_crc},
                n * cb if parity is not None else 0,
                encoded,
            )
        )
