"""A daemon that outlives any training run: real daemons under low descriptor limits.

Its descriptors do not grow with the steps it keeps or the sizes it has seen (mappings hold
none), its soft limit is raised to the hard one at start, its accept loop outlives running out
of descriptors for real (``prlimit`` on the live daemon), a round engine that fails ends the
daemon loudly instead of leaving it half-alive, and ``ecsnap status`` tells a daemon that does
not answer from one that is gone. On 4 hosts (one group) and 8 (two groups).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from bench.harness import Cluster, close_all
from storage import status
from transport import control

from .test_warm import _until


def _state(rank: int, step: int) -> dict[str, Any]:
    """A small state whose size differs at every step (and rank): 4-12 kB."""
    n = 4096 + (step * 37 + rank * 11) % 8192
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"w": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g), "step": step}


def _steady(rank: int, step: int) -> dict[str, Any]:
    """A state of the same size at every step: each put takes a file made ahead."""
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"w": torch.randint(0, 255, (8192,), dtype=torch.uint8, generator=g), "step": step}


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def _soft_limit(soft: int) -> Iterator[None]:
    """This process's soft descriptor limit (which mpiexec and the daemons inherit) at ``soft``
    while the job starts."""
    was = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, was[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, was)


def _daemons(c: Cluster) -> dict[str, str]:
    return {h["host"]: h["daemon"] for h in status.gather(c.job, c.root)}


def test_a_long_run_under_a_soft_limit_of_256_keeps_its_descriptors_flat(shm_root: Path) -> None:
    """--keep 1000 and 300 steps of sizes that differ at every step, on two groups (8 virtual
    hosts): before, each kept or made file held a descriptor and the daemons ran out within 70
    steps under a limit of 1,024. (One group, 4 hosts, ran the same before; `ecsnap bench
    descriptors` runs either, longer.)"""
    hosts = 8
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with _soft_limit(256):
        c = Cluster(shm_root, hosts=hosts, extra=["--keep", "1000"])
    stores: list[storage.Store] = []
    try:
        log = c.log.read_text()
        raised = re.findall(r"descriptors: soft limit raised from (\d+) to (\d+)", log)
        assert len(raised) == hosts and all(r == ("256", str(hard)) for r in raised), log
        stores = c.stores(hosts)
        pids = [c.daemon_pid(n) for n in c.host_names]
        steps = 300
        counts: list[list[int]] = []
        for step in range(1, steps + 1):
            handles = [s.put(step, _state(r, step)) for r, s in enumerate(stores)]
            for h in handles:
                assert h.wait(60) == step
            if step in (10, 100, steps):
                counts.append([_fds(p) for p in pids])
        for s in stores:
            assert s.steps() == list(range(1, steps + 1))
        for step in range(1, steps + 1):  # every step, every rank, bit for bit
            for r, s in enumerate(stores):
                got, want = s.get(step), _state(r, step)
                assert got["step"] == step and torch.equal(got["w"], want["w"]), (step, r)
        # descriptors depend on connections and peers: flat from 10 steps kept to 300
        first, *_, last = counts
        assert all(b <= a + 8 for a, b in zip(first, last, strict=True)), counts
        assert max(last) < 128, counts
        files = sum(1 for _ in (shm_root / c.job / "host0" / "data").iterdir())
        assert files >= steps  # the steps are kept as files, each mapped by the daemon
        assert set(_daemons(c).values()) == {"up"}
    finally:
        close_all(stores)
        assert c.stop() == 0


def _log_has(c: Cluster, text: str) -> Callable[[], bool]:
    return lambda: text in c.log.read_text()


def test_the_accept_loop_outlives_running_out_of_descriptors(shm_root: Path) -> None:
    """host0's daemon is given a limit just above what it holds (prlimit on the live process);
    clients that connect then wait in the backlog while accept fails with EMFILE, and are
    served once descriptors are there again. Two groups (8 hosts)."""
    c = Cluster(shm_root, hosts=8, k=3, m=1)
    stores: list[storage.Store] = []
    extra: list[control.Connection] = []
    try:
        stores = c.stores(8)
        for h in [s.put(1, _state(r, 1)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 1
        pid = c.daemon_pid("host0")
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_fds(pid) + 2, hard))
        try:
            sock = shm_root / c.job / "host0" / "ctl.sock"
            for _ in range(6):  # 2 accepted, the rest queued while accept fails
                extra.append(control.connect(sock, timeout=30))
            _until("an EMFILE on accept", _log_has(c, "accept: EMFILE"))
            time.sleep(1.0)  # accepts failing meanwhile, backing off: 5, 10, 20... ms
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        _until("accepting again", _log_has(c, "accept: serving again after"))
        for conn in extra:  # every queued client is served
            assert conn.request({"op": "hello", "job": c.job, "rank": 0})["ok"]
        # the fault fired, and every failure was counted; each burst of them was told once,
        # and its end once (a descriptor the daemon let go meanwhile can split a burst in two)
        log = c.log.read_text()
        bursts = log.count("accept: EMFILE")
        assert 1 <= bursts == log.count("accept: serving again after"), log
        errors = stores[0].info()["accept_errors"]
        assert errors.get("EMFILE", 0) >= bursts + 3, (errors, bursts)
        for h in [s.put(2, _state(r, 2)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 2
        for r, s in enumerate(stores):
            assert torch.equal(s.get(2)["w"], _state(r, 2)["w"])
        assert set(_daemons(c).values()) == {"up"}
    finally:
        for conn in extra:
            conn.close()
        close_all(stores)
        assert c.stop() == 0


def test_a_round_engine_out_of_descriptors_ends_the_daemon_loudly(shm_root: Path) -> None:
    """host1 is left no descriptor to write step 2's manifest with (the case that left a daemon
    running, answering nobody, its health file saying healthy): now its log and health.json
    say why, it exits 4 and MPI ends the job; status calls it gone, failed."""
    c = Cluster(shm_root, hosts=8, k=3, m=1, peer_timeout=20)
    stores: list[storage.Store] = []
    try:
        stores = c.stores(8)
        for h in [s.put(1, _steady(r, 1)) for r, s in enumerate(stores)]:
            assert h.wait(60) == 1
        # step 2's files made ahead: its staging opens nothing, its manifest must
        _until(
            "host1's files for step 2",
            lambda: stores[1].info()["stats"]["warm_files"] >= 2,
        )
        pid = c.daemon_pid("host1")
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_fds(pid), hard))
        handles = [s.put(2, _steady(r, 2)) for r, s in enumerate(stores)]
        for h in handles:
            with pytest.raises(storage.StorageError):
                h.wait(60)
        try:
            c.proc.wait(120)  # the whole storage job ends, not just host1
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job lived on:\n{c.log.read_text()}") from None
        assert c.proc.returncode != 0
        log = c.log.read_text()
        assert re.search(r"ecsnap\[host1\] the round engine failed: OSError: \[Errno 24\]", log), (
            log
        )
        assert "the daemon goes down (exit 4)" in log
        health = json.loads((shm_root / c.job / "host1" / "health.json").read_text())
        assert health["health"] == "failed" and "Errno 24" in health["reason"]
        hosts = {h["host"]: h for h in status.gather(c.job, c.root)}
        assert hosts["host1"]["daemon"] == "gone" and hosts["host1"]["health"] == "failed"
    finally:
        close_all(stores)
        c.kill()


def test_status_tells_a_daemon_that_does_not_answer_from_one_that_is_gone(
    shm_root: Path,
) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1)
    try:
        assert set(_daemons(c).values()) == {"up"}
        pid = c.daemon_pid("host5")
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            hosts = {h["host"]: h for h in status.gather(c.job, c.root)}
            assert time.monotonic() - t0 < 10  # asked in parallel, 2 s each at most
            assert hosts["host5"]["daemon"] == "not answering", hosts["host5"]
            assert "did not answer" in hosts["host5"]["silent"]
            assert {h["daemon"] for n, h in hosts.items() if n != "host5"} == {"up"}
            text = status.render(c.job, list(hosts.values()))
            assert "not answering" in text and "host5: its daemon process runs" in text
        finally:
            os.kill(pid, signal.SIGCONT)
        _until("host5 answering again", lambda: _daemons(c)["host5"] == "up")
    finally:
        assert c.stop() == 0
    assert set(_daemons(c).values()) == {"gone"}
