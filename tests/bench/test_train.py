"""Parts of ``ecsnap bench train`` (the run itself is too big for CI: ``ecsnap bench train
--quick``): what idle daemons cost, and training ranks that never outlive their run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import Cluster
from bench.train import WORLD, daemons_cpu


def test_the_idle_daemons_cpu_is_read_from_every_host_and_grows(shm_root: Path) -> None:
    cluster = Cluster(shm_root, hosts=WORLD, k=3, m=1, job="train")
    try:
        first = daemons_cpu(cluster)
        time.sleep(1.0)  # idle rounds, every host's
        second = daemons_cpu(cluster)
        # every daemon has run its start-up and rounds: CPU time, counted once per host
        assert 0 < first < second
    finally:
        assert cluster.stop(60) == 0


def _running(module: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in cmd:
                pids.append(int(entry.name))
    return pids


def test_a_failed_rank_fails_the_run_and_leaves_no_rank_running() -> None:
    from bench.harness import gloo_ranks

    module = "tests.bench._gloo_worker"
    assert gloo_ranks(module, {}, 1, "one rank", timeout=60)[0]["rank"] == 0
    with pytest.raises(RuntimeError, match=r"a training rank failed \(3\) in three ranks"):
        gloo_ranks(module, {}, 3, "three ranks", timeout=60)
    assert _running(module) == []  # rank 2, a minute from its end, was killed


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port a listening socket holds: what took the port between its pick and rank 0's bind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def test_ranks_whose_port_was_taken_are_launched_again_on_another(
    taken_port: int, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from bench import harness

    module = "tests.bench._gloo_store_worker"
    picks = iter([taken_port])
    real = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda: next(picks, None) or real())
    out = harness.gloo_ranks(module, {}, 2, "two ranks", timeout=120)
    err = capfd.readouterr().err
    # the fault fired: rank 0's own TCPStore could not listen on the taken port
    assert "EADDRINUSE" in err or "address already in use" in err
    assert f"two ranks: port {taken_port} was taken: launching the ranks again" in err
    assert [r["rank"] for r in out] == [0, 1]
    assert out[0]["port"] == out[1]["port"] != taken_port
    assert out[0]["pids"] == out[1]["pids"]  # both joined the same store
    assert _running(module) == []


def test_ranks_that_find_their_port_taken_each_time_fail_the_run(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import harness

    module = "tests.bench._gloo_store_worker"
    monkeypatch.setattr(harness, "free_port", lambda: taken_port)
    with pytest.raises(RuntimeError, match=r"found their port taken 3 times"):
        harness.gloo_ranks(module, {}, 2, "two ranks", timeout=120)
    assert _running(module) == []
