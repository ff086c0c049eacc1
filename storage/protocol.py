"""The daemon's vocabulary on the wire and between its modules: step states, typed messages, and
the fixed-size record every daemon contributes to a round.

Nothing here does I/O or holds state; the daemon's modules, the client and ``ecsnap status``
import from here, and this module imports nothing of :mod:`storage`.

A round carries three kinds of traffic (see :mod:`storage.rounds`):

- a :class:`Ballot` per daemon, reduced over the whole job (sums and maxima of a fixed-size
  vector of int64, whatever the number of hosts, ranks or tensors): per in-flight step lane, the
  ranks staged, the daemons prepared and stored; and a few job-wide fields;
- the group's events (:data:`GROUP_EVENTS`), gathered within the group of k+m hosts only, in a
  round where some group has any (the ballot counts them): the shard records and checksums a
  group needs to encode and rebuild its members' blobs;
- rare events (:data:`RARE_EVENTS`), gathered over the job only in a round where some daemon has
  one (the ballot counts them): deletes, fetches for reads from another host, repairs, lost steps.

An idle round is the ballot's two reductions alone.
"""

from __future__ import annotations

import enum
import types
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypedDict, Union, get_args, get_origin, get_type_hints

import numpy as np

__all__ = [
    "GROUP_EVENTS",
    "LANES",
    "NONE",
    "RARE_EVENTS",
    "REQUESTS",
    "Ballot",
    "Delete",
    "Event",
    "Fetch",
    "Lost",
    "Offer",
    "PersistFailed",
    "Pin",
    "Prepared",
    "Repair",
    "Repaired",
    "RequestError",
    "ShardRecord",
    "Snapshot",
    "Staged",
    "StepState",
    "Stored",
    "Unpin",
    "event_from_json",
    "parse_request",
]


class StepState(str, enum.Enum):
    """Where a step stands. Only ``PROTECTED`` steps are visible to readers::

    STAGING --(all world_size shards staged)--> READY --(every daemon prepared)--> ENCODING
    ENCODING --(every daemon stored its parity)--> PROTECTED
    STAGING or READY --(a daemon could not prepare; ranks that disagree)--> FAILED
    PROTECTED --(more than m chunks of a stripe lost)--> LOST
    PROTECTED --(retention or a delete, while a kept step of the group refers to it)--> PINNED

    A ``PINNED`` step is gone for readers, but its group keeps its chunks: the unchanged
    tensors of later steps are references to its bytes (see :mod:`storage.delta`).
    """

    STAGING = "staging"
    READY = "ready"
    ENCODING = "encoding"
    PROTECTED = "protected"
    FAILED = "failed"
    LOST = "lost"
    PINNED = "pinned"

    def __str__(self) -> str:
        return self.value

    @property
    def in_flight(self) -> bool:
        return self in (StepState.STAGING, StepState.READY, StepState.ENCODING)

    @property
    def held(self) -> bool:
        """Its chunks are kept, checked and rebuilt: protected, or pinned by a later step."""
        return self in (StepState.PROTECTED, StepState.PINNED)


# -- the ballot ------------------------------------------------------------------------------------

LANES = 16  # steps in flight at once (staging, ready or encoding), job-wide
NONE = np.iinfo(np.int64).min  # "no value" in a maximum
# What the ballot's int64 fields can hold: a step (and its negation), a byte count; and the
# ranks of a job, whose squares it sums (a million ranks sum to 3.7e17, 1/25 of what fits).
MAX_STEP = int(np.iinfo(np.int64).max)
MAX_WORLD = 1 << 20


