"""Fault specs: parsing, counting hits, and firing once."""

from __future__ import annotations

import pytest

from transport import faults


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


def test_hit_fires_once_on_the_nth_matching_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "FAULTS", faults.parse("drop@send:host=h1:peer=2:nth=2"))
    assert faults.hit("send", "h0", 2) is None  # another host: not counted
    assert faults.hit("send", "h1", 3) is None  # another peer: not counted
    assert faults.hit("send", "h1", 2) is None  # first hit
    assert faults.hit("send", "h1", 2) == "drop"  # second: fires
    assert faults.hit("send", "h1", 2) is None  # once only


def test_delay_sleeps_and_returns_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(faults, "FAULTS", faults.parse("delay@send:seconds=0.25"))
    assert faults.hit("send", "h", 0) is None and slept == [0.25]
