"""Which leaves a put may store as references: never a changed one taken for unchanged.

Each test puts a state once (a plan without a base), changes it one way, and plans the next
put against what the first one holds; the planner must copy exactly the leaves whose bytes
changed, whatever path the write took.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from storage import delta
from storage import state as _state


def _plan(state: Any, last: delta.Kept | None) -> delta.Plan:
    _, leaves, _ = _state.flatten(state)
    return delta.plan(leaves, last, [_state.source_bytes(leaf) for leaf in leaves])


def _changed(state: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> set[str]:
    """The keys of ``state`` the second put copies after ``change``."""
    first = _plan(state, None)
    assert first.base is None and first.ref_bytes == 0
    kept = first.kept(1, None, "t1")
    change(state)
    second = _plan(state, kept)
    assert second.base in (None, 1)
    keys = list(state)
    return {k for k, leaf in zip(keys, second.leaves, strict=True) if not leaf.ref}


def _state_of() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(1 << 16, generator=g),
        "b": torch.randn(1 << 16, generator=g),
        "c": torch.randn(1 << 16, generator=g),
        "n": np.arange(1 << 14, dtype=np.float32),
        "frozen": torch.randn(1 << 18, generator=g),  # most of the bytes, never written
    }


def test_nothing_changed_is_all_references() -> None:
    s = _state_of()
    assert _changed(s, lambda s: None) == set()


def test_in_place_op_is_changed_without_hashing() -> None:
    s = _state_of()
    first = _plan(s, None)
    s["a"].add_(1.0)
    second = _plan(s, first.kept(1, None, "t1"))
    assert not second.leaves[0].ref and second.leaves[1].ref
    # the version counter said so: a was not hashed again
    assert second.hashed_bytes == first.hashed_bytes - s["a"].nbytes


def test_write_through_data_is_changed() -> None:
    def change(s: dict[str, Any]) -> None:
        before = s["b"]._version
        s["b"].data[7] = 123.0
        assert s["b"]._version == before  # the counter did not see it

    assert _changed(_state_of(), change) == {"b"}


def test_write_through_numpy_view_is_changed() -> None:
    def change(s: dict[str, Any]) -> None:
        before = s["c"]._version
        s["c"].numpy()[-1] += 1.0
        assert s["c"]._version == before

    assert _changed(_state_of(), change) == {"c"}


def test_write_through_another_tensor_on_the_same_storage_is_changed() -> None:
    def change(s: dict[str, Any]) -> None:
        before = s["a"]._version
        other = torch.empty(0).set_(s["a"].untyped_storage())  # its own version counter
        other[100:200] = 0.5
        assert s["a"]._version == before

    assert _changed(_state_of(), change) == {"a"}


def test_write_to_memory_torch_does_not_track_is_changed() -> None:
    def change(s: dict[str, Any]) -> None:
        before = s["b"]._version
        raw = (ctypes.c_float * 4)(1.0, 2.0, 3.0, 4.0)
        ctypes.memmove(s["b"].data_ptr() + 4096, raw, ctypes.sizeof(raw))
        assert s["b"]._version == before

    assert _changed(_state_of(), change) == {"b"}


def test_numpy_array_changed_in_place_is_changed() -> None:
    def change(s: dict[str, Any]) -> None:
        s["n"][3] = -1.0

    assert _changed(_state_of(), change) == {"n"}


def test_replaced_by_equal_bytes_is_a_reference_and_by_other_bytes_is_not() -> None:
    def change(s: dict[str, Any]) -> None:
        s["a"] = s["a"].clone()  # a new tensor, the same bytes: storing a reference is right
        s["b"] = s["b"].clone()
        s["b"][0] += 1.0
        s["c"] = s["c"].view(torch.int32)  # the same bytes as another dtype: not the same leaf

    assert _changed(_state_of(), change) == {"b", "c"}


def _trained(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
    """One optimizer step on a model whose first layer is frozen: exactly the trained
    parameters and the optimizer's state change, and the planner says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    model[0].requires_grad_(False)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # the optimizer's state exists from now on
    opt.zero_grad()

    def snapshot() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    first = _plan(snapshot(), None)
    kept = first.kept(1, None, "t1")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = snapshot()
    second = _plan(state, kept)
    names = [n for n, _ in model.state_dict().items()]
    copied = {n for n, leaf in zip(names, second.leaves, strict=False) if not leaf.ref}
    assert copied == {"1.weight", "1.bias"}, copied
    # every optimizer tensor (step counts and moments) changed: none may be a reference
    _, leaves, _ = _state.flatten(state)
    assert not any(leaf.ref for leaf in second.leaves[len(names) :])
    assert len(leaves) == len(second.leaves)