class Ballot:
    """One daemon's fixed-size record for one round, and (after the reduction) the job's.

    ``sums`` is reduced with MPI_SUM, ``maxima`` with MPI_MAX (a minimum travels negated).
    Per lane (an in-flight step, numbered the same on every daemon):

    - sums: ranks newly staged here, the sum of their ranks and of their squares (so that a rank
      counted twice, on two hosts, shows), their bytes; daemons that prepared, that failed to
      prepare, that stored their parity; parity bytes stored;
    - maxima: the world size given (and its negation: the smallest), the negated lowest slot
      that failed to prepare.

    Job-wide: rare events waiting, group events waiting (in some group: then every group gathers
    its own), work waiting (sums); stop asked, the lowest new step wanting a lane (the max of
    its negation), the lowest step every daemon has persisted through (likewise), the most bytes
    a daemon's local work of this round may move (what the next round's wait allows for).
    """

    # per-lane sums
    STAGED, RANK_SUM, RANK_SQ, DATA_BYTES, PREPARED, PREP_FAILED, STORED, PARITY_BYTES = range(8)
    LANE_SUMS = 8
    # per-lane maxima
    WORLD, WORLD_NEG, FAIL_SLOT_NEG = range(3)
    LANE_MAXIMA = 3
    # job-wide sums and maxima, after the lanes
    RARE, GROUP, BUSY = range(3)
    STOP, NEW_STEP_NEG, PERSISTED_NEG, WORK_BYTES = range(4)

    def __init__(self) -> None:
        self.sums = np.zeros(LANES * self.LANE_SUMS + 3, dtype=np.int64)
        self.maxima = np.full(LANES * self.LANE_MAXIMA + 4, NONE, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.sums.nbytes + self.maxima.nbytes)

    def add(self, lane: int, field_: int, value: int) -> None:
        self.sums[lane * self.LANE_SUMS + field_] += value

    def sum(self, lane: int, field_: int) -> int:
        return int(self.sums[lane * self.LANE_SUMS + field_])

    def raise_to(self, lane: int, field_: int, value: int) -> None:
        i = lane * self.LANE_MAXIMA + field_
        self.maxima[i] = max(int(self.maxima[i]), value)

    def max(self, lane: int, field_: int) -> int | None:
        v = int(self.maxima[lane * self.LANE_MAXIMA + field_])
        return None if v == NONE else v

    def add_job(self, field_: int, value: int) -> None:
        self.sums[LANES * self.LANE_SUMS + field_] += value

    def job_sum(self, field_: int) -> int:
        return int(self.sums[LANES * self.LANE_SUMS + field_])

    def raise_job(self, field_: int, value: int) -> None:
        i = LANES * self.LANE_MAXIMA + field_
        self.maxima[i] = max(int(self.maxima[i]), value)

    def job_max(self, field_: int) -> int | None:
        v = int(self.maxima[LANES * self.LANE_MAXIMA + field_])
        return None if v == NONE else v


# -- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRecord:
    """One rank's shard of one step as its group knows it: fixed size, whatever its tensors.

    ``table`` is (offset, length) of the shard's tensor table (its structure, dtypes, shapes and
    offsets, JSON) inside the shard's own bytes: it is erasure-coded and rebuilt with them, and
    read from there; it never travels in a round. ``base`` is the earlier step whose shard of
    the same rank holds this shard's unchanged tensors (-1: none, the shard is whole); the
    group keeps that step's chunks while this record is kept."""

    rank: int
    slot: int
    nbytes: int
    buffer: str
    table: tuple[int, int]
    base: int = -1

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "slot": self.slot,
            "nbytes": self.nbytes,
            "buffer": self.buffer,
            "table": list(self.table),
            "base": self.base,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ShardRecord:
        off, length = d["table"]
        return ShardRecord(
            int(d["rank"]),
            int(d["slot"]),
            int(d["nbytes"]),
            str(d["buffer"]),
            (off, length),
            int(d.get("base", -1)),
        )


class Event:
    """A typed event a module hands the round engine (``Host.emit``); ``kind`` names it on the
    wire. The engine sends each where it belongs: the ballot, the group, or the rare gather."""

    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"e": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = v.to_json() if isinstance(v, ShardRecord) else v
        return out


