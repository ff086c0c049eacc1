"""A shard's tensor table: its leaves (dtype, shape, offset, size) and its skeleton, stored as JSON
in the shard's own bytes after the leaves, and where it lies there.

A shard put with references (see :mod:`storage.delta`) names its ``base`` step; each leaf marked
``ref`` lies in that step's shard of the same rank, at its ``offset`` there. Every leaf may carry
the digest of its bytes (XXH3-128, hex), which the next put compares.

No torch here: the daemon reads tables (for ``structure``, the persistent tier) without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

from storage.errors import StorageError

__all__ = [
    "ALIGN",
    "Leaf",
    "aligned",
    "digest",
    "pack_table",
    "table_place",
    "unpack_table",
    "whole",
]

ALIGN = 64


@dataclass
class Leaf:
    """One tensor or array of a shard: where its bytes go and what they are."""

    kind: str  # "torch" | "numpy"
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    source: Any = None  # the object to copy from (put side only)
    requires_grad: bool = False
    device: str = "cpu"
    digest: str | None = None  # XXH3-128 of its bytes, hex, where the put computed it
    ref: bool = False  # its bytes lie in the base step's shard, at ``offset`` there

    def meta(self) -> dict[str, Any]:
        out = {
            "k": self.kind,
            "dt": self.dtype,
            "sh": self.shape,
            "o": self.offset,
            "n": self.nbytes,
        }
        if self.requires_grad:
            out["rg"] = True
        if self.device != "cpu":
            out["dev"] = self.device
        if self.digest is not None:
            out["h"] = self.digest
        if self.ref:
            out["r"] = True
        return out

    @staticmethod
    def from_meta(meta: dict[str, Any]) -> Leaf:
        return Leaf(
            kind=meta["k"],
            dtype=meta["dt"],
            shape=list(meta["sh"]),
            offset=meta["o"],
            nbytes=meta["n"],
            requires_grad=bool(meta.get("rg", False)),
            device=str(meta.get("dev", "cpu")),
            digest=meta.get("h"),
            ref=bool(meta.get("r", False)),
        )


def pack_table(skeleton: Any, leaves: list[dict[str, Any]], base: int | None = None) -> bytes:
    """A shard's tensor table: its skeleton and every leaf's dtype, shape and offset, as JSON.
    It is stored in the shard's own bytes, after the leaves (see :func:`table_place`)."""
    body: dict[str, Any] = {"skeleton": skeleton, "leaves": leaves}
    if base is not None:
        body["base"] = base
    return json.dumps(body, separators=(",", ":")).encode()


_LEAF_KEYS = frozenset({"k", "dt", "sh", "o", "n"})


def unpack_table(raw: bytes, where: str) -> dict[str, Any]:
    """The tensor table :func:`pack_table` wrote, from ``raw``; a :class:`StorageError` naming
    ``where`` (the step and rank) if the bytes are none. Only a writer other than
    :mod:`storage.client` can store such a shard: the bytes a shard holds are checksummed and
    erasure-coded, so what comes back is what was staged."""
    try:
        table = json.loads(raw)
    except ValueError as exc:  # (UnicodeDecodeError too)
        problem = f"does not parse ({exc})"
    else:
        leaves = table.get("leaves") if isinstance(table, dict) else None
        if not isinstance(table, dict) or "skeleton" not in table:
            problem = "is no object with a skeleton"
        elif not isinstance(leaves, list) or not all(
            isinstance(m, dict) and m.keys() >= _LEAF_KEYS for m in leaves
        ):
            problem = f"has leaves that are not each {{{', '.join(sorted(_LEAF_KEYS))}}}"
        else:
            return table
    raise StorageError(
        f"{where}: its tensor table {problem}; it was staged so by a writer other than "
        "storage.client (or one that wrote past its leaves): put the step again"
    )


def digest(data: Any) -> str:
    """XXH3-128 of a buffer (a flat uint8 array, bytes), as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data.data if hasattr(data, "data") else data)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def whole(leaves: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The leaves of a shard laid out whole, as if put without references: (their metadata with
    fresh offsets and no ``ref`` marks, the bytes they take)."""
    out, offset = [], 0
    for meta in leaves:
        m = {k: v for k, v in meta.items() if k != "r"}
        m["o"] = offset
        out.append(m)
        offset = aligned(offset + int(meta["n"]))
    return out, offset


def table_place(data_nbytes: int, table_nbytes: int) -> tuple[int, int]:
    """(offset of the table, bytes of the whole shard) for a shard whose leaves take
    ``data_nbytes``: the table starts at the next 64-byte boundary."""
    off = -(-data_nbytes // ALIGN) * ALIGN
    return off, off + table_nbytes
