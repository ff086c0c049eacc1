"""Fault specs: parsing, counting hits, and firing once."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from storage import faults
from storage.errors import CapacityError
from storage.pool import Pool


def test_parse_options_and_defaults() -> None:
    fs = faults.parse("kill@encoding:host=host2:nth=3, drop@send:peer=1 ,enospc@alloc")
    assert [(f.kind, f.point, f.host, f.peer, f.nth) for f in fs] == [
        ("kill", "encoding", "host2", None, 3),
        ("drop", "send", None, 1, 1),
        ("enospc", "alloc", None, None, 1),
    ]
    assert faults.parse(None) == [] and faults.parse(" , ") == []


@pytest.mark.parametrize(
    "spec",
    [
        "explode@send",
        "drop@encoding",
        "kill@nowhere",
        "kill@staging:nth=0",
        "delay@send:x=1",
        "kill@staging:nth=two",
    ],
)
def test_bad_specs_are_named(spec: str) -> None:
    with pytest.raises(faults.FaultSpecError, match="fault"):
        faults.parse(spec)


def test_hit_fires_once_on_the_nth_matching_hit() -> None:
    hooks = faults.Hooks.from_spec("drop@send:host=h1:peer=2:nth=2")
    assert hooks.hit("send", "h0", 2) is None  # another host: not counted
    assert hooks.hit("send", "h1", 3) is None  # another peer: not counted
    assert hooks.hit("send", "h1", 2) is None  # first hit
    assert hooks.hit("send", "h1", 2) == "drop"  # second: fires
    assert hooks.hit("send", "h1", 2) is None  # once only


def test_delay_sleeps_and_returns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    hooks = faults.Hooks.from_spec("delay@send:seconds=0.25")
    assert hooks.hit("send", "h", 0) is None and slept == [0.25]


def test_no_faults_hand_out_the_real_parts(tmp_path: Path) -> None:
    hooks = faults.Hooks.from_spec(None)
    assert not hooks and type(hooks.make_pool(tmp_path, None)) is Pool
    hooks.phase("encoding", "h")  # a no-op


def test_an_enospc_fault_fails_the_nth_take_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    pool = faults.Hooks.from_spec("enospc@alloc:host=" + tmp_path.name + ":nth=2").make_pool(
        tmp_path, None
    )
    assert isinstance(pool, faults.FaultyPool)
    first = pool.take(4096, "r0-")
    with pytest.raises(CapacityError, match="injected fault") as info:
        pool.take(4096, "r0-")
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    third = pool.take(4096, "r0-")  # fired once: the pool works again
    assert first.name != third.name and pool.used == 2 * 4096