@dataclass(frozen=True)
class Staged(Event):
    """A rank's shard is in this host's memory (ballot: counted; group: its record)."""

    kind: ClassVar[str] = "staged"
    step: int
    world_size: int
    shard: ShardRecord


@dataclass(frozen=True)
class Prepared(Event):
    """This daemon took its parity memory for the step, or could not (ballot only)."""

    kind: ClassVar[str] = "prepared"
    step: int
    ok: bool


@dataclass(frozen=True)
class Stored(Event):
    """This daemon's part of the exchange is done (ballot: counted; group: names, checksums).

    ``crc`` holds the checksums of this host's parity chunks and of its data chunks where it
    takes those itself; ``data_crc`` those of the other hosts' data chunks it took as they
    arrived, as their stripes' encoder or first copy holder, where those take them
    (:meth:`storage.exchange.Exchange.encoders_checksum`), as ``[slot, chunk, crc]``."""

    kind: ClassVar[str] = "stored"
    step: int
    parity: str | None
    crc: dict[str, list[int]]
    parity_bytes: int
    data_crc: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Pin(Event):
    """Rank ``rank`` will put ``step`` with references to its shard of ``base`` (group only):
    applied alike on every host of the group, it keeps ``base`` from being freed until the
    shard's record (or an :class:`Unpin`) replaces it; refused if ``base`` is gone already."""

    kind: ClassVar[str] = "pin"
    step: int
    rank: int
    base: int


@dataclass(frozen=True)
class Unpin(Event):
    """The put that pinned ``base`` for (``step``, ``rank``) was given up (group only)."""

    kind: ClassVar[str] = "unpin"
    step: int
    rank: int


@dataclass(frozen=True)
class Delete(Event):
    kind: ClassVar[str] = "delete"
    step: int


@dataclass(frozen=True)
class Fetch(Event):
    """A reader on slot ``to`` wants ``rank``'s shard of ``step`` (or only its table)."""

    kind: ClassVar[str] = "fetch"
    id: str
    step: int
    rank: int
    to: int
    table_only: bool
    # the protected step whose shard of ``rank`` refers to ``step`` (pinned, gone for readers:
    # its holder serves it only to a reader of a step that refers to it); -1: a plain read
    base_of: int = -1


@dataclass(frozen=True)
class Offer(Event):
    """The holder of a fetched shard answers: in the round that carries this, it sends
    ``nbytes`` to the reader, with the checksums of the shard's chunks (offset, length, crc)."""

    kind: ClassVar[str] = "offer"
    id: str
    to: int
    holder: int
    nbytes: int
    table: tuple[int, int] | list[int]
    chunks: list[list[int]]
    error: str | None = None


@dataclass(frozen=True)
class Repair(Event):
    """Rebuild data chunks ``data`` and parity chunks ``parity`` of slot ``slot``'s blob."""

    kind: ClassVar[str] = "repair"
    id: str
    step: int
    slot: int
    data: list[int]
    parity: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Repaired(Event):
    """A group ran the repairs named, for readers outside it that wait on them."""

    kind: ClassVar[str] = "repaired"
    ids: list[str]


@dataclass(frozen=True)
class Lost(Event):
    """A group found ``step`` beyond repair: more than m chunks of a stripe gone."""

    kind: ClassVar[str] = "lost"
    step: int
    lost_hosts: list[str]
    ranks: list[int]


@dataclass(frozen=True)
class PersistFailed(Event):
    kind: ClassVar[str] = "persist_failed"
    step: int
    error: str


GROUP_EVENTS = frozenset({"staged", "stored", "pin", "unpin"})
RARE_EVENTS = frozenset(
    {"delete", "fetch", "offer", "repair", "repaired", "lost", "persist_failed"}
)
_KINDS: dict[str, type[Event]] = {
    c.kind: c
    for c in (
        Staged,
        Prepared,
        Stored,
        Pin,
        Unpin,
        Delete,
        Fetch,
        Offer,
        Repair,
        Repaired,
        Lost,
        PersistFailed,
    )
}


