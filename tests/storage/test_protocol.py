"""Requests are checked at the socket, before anything reaches the daemon's rounds."""

from __future__ import annotations

import math

import pytest

from storage import ids
from storage.errors import StorageError
from storage.protocol import MAX_STEP, MAX_WORLD, RequestError, parse_request


def _alloc(**over: object) -> dict[str, object]:
    return {"op": "alloc", "step": 1, "rank": 0, "world_size": 1, "nbytes": 64, **over}


def test_the_largest_step_rank_and_world_size_are_accepted() -> None:
    op, _ = parse_request(_alloc(step=MAX_STEP, rank=MAX_WORLD - 1, world_size=MAX_WORLD))
    assert op == "alloc"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("step", MAX_STEP + 1, f"step must be an int in 0..{MAX_STEP}"),
        ("step", 2**70, f"step must be an int in 0..{MAX_STEP}"),
        ("step", -1, "step must be an int in 0.."),
        ("rank", MAX_WORLD, f"rank must be an int in 0..{MAX_WORLD - 1}"),
        ("world_size", MAX_WORLD + 1, f"world_size must be an int in 1..{MAX_WORLD}"),
        ("world_size", 0, "world_size must be an int in 1.."),
        ("nbytes", MAX_STEP + 1, "nbytes must be an int in 0.."),
    ],
)
def test_numbers_past_what_the_ballot_holds_are_refused_by_name(
    field: str, value: int, says: str
) -> None:
    with pytest.raises(RequestError, match=r"request 'alloc': ") as info:
        parse_request(_alloc(**{field: value}))
    assert says in str(info.value)


@pytest.mark.parametrize("op", ["alloc", "staged", "premap"])
def test_a_rank_not_below_its_world_size_is_refused(op: str) -> None:
    msg = {"step": 1, "nbytes": 64, "table": [0, 0], "buffer": "b", "meta": {}}
    with pytest.raises(RequestError, match=rf"request '{op}': rank 4 is not below world_size 4"):
        parse_request({**msg, "op": op, "rank": 4, "world_size": 4})
    assert parse_request({**msg, "op": op, "rank": 3, "world_size": 4})[0] == op


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_timeout_must_be_a_finite_number_of_seconds(value: float) -> None:
    with pytest.raises(RequestError, match="timeout"):
        parse_request({"op": "wait", "step": 1, "timeout": value})


def test_a_checkpoint_id_past_the_largest_step_names_the_range() -> None:
    assert ids.step_of(f"ckpt/step-{MAX_STEP}") == MAX_STEP
    for bad in (MAX_STEP + 1, f"ckpt/step-{MAX_STEP + 1}", "out/checkpoint-" + "9" * 40):
        with pytest.raises(StorageError, match=r"steps are 0\.\.9223372036854775807"):
            ids.step_of(bad)
