"""Recovery: manifests on disk, adopting a host's files, and planning the repair of lost chunks.

What outlives every process is ``<root>/<job>/<host>/``: shard buffers in ``data/``, parity in
``parity/`` and one manifest per protected step in ``steps/<step>.json``. A manifest holds what
the job agreed on for the step (world size, bytes, the layout, every slot's host) and what the
host's group needs to rebuild any of its members: each shard record of the group (rank, host,
size, file, where its tensor table lies in it), every member's checksums and parity file. It is
the same on every host of a group (its size grows with the group, not with the job), so a host
that lost its manifest, or holds one that fails its checksum, takes it from a group peer.

A relaunched storage job (``mpiexec -n H ecsnap serve`` with the same arguments) first adopts:

1. each daemon reads its manifests and claims the slot whose files it holds; daemons holding
   nothing (new or wiped hosts) take the slots nobody claims, in rank order;
2. the daemons of each group agree on every step's manifest, and each checks its own chunks
   against their checksums: a missing, truncated or corrupted chunk is an erasure;
3. per stripe, at most m erasures are repaired: each host that lost a chunk receives k surviving
   chunks of that stripe and decodes its own data and parity back (:func:`plan_repair`); a stripe
   with more than m erasures makes the step unrecoverable, and the step is reported as lost, with
   the hosts and ranks that cannot be rebuilt.

Rebuild happens at start-up, before the daemons serve trainers, so redundancy is whole again
before anything new is written; the same repair runs while serving when a read finds a bad chunk.
Steps that were being written when the job died have no manifest: their files are deleted.

This module is pure (no MPI): the daemon moves the bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codec import checksum
from storage.catalog import Catalog, ShardRec, StepRec
from storage.placement import StripeLayout
from storage.protocol import StepState

__all__ = [
    "MANIFEST_VERSION",
    "Erasures",
    "RepairPlan",
    "manifest_of",
    "plan_repair",
    "read_manifest",
    "rec_from_manifest",
    "write_manifest",
]

MANIFEST_VERSION = 2  # 2: per group, tensor tables inside the shards


def manifest_of(rec: StepRec, catalog: Catalog, job: str, hosts: list[str]) -> dict[str, Any]:
    """The manifest of a protected step as this host's group knows it (the same on each host
    of the group)."""
    assert catalog.group is not None
    return {
        "version": MANIFEST_VERSION,
        "job": job,
        "step": rec.step,
        "world_size": rec.world_size,
        "data_bytes": rec.data_bytes,
        "parity_bytes": rec.parity_bytes,
        "hosts": hosts,
        "chunk_bytes": catalog.chunk_bytes,  # the job's largest (--chunk-bytes)
        "step_chunk_bytes": rec.chunk_bytes,  # this step's, in this group
        "groups": [{"slots": list(g.slots), "k": g.k, "m": g.m} for g in catalog.groups],
        "group": catalog.group.index,
        "shards": [s.to_json() for s in sorted(rec.shards.values(), key=lambda s: s.rank)],
        "crc": {str(slot): rec.stored[slot] for slot in sorted(rec.stored)},
        "parity": {str(slot): name for slot, name in sorted(rec.parity.items())},
        "pinned": rec.state == StepState.PINNED,
    }


def _digest(manifest: dict[str, Any]) -> int:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(path: Path, manifest: dict[str, Any]) -> int:
    """Write atomically (a manifest is complete or absent), mode 0600, with its checksum;
    returns its size in bytes."""
    data = json.dumps(dict(manifest, checksum=_digest(manifest)), separators=(",", ":")).encode()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest at ``path``, or None if it is unreadable or fails its checksum."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        return None
    if data.get("checksum") != _digest(data):
        return None
    return data


def scan(directory: Path) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Valid manifests by step, and the names of files that failed their check."""
    valid: dict[int, dict[str, Any]] = {}
    bad: list[str] = []
    steps = directory / "steps"
    if not steps.is_dir():
        return valid, bad
    for path in sorted(steps.glob("*.json")):
        m = read_manifest(path)
        if m is None:
            bad.append(path.name)
        else:
            valid[int(m["step"])] = m
    return valid, bad