def event_from_json(d: dict[str, Any]) -> Event:
    """The typed event a round carried (its ``e`` names the class)."""
    cls = _KINDS[d["e"]]
    args = {k: v for k, v in d.items() if k != "e"}
    if cls is Staged:
        args["shard"] = ShardRecord.from_json(args["shard"])
    return cls(**args)


# -- socket requests -------------------------------------------------------------------------------
# One TypedDict per request a Store sends its daemon (``op`` names it); :func:`parse_request`
# checks a frame against its type before a handler sees it.


class HelloRequest(TypedDict):
    op: str
    job: str
    rank: int


class _WithBase(TypedDict, total=False):
    base: int
    base_table: str  # alloc: the digest of the base shard's table, as the trainer wrote it
    dry: bool  # alloc: check the put only (a put with references allocates later)
    refs: int  # staged: bytes of the shard's tensors stored as references to its base
    cpu_stage: float  # staged: the trainer's CPU seconds copying the shard in (storage.cpu)
    cpu_hash: float  # staged: ... and hashing its leaves


class AllocRequest(_WithBase):
    """A buffer of ``nbytes`` for rank ``rank``'s shard of ``step``; with ``base``, the shard
    refers to that earlier step's shard of the rank for its unchanged tensors (the reply's
    ``base`` says whether the daemon could keep it: None means put the whole shard)."""

    op: str
    step: int
    rank: int
    world_size: int
    nbytes: int


class StagedRequest(_WithBase):
    """The shard's bytes are in the buffer ``alloc`` gave, its tensor table at ``table``
    (offset, length)."""

    op: str
    step: int
    rank: int
    world_size: int
    buffer: str
    nbytes: int
    table: list[int]


class AbortRequest(TypedDict):
    op: str
    step: int
    rank: int


class WaitRequest(TypedDict):
    """Reply once ``step`` is protected (or failed), within ``timeout`` seconds."""

    op: str
    step: int
    timeout: float | None


class GetRequest(TypedDict, total=False):
    op: str
    step: int | None  # None: the newest protected step
    rank: int
    meta_only: bool
    base_of: int  # the shard of ``step`` that the protected step ``base_of`` refers to


class ReleaseRequest(TypedDict):
    op: str
    path: str


class UnleaseRequest(TypedDict):
    op: str
    buffers: list[str]


class StepRequest(TypedDict):
    """``status`` and ``delete`` of one step."""

    op: str
    step: int


class PlainRequest(TypedDict):
    """``steps`` and ``info``."""

    op: str


class AheadRequest(TypedDict):
    """The files rank ``rank``'s next puts may be given that are made already (a trainer maps
    them before its puts ask), and whether more are being made."""

    op: str
    rank: int


class PremapRequest(TypedDict):
    """The reserve files claimed for rank ``rank`` (a trainer maps them before its first put),
    its share of ``--reserve`` counting ``world_size`` ranks spread evenly over the hosts."""

    op: str
    rank: int
    world_size: int


class GetReply(TypedDict, total=False):
    """Where a shard's bytes are: a file to map (``size`` bytes), the shard's ``nbytes`` and its
    table's (offset, length) in it; ``temp`` files are the reader's to release; ``buffer`` names
    a leased one. With ``meta_only``: ``meta``, the table itself."""

    ok: bool
    step: int
    nbytes: int
    path: str
    size: int
    table: list[int]
    temp: bool
    buffer: str
    meta: dict[str, Any]
    tier: str


REQUESTS: dict[str, Any] = {
    "hello": HelloRequest,
    "alloc": AllocRequest,
    "staged": StagedRequest,
    "abort": AbortRequest,
    "wait": WaitRequest,
    "get": GetRequest,
    "release": ReleaseRequest,
    "unlease": UnleaseRequest,
    "steps": PlainRequest,
    "status": StepRequest,
    "delete": StepRequest,
    "info": PlainRequest,
    "ahead": AheadRequest,
    "premap": PremapRequest,
}
_AT_LEAST = {"world_size": 1}  # other ints are >= 0
_AT_MOST = {"world_size": MAX_WORLD, "rank": MAX_WORLD - 1}  # others fit an int64