def test_foreach_optimizer_step_is_seen() -> None:
    _trained(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))


def test_fused_optimizer_step_is_seen() -> None:
    _trained(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))


def test_a_base_holding_too_little_is_not_used() -> None:
    s = _state_of()
    first = _plan(s, None)
    for k in ("frozen", "a", "b"):
        s[k].add_(1.0)  # most of the bytes changed
    second = _plan(s, first.kept(1, None, "t1"))
    assert second.base is None and not any(leaf.ref for leaf in second.leaves)


def test_references_point_into_the_base_that_holds_the_bytes() -> None:
    s = _state_of()
    first = _plan(s, None)
    k1 = first.kept(1, None, "t1")
    s["n"][0] = 7.0  # step 2 copies n, refers to step 1 for a, b, c
    second = _plan(s, k1)
    assert second.base == 1
    k2 = second.kept(2, k1, "t2")
    s["n"][0] = 8.0  # step 3 again refers to step 1 (it holds the most), at step 1's offsets
    third = _plan(s, k2)
    assert third.base == 1
    offsets = {leaf.offset for leaf in third.leaves if leaf.ref}
    assert offsets == {leaf.offset for i, leaf in enumerate(first.leaves) if i != 3}
    # the digests are 128-bit
    assert all(len(leaf.digest or "") == 32 for leaf in third.leaves)


def _puts(state: dict[str, Any], change: Callable[[int], None], n: int) -> list[delta.Plan]:
    """``n`` puts of ``state``, each after ``change(i)``, each planned against the one before
    (as once every put is protected before the next)."""
    plans: list[delta.Plan] = []
    kept: delta.Kept | None = None
    for i in range(n):
        change(i)
        p = _plan(state, kept)
        kept = p.kept(i + 1, kept, f"t{i + 1}")
        plans.append(p)
    return plans


def test_a_leaf_changing_behind_its_counter_at_every_put_stops_being_hashed() -> None:
    s = _state_of()
    size = s["b"].nbytes

    def change(i: int) -> None:
        s["b"].data[0] = float(i)  # as ZeRO's broadcast: the counter does not move

    plans = _puts(s, change, 2 * delta.REHASH_EVERY + 2)
    hashed_b = [p.hashed_bytes - plans[1].hashed_bytes + size for p in plans[1:]]
    # puts 2 and 3 hash b and find it changed; from then on it is copied unhashed, but for two
    # puts in a row out of every REHASH_EVERY
    skipped = [i for i, h in enumerate(hashed_b, start=2) if h == 0]
    expected = [k for k in range(2, len(plans) + 1) if (k - 2) % delta.REHASH_EVERY >= 2]
    assert skipped == expected and min(skipped) == 2 + delta.SKIP_AFTER
    for p in plans[1:]:  # b is always copied, never taken for unchanged
        assert not p.leaves[1].ref
        assert p.leaves[0].ref and p.leaves[4].ref  # a and frozen are referenced throughout
    assert all(p.leaves[1].digest is None for i, p in enumerate(plans, 1) if i in skipped)


def test_a_leaf_that_stops_changing_is_found_unchanged_again_within_rehash_every_puts() -> None:
    s = _state_of()
    stop = 5

    def change(i: int) -> None:
        if i < stop:
            s["c"].data[0] = float(i)

    plans = _puts(s, change, stop + delta.REHASH_EVERY + 3)
    assert any(p.leaves[2].digest is None for p in plans)  # it was skipped for a while
    found = [i for i, p in enumerate(plans) if i >= stop and p.changed[2] == 0]
    assert found and found[0] <= stop + delta.REHASH_EVERY
    for p in plans[found[0] :]:  # from then on hashed at every put, and found unchanged
        assert p.leaves[2].digest is not None and p.changed[2] == 0


def test_a_skipped_leaf_counts_as_certain_bytes_for_the_dry_alloc() -> None:
    s = _state_of()

    def change(i: int) -> None:
        s["a"].data[0] = float(i)

    plans = _puts(s, change, 4)
    _, leaves, _ = _state.flatten(s)
    kept = plans[-1].kept(4, None, "t4")
    assert kept.skips(0)
    assert kept.certain(leaves) >= s["a"].nbytes
