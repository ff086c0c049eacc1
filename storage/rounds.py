"""The round engine: the daemons' lock-step loop, and the only writer of the catalog.

Who calls it: :meth:`storage.daemon.Daemon.run`, on the daemon's main thread, which is the only
thread that drives MPI. Each round every daemon

1. sorts the events its modules queued since the last round (:meth:`Host.emit`) into what the
   round carries (see :mod:`storage.protocol`): counts in its :class:`Ballot` (fixed size),
   shard records and checksums for its group, and rare events for the whole job;
2. reduces the ballots over the job (sum and max of one int64 vector: the cost per daemon does
   not grow with the job but as the reduction's log2 of the hosts); then, only in a round whose
   ballot says some daemon has one, gathers the group's events among the k+m hosts of each
   group, and the rare events over the job;
3. applies them, the same on every daemon: the group's events and the ballot to the
   :class:`~storage.catalog.Catalog` (so every daemon takes the same decisions without a leader),
   rare events to the modules they are for, a lane to the lowest new step;
4. does the round's local work: prepare ready steps and run the exchange of encoding ones
   (:mod:`storage.exchange`), repairs (:mod:`storage.repair`), fetches (:mod:`storage.fetch`),
   the manifests of newly protected steps, and the files of steps that retention or a delete
   dropped.

What it owns: the staged shards of steps that wait for a lane, and the loop's pacing. Lock: the
host's ``lock`` while it changes the catalog and the host's records, never across MPI calls.
"""

from __future__ import annotations

import time
from typing import Any

from storage.catalog import StepRec, StepState
from storage.cpu import charged
from storage.errors import DaemonFailedError, StepExistsError, to_wire
from storage.exchange import Exchange
from storage.fetch import Fetcher
from storage.host import Host, Local
from storage.leases import Leases
from storage.protocol import (
    Ballot,
    Event,
    Fetch,
    Lost,
    Offer,
    PersistFailed,
    Pin,
    Prepared,
    Repair,
    Repaired,
    ShardRecord,
    Staged,
    Stored,
    Unpin,
)
from storage.recovery import Erasures
from storage.repair import Repairer, allowance, moved_bytes
from storage.tier import Tier

__all__ = ["Rounds", "idle_nap", "next_quiet"]

# An idle daemon naps between rounds, from IDLE_FIRST doubling with each quiet round up to
# IDLE_LONGEST, and wakes on a tick of the wall clock (a multiple of its nap): the daemons count
# the same quiet rounds, so they wake together and a round's collectives find their peers there
# instead of polling for them. Measured on 4 virtual hosts, 2 cores, idle: naps up to 20 ms,
# unaligned, cost 80 CPU ms a second (31 rounds a second, half of it polling for peers; beside
# a training job 136 ms a second, a share of the cores that training lacked); these, 29 ms (8
# rounds a second, polling 7 ms). The price: a round that one daemon starts alone (a request on
# a host whose peers nap) waits for their next tick, at most IDLE_LONGEST: a put of one rank
# after 1.5 s idle took 160 ms to protect against 54 ms. A put of every rank does not pay it
# (46 ms against 55): each rank wakes its own host's daemon.
#
# The naps grow from IDLE_FIRST while some step is in flight (it holds a lane, the same on every
# daemon): its next event (a rank's staged shard, on one host) then finds its peers within a nap
# of a few milliseconds. Once the last step in flight is done, and it was put by at least as
# many ranks as the job has hosts (a training job's put, a rank or more on every host), a quiet
# round naps the longest at once: the next event is the next put, whose ranks wake their own
# hosts' daemons, and the growing naps after each put were a fifth of a training step's rounds.
# Beside the demo's GPT training (4 ranks, 4 virtual hosts, 2 cores, a put every step, two
# alternated pairs of 30 steps): 20 rounds a step against 25-26, the daemons' CPU 186-189 ms a
# step against 204-207, step time 8.6 and 7.9 % over training alone against 10.6 and 13.6.
# After a put of fewer ranks the naps still grow from IDLE_FIRST: a put of one rank right after
# it would otherwise wait for its peers' tick (back to back, 4 virtual hosts: 129 ms
# put->protected against 52).
_EXCHANGING = (StepState.READY, StepState.ENCODING)

