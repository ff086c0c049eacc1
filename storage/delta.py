"""Snapshots that cost what changed: which leaves of a put are unchanged since the rank's last
protected put, and where their bytes already lie.

A put's leaves are compared with those of the rank's newest protected put (:class:`Kept`). A
leaf is taken for unchanged only when its bytes hash (XXH3-128) to the digest of bytes that a
held shard already stores, with the same kind, dtype and shape; it is then stored as a reference
to that shard (the *base* step): no copy, no encode, no network, no new memory. Everything else
is copied as before.

Version counters only ever say "changed": a CPU tensor whose storage is where it was and whose
``_version`` moved was written in place (an optimizer step, foreach or fused), so it is copied
without hashing. A counter that did not move proves nothing (writes through ``.data``, a numpy
view, another tensor on the same storage, or memory torch does not track leave it alone), so
those leaves are hashed. A fully trained model therefore pays no hashing after its first put; a
frozen one pays one read of its frozen bytes per put, against a copy, an encode and a send.

A leaf found changed at each of the rank's last ``SKIP_AFTER`` puts (hashed, or written in
place) is copied without hashing, but for ``SKIP_AFTER`` puts in a row out of every
``REHASH_EVERY`` (two, so that the second finds the first's digest): a leaf some other path
writes at every step costs a read it cannot save (ZeRO's broadcast of the parameters another
rank updated does not move their counters: the demo's GPT on 4 ranks hashed 3/4 of its
parameters at every put, 8.6 CPU ms a step for nothing). Copying a leaf that did not change is
never wrong; one that stops changing is found unchanged again within ``REHASH_EVERY`` puts
(and referenced, where its shard's base holds it).

One base per shard: the references of a shard all point into one earlier step of the same rank
(the base the group keeps while the shard is kept, see :mod:`storage.catalog`). The base is the
one of two candidates (the last put's own base, or the last put itself) that holds more of the
unchanged bytes; a shard is put whole when that base would hold less than half of its own bytes
in use, so a kept base never wastes more than its own size.

CUDA leaves are always copied (hashing them would need their bytes on the host first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from storage.table import Leaf, aligned, digest

__all__ = ["Kept", "Plan", "digest", "mark", "plan"]

Key = tuple[str, str, tuple[int, ...], str]  # kind, dtype, shape, digest

SKIP_AFTER = 2  # puts in a row a leaf was found changed before it is copied without hashing
REHASH_EVERY = 16  # ... and then hashed at SKIP_AFTER puts in a row out of this many


def mark(leaf: Leaf) -> tuple[int, int] | None:
    """(storage address, version counter) of a CPU tensor leaf; None for anything else."""
    t = leaf.source
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        return t.data_ptr(), t._version
    return None


def key(leaf: Leaf) -> Key | None:
    if leaf.digest is None:
        return None
    return leaf.kind, str(leaf.dtype), tuple(leaf.shape), leaf.digest


@dataclass
class Kept:
    """What a rank's newest protected put holds, for the next put to refer to."""

    step: int
    base: int  # the step whose shard holds this put's referenced leaves (``step``: none)
    in_base: dict[Key, int]  # leaves held in the base's shard: key -> offset there
    base_bytes: int  # bytes of the base's own leaves
    base_table: str  # digest of the base shard's table: the daemon checks it is that shard
    own: dict[Key, int] = field(default_factory=dict)  # leaves this put holds itself (if based)
    own_bytes: int = 0
    own_table: str = ""  # digest of this put's own table
    marks: list[tuple[int, int] | None] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)  # per leaf: puts in a row found changed

    def certain(self, leaves: list[Leaf]) -> int:
        """Bytes of ``leaves`` that a put against this one copies whatever their bytes hash to:
        CUDA ones, those written in place since (their version counter moved), those it copies
        unhashed (:meth:`skips`) and those of a kind, dtype and shape no held leaf has. Known
        before hashing: a lower bound."""
        shapes = {k[:3] for k in self.in_base} | {k[:3] for k in self.own}
        out = 0
        for i, leaf in enumerate(leaves):
            if (
                self.written(i, mark(leaf))
                or self.skips(i)
                or leaf.device != "cpu"
                or (leaf.kind, leaf.dtype, tuple(leaf.shape)) not in shapes
            ):
                out += leaf.nbytes
        return out

    def likely_base(self, maybe: int) -> int | None:
        """The base a put against this one will most likely refer to, if ``maybe`` bytes of it
        may be unchanged: this put's own base, if they could fill half of it (see :func:`plan`).
        Its dry alloc asks the daemons to keep it, so the round that does is off the put's path."""
        return self.base if self.in_base and 2 * maybe >= self.base_bytes else None

    def written(self, i: int, now: tuple[int, int] | None) -> bool:
        """Leaf ``i``, marked ``now``, was written in place since this put: the same storage,
        its version counter moved."""
        was = self.marks[i] if i < len(self.marks) else None
        return was is not None and now is not None and was[0] == now[0] and was[1] != now[1]

    def skips(self, i: int) -> bool:
        """Leaf ``i`` is copied without hashing: found changed at each of the last
        ``SKIP_AFTER`` puts, and this is not one of the puts at which it is hashed again."""
        n = self.changed[i] if i < len(self.changed) else 0
        return n % REHASH_EVERY >= SKIP_AFTER

    def table_of(self, step: int) -> str:
        """The table digest of the candidate base ``step`` (this put's base, or itself)."""
        return self.base_table if step == self.base else self.own_table


