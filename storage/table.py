"""A shard's tensor table: its leaves (dtype, shape, offset, size) and its skeleton, stored as JSON
in the shard's own bytes after the leaves, and where it lies there.

No torch here: the daemon reads tables (for ``structure``, the persistent tier) without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIGN", "Leaf", "pack_table", "table_place"]

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
        )


def pack_table(skeleton: Any, leaves: list[dict[str, Any]]) -> bytes:
    """A shard's tensor table: its skeleton and every leaf's dtype, shape and offset, as JSON.
    It is stored in the shard's own bytes, after the leaves (see :func:`table_place`)."""
    return json.dumps({"skeleton": skeleton, "leaves": leaves}, separators=(",", ":")).encode()


def table_place(data_nbytes: int, table_nbytes: int) -> tuple[int, int]:
    """(offset of the table, bytes of the whole shard) for a shard whose leaves take
    ``data_nbytes``: the table starts at the next 64-byte boundary."""
    off = -(-data_nbytes // ALIGN) * ALIGN
    return off, off + table_nbytes