IDLE_FIRST = 0.0005
IDLE_LONGEST = 0.128
_QUIET_MAX = 16  # past the longest nap


def idle_nap(quiet: int, now: float | None = None) -> float:
    """Seconds to nap after ``quiet`` quiet rounds: until the wall clock's next multiple of the
    nap (the clocks of a job's hosts agree to milliseconds; a nap never exceeds its length)."""
    nap = min(IDLE_FIRST * (1 << min(quiet, _QUIET_MAX)), IDLE_LONGEST)
    t = time.time() if now is None else now
    return nap - t % nap


def next_quiet(quiet: int, hot: bool, ramp: bool) -> int:
    """The count of quiet rounds after a round: none after one that moved something anywhere;
    after a quiet one, one more if the naps ``ramp`` up, else past the longest nap at once."""
    if hot:
        return 0
    return quiet + 1 if ramp else _QUIET_MAX


class Rounds:
    def __init__(
        self,
        host: Host,
        exchange: Exchange,
        repairer: Repairer,
        fetcher: Fetcher,
        tier: Tier,
        leases: Leases,
    ) -> None:
        self.host = host
        self.exchange = exchange
        self.repairer = repairer
        self.fetcher = fetcher
        self.tier = tier
        self.leases = leases
        self.waiting: dict[int, list[Staged]] = {}  # staged here, their step not in a lane yet
        # the last step to leave flight had as many ranks as the job has hosts (see IDLE_FIRST)
        self.settle = False
        # step -> the state its local work was done in (manifest written): skipped by advance
        # while it stays in that state, so a round's local work does not grow with the steps
        # kept (4 virtual hosts at --keep 1000: 100 puts took 5 s after 100 kept, 19 s after 400)
        self.settled: dict[int, tuple[StepRec, StepState]] = {}
        # The commit of a step is one decision for the whole job: the round that protects S
        # retires the steps retention drops (and a delete its step) on every daemon alike, but
        # each daemon removes or rewrites their manifests, and gives their files back, only in a
        # later round's local work. That round completes only once every daemon has done the
        # earlier one's, so every host has written S's manifest before any host lets go of a
        # step S retires: a crash anywhere in between leaves the retired steps whole on every
        # host, and adoption redoes the retirement if S is whole too (ARCHITECTURE.md, "The
        # commit"). (round, step, its local state) of steps out of the catalog, oldest first:
        self.retiring: list[tuple[int, int, Local]] = []
        self.left_at: dict[int, int] = {}  # step -> the round it became pinned (see above)
        # Seconds past the peer timeout that the next round's wait allows: a group's local work
        # (a repair a read asked for, a rebuild left from start-up, an exchange, a fetch) runs
        # inside one round, and every other daemon waits for it at the next round's reduction.
        # Set from what the whole job knows (the ballot's most bytes, the requests gathered),
        # so the same on every daemon (a repair longer than the peer timeout ended the job).
        self.allowance = 0.0

    @charged("rounds")
    def run(self) -> int:
        """Rounds until a daemon is asked to stop (then every daemon returns 0 together)."""
        h = self.host
        hot = False  # the last round moved something somewhere in the job
        quiet = 0  # rounds in a row that moved nothing anywhere: the same count on every daemon
        while True:
            if h.failure is not None:  # a thread the daemon needs is gone (Host.fail)
                raise DaemonFailedError(h.failure)
            ballot, group_out, rare_out, busy = self._collect()
            # A round right after one that moved anything polls instead of napping: the next
            # steps of a put (its records gathered, prepare, encode, protect) follow round after
            # round, and a napping wait costs each of them milliseconds (measured: a put of a
            # few kB took 50 ms, 20 of them in the one napping round that gathered its records).
            busy = busy or hot
            timeout = h.config.peer_timeout + self.allowance
            sum_reqs, sums = h.links.start_allreduce(ballot.sums, "sum")
            max_reqs, maxima = h.links.start_allreduce(ballot.maxima, "max")
            h.links.wait(sum_reqs + max_reqs, "round", timeout, busy)
            job = Ballot()
            job.sums, job.maxima = sums, maxima
            group_in: list[Any] = []
            if job.job_sum(Ballot.GROUP):  # every group gathers, so that every daemon agrees
                group_in = h.gl.allgather_json(group_out, "round (group)", timeout, busy)
            rare_in: list[Any] = []
            if job.job_sum(Ballot.RARE):
                rare_in = h.links.allgather_json(rare_out, "round (rare events)", timeout, busy)
            self._apply(job, group_in, rare_in)
            self.advance()
            if job.job_max(Ballot.STOP):
                return 0
            hot = bool(job.job_sum(Ballot.BUSY) or group_in or rare_in)
            in_flight = any(s is not None for s in h.catalog.lanes)
            quiet = next_quiet(quiet, hot, ramp=in_flight or not self.settle)
            if not (job.job_sum(Ballot.BUSY) or self.has_work()):
                # A trainer's request starts a round at once here; peers join at their next tick.
                h.wake.wait(idle_nap(quiet))
                h.wake.clear()

    # -- what this daemon brings to the round ------------------------------------------------------

    def _collect(self) -> tuple[Ballot, list[Any], list[Any], bool]:
        h = self.host
        cat = h.catalog
        ballot = Ballot()
        group_out: list[Any] = []
        rare_out: list[Any] = []
        with h.lock:
            events, h.events = h.events, []
            for ev in events:
                if isinstance(ev, Staged):
                    self.waiting.setdefault(ev.step, []).append(ev)
                    h.first_seen.setdefault(ev.step, time.monotonic())
                elif isinstance(ev, Prepared):
                    lane = cat.lane_of(ev.step)
                    if lane is not None:
                        ballot.add(lane, Ballot.PREPARED if ev.ok else Ballot.PREP_FAILED, 1)
                        if not ev.ok:
                            ballot.raise_to(lane, Ballot.FAIL_SLOT_NEG, -h.slot)
                elif isinstance(ev, Stored):
                    lane = cat.lane_of(ev.step)
                    if lane is not None:
                        ballot.add(lane, Ballot.STORED, 1)
                        ballot.add(lane, Ballot.PARITY_BYTES, ev.parity_bytes)
                        group_out.append(ev.to_json())
                elif isinstance(ev, (Pin, Unpin)):
                    group_out.append(ev.to_json())
                else:
                    rare_out.append(ev.to_json())
            for step in list(self.waiting):
                rec = cat.steps.get(step)
                if rec is not None and rec.lane is not None and rec.state == StepState.STAGING:
                    counted: set[int] = set()
                    for ev in self.waiting.pop(step):
                        old = rec.shards.get(ev.shard.rank)
                        again = ev.shard.rank in counted or (old is not None and old.slot == h.slot)
                        if not again:  # a rank putting an unfinished step again is counted once
                            self._count(ballot, rec.lane, ev)
                            counted.add(ev.shard.rank)
                        group_out.append(ev.to_json())
                elif rec is not None and rec.state in (
                    StepState.READY,
                    StepState.ENCODING,
                    StepState.PROTECTED,
                    StepState.PINNED,
                ):
                    # every rank had staged it already (or it is an older put, pinned here):
                    # this late shard is not part of it, and must not wait here for good
                    for ev in self.waiting.pop(step):
                        h.pool.release(ev.shard.buffer)
                elif rec is None or rec.state == StepState.LOST:
                    ballot.raise_job(Ballot.NEW_STEP_NEG, -step)  # a lane, please
            for step in list(h.wanted):  # allocated here, being staged: a lane, please
                rec = cat.steps.get(step)
                if rec is None or rec.state == StepState.LOST:
                    ballot.raise_job(Ballot.NEW_STEP_NEG, -step)
                else:
                    h.wanted.discard(step)
            h.staged_waiting = set(self.waiting)
            ballot.add_job(Ballot.RARE, len(rare_out))
            ballot.add_job(Ballot.GROUP, len(group_out))
            busy = bool(events) or bool(self.waiting) or bool(h.wanted)
            ballot.add_job(Ballot.BUSY, int(busy))
            ballot.raise_job(Ballot.STOP, int(h.stopping))
            ballot.raise_job(Ballot.WORK_BYTES, self._work_bytes())
            upto = self.tier.written_through()
            if upto is not None:
                ballot.raise_job(Ballot.PERSISTED_NEG, -upto)
        return ballot, group_out, rare_out, busy or self.has_work()

    @staticmethod
    def _count(ballot: Ballot, lane: int, ev: Staged) -> None:
        r = ev.shard.rank
        ballot.add(lane, Ballot.STAGED, 1)
        ballot.add(lane, Ballot.RANK_SUM, r)
        ballot.add(lane, Ballot.RANK_SQ, r * r)
        ballot.add(lane, Ballot.DATA_BYTES, ev.shard.nbytes)
        ballot.raise_to(lane, Ballot.WORLD, ev.world_size)
        ballot.raise_to(lane, Ballot.WORLD_NEG, -ev.world_size)

    # -- what the round brought --------------------------------------------------------------------

    def _apply(self, job: Ballot, group_in: list[Any], rare_in: list[Any]) -> None:
        h = self.host
        g = h.group
        with h.cond:
            h.rounds += 1
            h.last_round = time.monotonic()
            for pos, payload in enumerate(group_in):
                for raw in payload or []:
                    self._group_event(g.slots[pos], raw)
            for rec in h.catalog.count(job):
                h.local.setdefault(rec.step, Local())
                if not rec.state.in_flight:
                    self.settle = rec.world_size >= h.links.size
                    h.first_seen.pop(rec.step, None)
            for payload in rare_in:
                for raw in payload or []:
                    self._rare_event(raw)
            new = job.job_max(Ballot.NEW_STEP_NEG)
            if new is not None:
                self._lane_for(-new)
            most = max(job.job_max(Ballot.WORK_BYTES) or 0, self._asked_bytes(rare_in))
            self.allowance = allowance(most)
            persisted = job.job_max(Ballot.PERSISTED_NEG)
            if persisted is not None:
                self.tier.written_everywhere(-persisted)
            h.catalog.release_pins()  # their files go in this round's local work
            h.cond.notify_all()

    def _work_bytes(self) -> int:
        """Bytes this daemon's local work of this round may move, of what it knows before the
        round (with the lock): the next rebuild left from start-up, the steps it exchanges."""
        h = self.host
        most = 0
        if self.repairer.deferred:
            step, erased = self.repairer.deferred[0]
            rec = h.catalog.steps.get(step)
            if rec is not None:
                most = moved_bytes(rec, h.group.k, erased)
        for rec in h.catalog.steps.values():
            if rec.state in (StepState.READY, StepState.ENCODING):
                mine = sum(s.nbytes for s in rec.shards.values() if s.slot == h.slot)
                most += mine * (h.group.k + h.group.m) // h.group.k
        return most

    def _asked_bytes(self, rare_in: list[Any]) -> int:
        """The most bytes one group's repairs and one host's fetches asked for this round move
        (known to every daemon: the requests were gathered job-wide)."""
        h = self.host
        by_group: dict[int, int] = {}
        fetched: dict[int, int] = {}
        for payload in rare_in:
            for raw in payload or []:
                rec = h.catalog.steps.get(int(raw.get("step", -1)))
                if rec is None:
                    continue
                if raw.get("e") == "repair":
                    slot = int(raw["slot"])
                    g = h.catalog.group_of[slot]
                    erased = {slot: Erasures(set(raw["data"]), set(raw.get("parity", [])))}
                    by_group[g.index] = by_group.get(g.index, 0) + moved_bytes(rec, g.k, erased)
                elif raw.get("e") == "fetch" and int(raw["rank"]) in rec.shards:
                    to = int(raw["to"])
                    fetched[to] = fetched.get(to, 0) + rec.shards[int(raw["rank"])].nbytes
        return max([0, *by_group.values(), *fetched.values()])

    def _group_event(self, slot: int, raw: dict[str, Any]) -> None:
        h = self.host
        kind = raw.get("e")
        if kind == "staged":
            step, shard = int(raw["step"]), ShardRecord.from_json(raw["shard"])
            old = h.catalog.staged(step, shard)
            if old is not None and old.slot == h.slot and old.buffer != shard.buffer:
                self._drop_shard(step, old.rank, old.buffer)
            if slot == h.slot and h.catalog.steps.get(step) is not None:
                loc = h.local.setdefault(step, Local())
                loc.buffers[shard.rank] = shard.buffer
                loc.t.setdefault("staged", time.monotonic())
        elif kind == "stored":
            h.catalog.stored(
                slot,
                int(raw["step"]),
                raw.get("parity"),
                raw.get("crc", {}),
                raw.get("data_crc", []),
            )
        elif kind == "pin":
            h.catalog.pin(int(raw["step"]), int(raw["rank"]), int(raw["base"]))
        elif kind == "unpin":
            h.catalog.unpin(int(raw["step"]), int(raw["rank"]))

    def _rare_event(self, raw: dict[str, Any]) -> None:
        h = self.host
        kind = raw.get("e")
        if kind == "delete":
            h.catalog.delete(int(raw["step"]))
            self.tier.deleted(int(raw["step"]))
        elif kind == "fetch":
            self.fetcher.requests.append(Fetch(**{k: v for k, v in raw.items() if k != "e"}))
        elif kind == "offer":
            self.fetcher.offers.append(Offer(**{k: v for k, v in raw.items() if k != "e"}))
        elif kind == "repair":
            if int(raw["slot"]) in h.group.slots:
                self.repairer.requests.append(Repair(**{k: v for k, v in raw.items() if k != "e"}))
        elif kind == "repaired":
            self.repairer.done |= set(raw["ids"])
        elif kind == "lost":
            rec = h.catalog.lose(int(raw["step"]), raw["lost_hosts"], raw["ranks"])
            if rec is not None:
                h.stats["lost_steps"] += 1
                h.remove_manifest(rec.step)
        elif kind == "persist_failed":
            self.tier.failed(PersistFailed(int(raw["step"]), str(raw["error"])))

    def _lane_for(self, step: int) -> None:
        """The lowest new step gets a lane; with every lane taken, the oldest step still being
        staged is abandoned for it (the same choice on every daemon)."""
        h = self.host
        cat = h.catalog
        rec = cat.steps.get(step)
        if rec is not None and rec.state != StepState.LOST:
            return
        why = cat.refusal(step)
        if why is not None:  # older than the newest protected step: the same on every daemon
            cat.failed[step] = to_wire(StepExistsError(why))
            h.wanted.discard(step)
            h.first_seen.pop(step, None)
            for ev in self.waiting.pop(step, []):
                h.pool.release(ev.shard.buffer)
            return
        if rec is not None:
            self.forget(step)  # put afresh: the lost one's files go
        if cat.assign(step) is None:
            oldest = cat.oldest_staging()
            if oldest is None:
                return  # every lane is past staging: wait for one
            cat.fail(
                oldest,
                f"step {oldest} was abandoned: it was still being staged when {len(cat.lanes)} "
                f"steps were in flight and step {step} needed a lane (a rank never put it?)",
            )
            cat.assign(step)

    # -- the round's local work --------------------------------------------------------------------

    def has_work(self) -> bool:
        h = self.host
        with h.lock:
            return (
                bool(h.events)
                or bool(self.waiting)
                or bool(self.repairer.deferred)
                or self.fetcher.busy()
                or any(
                    r.state in (StepState.READY, StepState.ENCODING)
                    for r in h.catalog.steps.values()
                )
            )

    def advance(self) -> None:
        """The round's local work, the same on every daemon of a group (the round thread)."""
        h = self.host
        live = [r for r in h.catalog.steps.values() if r.state in _EXCHANGING]
        for rec in sorted(live, key=lambda r: r.step):
            loc = h.local.setdefault(rec.step, Local())
            if rec.state == StepState.READY and not loc.prepared:
                self.exchange.prepare(rec, loc)
            elif rec.state == StepState.ENCODING and not loc.stored:
                self.exchange.run(rec, loc)
        self._announce(self.repairer.serve())
        self.fetcher.serve()
        with h.cond:
            for rec in list(h.catalog.steps.values()):
                done = self.settled.get(rec.step)
                if done is not None and done[0] is rec and done[1] is rec.state:
                    continue  # its local work done in this state (most kept steps, most rounds)
                loc = h.local.setdefault(rec.step, Local())
                if rec.state == StepState.PROTECTED and not loc.manifest:
                    h.phase("committing")
                    h.write_manifest(rec, loc)
                    self.tier.persist(rec)
                    h.stats["steps_protected"] += 1
                    now = time.monotonic()
                    for rank in loc.buffers:
                        t_alloc = h.t_alloc.pop((rec.step, rank), None)
                        if t_alloc is not None:
                            h.latency.protect.observe(now - t_alloc)
                    loc.t["protected"] = time.monotonic()
                    if h.trace:
                        t0 = loc.t.get("staged", loc.t.get("ready", 0.0))
                        phases = " ".join(f"{k}=+{(v - t0) * 1e3:.1f}ms" for k, v in loc.t.items())
                        # t0: CLOCK_MONOTONIC, which the trainers' clocks on this machine share
                        h.log(f"step {rec.step}: t0={t0:.4f} {phases}")
                if (
                    rec.state == StepState.PINNED
                    and not loc.pinned_manifest
                    and self._retired_before(rec.step)
                ):
                    h.write_manifest(rec, loc)  # says so: a restart keeps it for its referrers
                    loc.pinned_manifest = True
                if rec.state == StepState.FAILED:
                    self.forget(rec.step)
                elif (rec.state == StepState.PROTECTED and loc.manifest) or (
                    rec.state == StepState.PINNED and loc.pinned_manifest
                ):
                    self.settled[rec.step] = (rec, rec.state)
            for step in sorted(h.local.keys() - h.catalog.steps.keys()):
                self._retire(step)  # deleted, or evicted by retention
            self._retired_files()
            h.cond.notify_all()
        self.tier.settle()

    def _announce(self, outcome: tuple[list[str], list[Lost]]) -> None:
        """What this round's repairs mean for the rest of the job: the first host of the group
        tells readers elsewhere that their repairs ran, and every host which steps were lost."""
        h = self.host
        ids, lost = outcome
        if h.group.position(h.slot) != 0:
            return
        events: list[Event] = [*lost]
        if ids:
            events.append(Repaired(ids))
        for ev in events:
            h.emit(ev)

    def _drop_shard(self, step: int, rank: int, buffer: str) -> None:
        """A rank put this unfinished step again: its earlier shard's buffer goes back."""
        h = self.host
        loc = h.local.get(step)
        if loc is not None and loc.buffers.get(rank) == buffer:
            del loc.buffers[rank]
        h.pool.release(buffer)

    def _retired_before(self, step: int) -> bool:
        """Whether ``step`` left the readers' view in an earlier round than this one (the first
        call notes this round)."""
        h = self.host
        return self.left_at.setdefault(step, h.rounds) < h.rounds

    def _retire(self, step: int) -> None:
        """``step`` left the catalog in this round (retention, a delete): its files wait for
        the next round (see :attr:`retiring`); its number may be put again at once."""
        h = self.host
        loc = h.local.pop(step)
        self.retiring.append((h.rounds, step, loc))
        self.left_at.pop(step, None)
        self.forget(step, files=False)

    def _retired_files(self) -> None:
        """Steps that left the catalog in an earlier round: their manifests and files go."""
        h = self.host
        while self.retiring and self.retiring[0][0] < h.rounds:
            h.phase("retiring")
            _, step, loc = self.retiring.pop(0)
            for name in loc.buffers.values():
                self.leases.free(name)
            h.pool.release(loc.parity)
            new = h.local.get(step)  # the number put again: its manifest is the new step's
            if new is None or not (new.manifest or new.pinned_manifest):
                h.remove_manifest(step)

    def forget(self, step: int, files: bool = True) -> None:
        """Give this host's files of ``step`` back to the pool, its manifest removed (the round
        thread, under the lock); a failed step leaves the catalog, its error kept for late
        waiters. Without ``files``, only what this host noted of it goes."""
        h = self.host
        self.settled.pop(step, None)
        h.announced.discard(step)
        h.first_seen.pop(step, None)
        for key in [key for key in h.t_alloc if key[0] == step]:
            del h.t_alloc[key]
        h.catalog.drop_failed(step)
        if not files:
            return
        loc = h.local.pop(step, None)
        if loc is not None:
            for name in loc.buffers.values():
                self.leases.free(name)
            h.pool.release(loc.parity)
        h.remove_manifest(step)