class RequestError(ValueError):
    """A frame that is not a well-formed request; the message names the field."""


def parse_request(msg: dict[str, Any]) -> tuple[str, Any]:
    """``(op, msg)`` with ``msg`` checked against its request type: every required key present,
    every value of its type, ints >= 0 (``world_size`` >= 1), a ``rank`` below its ``world_size``.
    Raises :class:`RequestError`."""
    op = msg.get("op")
    kind = REQUESTS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise RequestError(f"unknown request {op!r}; known: {', '.join(sorted(REQUESTS))}")
    hints = get_type_hints(kind)
    for key, tp in hints.items():
        if key == "op":
            continue
        if key not in msg:
            if key in kind.__required_keys__:
                raise RequestError(f"request {op!r} lacks {key!r}")
            continue
        if not _is(msg[key], tp, _AT_LEAST.get(key, 0), _AT_MOST.get(key, MAX_STEP)):
            raise RequestError(
                f"request {op!r}: {key} must be {_describe(tp, key)}, got {msg[key]!r}"
            )
    if "rank" in msg and "world_size" in msg and msg["rank"] >= msg["world_size"]:
        raise RequestError(
            f"request {op!r}: rank {msg['rank']} is not below world_size {msg['world_size']}"
        )
    return str(op), msg


def _is(value: Any, tp: Any, low: int, high: int = MAX_STEP) -> bool:
    if tp is int:
        return type(value) is int and low <= value <= high
    if tp is float:
        return type(value) in (int, float) and 0 <= value <= MAX_STEP  # (not NaN, not inf)
    if tp is type(None):
        return value is None
    if tp in (str, bool):
        return type(value) is tp
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp)
        return type(value) is list and all(_is(v, item, 0) for v in value)
    if origin is dict:
        return type(value) is dict
    if origin in (Union, types.UnionType):
        return any(_is(value, t, low, high) for t in get_args(tp))
    return False


def _describe(tp: Any, key: str) -> str:
    if tp is int:
        return f"an int in {_AT_LEAST.get(key, 0)}..{_AT_MOST.get(key, MAX_STEP)}"
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(t, key) for t in get_args(tp))
    if tp is type(None):
        return "None"
    return f"a {getattr(tp, '__name__', str(tp))}"


# -- the daemon at a glance ------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """One daemon's state at a glance: the ``info`` reply, ``ecsnap status`` and ``/metrics``.

    Taken under the daemon's lock without I/O (``persisted`` is listed before the lock)."""

    job: str
    host: str
    slot: int
    hosts: list[str]
    k: int
    m: int
    health: str
    latest: int | None
    data_bytes: int
    parity_bytes: int
    pool_bytes: int
    memory_budget: int | None
    memory_limit: int  # the budget, or what the file system under --root holds
    sent_bytes: int
    received_bytes: int
    gathered_bytes: int
    rounds: int
    metadata_bytes: int
    stats: dict[str, float]
    protected: list[int]
    in_flight: list[dict[str, Any]]  # {"step", "state", "age_s", "waiting_on"}, oldest first
    lost: dict[str, Any]
    errors: dict[str, int]
    last_error: str | None
    degraded_stripes: int
    hosts_up: int
    hosts_missing: int
    metrics_port: int | None
    persist_dir: str | None
    persisted: list[int] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)  # hosts whose daemons fell silent
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by phase (storage.cpu)
    # failed accepts of the control socket that passed (out of descriptors...), by errno name
    accept_errors: dict[str, int] = field(default_factory=dict)
    reason: str | None = None  # why the daemon is failing (health "failed"), if it is
    # steps gone for readers but held here as the base of newer steps' unchanged tensors
    pinned: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
