"""The daemon's vocabulary on the wire and between its modules: step states and typed messages.

Nothing here does I/O or holds state; every module of the daemon, the client and ``ecsnap
status`` import from here, and this module imports nothing of :mod:`storage` but its errors.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Snapshot", "StepState"]


class StepState(str, enum.Enum):
    """Where a step stands. Only ``PROTECTED`` steps are visible to readers::

    STAGING --(all world_size shards staged)--> READY --(every daemon prepared)--> ENCODING
    ENCODING --(every daemon stored its parity)--> PROTECTED
    READY --(a daemon could not prepare: no memory)--> FAILED
    PROTECTED --(more than m chunks of a stripe lost)--> LOST
    """

    STAGING = "staging"
    READY = "ready"
    ENCODING = "encoding"
    PROTECTED = "protected"
    FAILED = "failed"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value

    @property
    def in_flight(self) -> bool:
        return self in (StepState.STAGING, StepState.READY, StepState.ENCODING)


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
    sent_bytes: int
    received_bytes: int
    stats: dict[str, float]
    protected: list[int]
    in_flight: list[int]
    lost: dict[str, Any]
    errors: dict[str, int]
    last_error: str | None
    degraded_stripes: int
    hosts_up: int
    hosts_missing: int
    metrics_port: int | None
    persist_dir: str | None
    persisted: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