def rec_from_manifest(m: dict[str, Any], catalog: Catalog) -> StepRec:
    rec = StepRec(
        int(m["step"]),
        int(m["world_size"]),
        state=StepState.PINNED if m.get("pinned") else StepState.PROTECTED,
        data_bytes=int(m["data_bytes"]),
        parity_bytes=int(m["parity_bytes"]),
        chunk_bytes=int(m["step_chunk_bytes"]),
    )
    for s in m["shards"]:
        shard = ShardRec.from_json(s)
        rec.shards[shard.rank] = shard
    rec.stored = {int(slot): c for slot, c in m["crc"].items()}
    rec.parity = {int(slot): str(name) for slot, name in m["parity"].items()}
    catalog.layout(rec)
    return rec


@dataclass
class Erasures:
    """Chunks one host lost for one step: its data chunks (by blob index) and parity slots."""

    data: set[int] = field(default_factory=set)
    parity: set[int] = field(default_factory=set)

    def to_json(self) -> dict[str, list[int]]:
        return {"data": sorted(self.data), "parity": sorted(self.parity)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Erasures:
        return Erasures(set(d.get("data", [])), set(d.get("parity", [])))

    def __bool__(self) -> bool:
        return bool(self.data or self.parity)


@dataclass
class RepairPlan:
    """Per stripe with erasures: the erased chunk indexes and the k surviving ones to read."""

    stripes: dict[int, tuple[list[int], list[int]]]  # stripe -> (erased, sources)
    lost_stripes: list[int]  # stripes with more than m erasures: cannot be rebuilt

    @property
    def recoverable(self) -> bool:
        return not self.lost_stripes


def holder(layout: StripeLayout, s: int, index: int) -> int:
    """Group position holding chunk ``index`` (0..k-1 data, k.. parity) of stripe ``s``."""
    if index < layout.k:
        return layout.data_position(s, index)
    return layout.parity_positions(s)[index - layout.k]


def stripe_erasures(layout: StripeLayout, erased: dict[int, Erasures]) -> dict[int, set[int]]:
    """Erased chunk indexes per stripe, from per-position erasures."""
    out: dict[int, set[int]] = {}
    for pos, e in erased.items():
        for c in e.data:
            s = layout.data_stripes[pos][c]
            j = (pos - s - layout.m) % layout.n
            out.setdefault(s, set()).add(j)
        for i in e.parity:
            s = layout.parity_stripes[pos][i]
            out.setdefault(s, set()).add(layout.k + layout.parity_positions(s).index(pos))
    return out


def plan_repair(layout: StripeLayout, erased: dict[int, Erasures]) -> RepairPlan:
    """Which surviving chunks rebuild which erased ones, stripe by stripe (deterministic)."""
    stripes: dict[int, tuple[list[int], list[int]]] = {}
    lost: list[int] = []
    n = layout.k + layout.m
    for s, indexes in sorted(stripe_erasures(layout, erased).items()):
        if len(indexes) > layout.m:
            lost.append(s)
            continue
        sources = [i for i in range(n) if i not in indexes][: layout.k]
        stripes[s] = (sorted(indexes), sources)
    return RepairPlan(stripes, lost)


def lost_parts(
    rec: StepRec, erased_by_slot: dict[int, Erasures], hosts: list[str]
) -> tuple[list[str], list[int]]:
    """The hosts with erasures and the ranks whose shards they held, for an unrecoverable step."""
    slots = sorted(slot for slot, e in erased_by_slot.items() if e)
    ranks = sorted(r for r, s in rec.shards.items() if s.slot in slots)
    return [hosts[s] for s in slots], ranks