@dataclass
class Plan:
    """How one put stores its leaves: ``base`` (None: whole), the bytes of its own leaves, and
    what it refers to."""

    base: int | None
    own_bytes: int
    ref_bytes: int
    hashed_bytes: int
    leaves: list[Leaf]
    marks: list[tuple[int, int] | None]
    changed: list[int] = field(default_factory=list)  # see Kept.changed

    def whole(self) -> None:
        """Store every leaf (the base was refused): no references, the digests already made
        kept for the next put."""
        self.base, self.ref_bytes = None, 0
        self.own_bytes, _ = _lay_out(self.leaves, {})

    def kept(self, step: int, last: Kept | None, table: str) -> Kept:
        """What this put holds once protected (``table``: the digest of its table's bytes)."""
        own = {k: leaf.offset for leaf in self.leaves if not leaf.ref and (k := key(leaf))}
        if self.base is None or last is None:
            return Kept(
                step, step, own, self.own_bytes, table, marks=self.marks, changed=self.changed
            )
        if self.base == last.base:
            in_base, base_bytes = last.in_base, last.base_bytes
        else:
            in_base, base_bytes = last.own, last.own_bytes
        return Kept(
            step,
            self.base,
            in_base,
            base_bytes,
            last.table_of(self.base),
            own,
            self.own_bytes,
            table,
            self.marks,
            self.changed,
        )


def plan(leaves: list[Leaf], last: Kept | None, sources: list[np.ndarray[Any, Any] | None]) -> Plan:
    """Hash what must be hashed, choose the base, lay the leaves out (offsets and ``ref``).

    ``sources[i]`` is leaf i's bytes (a flat uint8 view), or None for a CUDA leaf."""
    marks = [mark(leaf) for leaf in leaves]
    hashed = 0
    for i, leaf in enumerate(leaves):
        src = sources[i]
        if src is None or not leaf.nbytes:
            continue
        if last is not None and (last.written(i, marks[i]) or last.skips(i)):
            continue  # written in place since the last put, or changing at every put: copied
        leaf.digest = digest(src)
        hashed += leaf.nbytes
    base: int | None = None
    refs: dict[Key, int] = {}
    changed = [0] * len(leaves)
    if last is not None:
        candidates = [(last.base, last.in_base, last.base_bytes)]
        if last.step != last.base:
            candidates.append((last.step, last.own, last.own_bytes))
        keys = [key(leaf) for leaf in leaves]
        best = 0
        for step, held, total in candidates:
            found = sum(leaf.nbytes for leaf, k in zip(leaves, keys, strict=True) if k in held)
            if found > best and 2 * found >= total:
                best, base, refs = found, step, held
        for i, k in enumerate(keys):
            if sources[i] is not None and not any(k in held for _, held, _ in candidates):
                changed[i] = (last.changed[i] if i < len(last.changed) else 0) + 1
    own, ref_bytes = _lay_out(leaves, refs)  # (refs stays empty without a base)
    return Plan(base, own, ref_bytes, hashed, leaves, marks, changed)


def _lay_out(leaves: list[Leaf], refs: dict[Key, int]) -> tuple[int, int]:
    """Mark the leaves found in ``refs`` as references (at their offset in the base), lay the
    others out densely; returns (their bytes, the referenced bytes)."""
    offset = ref_bytes = 0
    for leaf in leaves:
        k = key(leaf)
        if leaf.nbytes and k is not None and k in refs:
            leaf.ref, leaf.offset = True, refs[k]
            ref_bytes += leaf.nbytes
        else:
            leaf.ref, leaf.offset = False, offset
            offset = aligned(offset + leaf.nbytes)
    return offset, ref_bytes
