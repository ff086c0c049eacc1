"""Hosts that are really apart (network namespaces on a bridge, each its own hostname and
/dev/shm, MPI over TCP only): the recovery playbook, and one network fault of each kind.

These need root (namespaces, veth links, a bridge). Without it they fail, saying so: they are
never skipped silently."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import storage
from bench.harness import REPO, assert_same, make_state
from bench.lab import Lab, LabJob, janitor, stop

PEER_TIMEOUT = 8.0


@pytest.fixture
def lab() -> Iterator[Lab]:
    if os.geteuid() != 0:
        pytest.fail("the lab needs root (network namespaces, veth links, a bridge): run as root")
    janitor()  # what an earlier run, killed, left behind
    made = Lab.up(4, link_gbit=2.0)
    try:
        yield made
    finally:
        made.down()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert made.hosts[0] not in left, left


def _job(lab: Lab, job: str, **kw: Any) -> LabJob:
    return LabJob(lab, job, ["--k", "3", "--m", "1"], peer_timeout=PEER_TIMEOUT, **kw)


def _put(stores: list[storage.Store], step: int, timeout: float = 60) -> None:
    handles = [s.put(step, make_state(r, step)) for r, s in enumerate(stores)]
    for h in handles:
        h.wait(timeout)


def _check(stores: list[storage.Store], steps: list[int], reader: int = 0) -> None:
    for step in steps:
        for r in range(len(stores)):
            assert_same(stores[reader].get(step, rank=r), make_state(r, step))


def _close(stores: list[storage.Store]) -> None:
    for s in stores:
        s.close()


def _wipe(lab: Lab, i: int) -> None:
    """Host i's memory is gone (its /dev/shm emptied): a host loss."""
    for p in lab.shm(i).iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _status(job: LabJob, i: int) -> str:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "storage.cli",
            "status",
            "--job",
            job.job,
            "--root",
            str(job.root(i)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


def test_playbook_on_hosts_that_are_apart(lab: Lab) -> None:
    name = f"lab{uuid.uuid4().hex[:6]}"
    job = _job(lab, name)
    stores = job.stores(4)
    try:
        before = lab.link_bytes()
        sent0 = [s.info()["sent_bytes"] for s in stores]
        _put(stores, 1)
        _put(stores, 2)
        after = lab.link_bytes()
        # what each daemon sent crossed its host's link (plus the rounds, headers and MPI's own)
        for i, s in enumerate(stores):
            payload = s.info()["sent_bytes"] - sent0[i]
            wire = after[i]["from_host"] - before[i]["from_host"]
            assert payload > 0 and payload <= wire <= 1.2 * payload + (4 << 20), (i, payload, wire)
        _check(stores, [1, 2], reader=1)  # every rank read from another host
        # a trainer crash: a new process reads from its own host's memory, moving nothing
        moved = [s.info()["sent_bytes"] + s.info()["received_bytes"] for s in stores]
        [fresh] = job.stores(1)
        assert_same(fresh.get(2), make_state(0, 2))
        fresh.close()
        assert [s.info()["sent_bytes"] + s.info()["received_bytes"] for s in stores] == moved
        # the daemons die (every host's processes) and are relaunched: they adopt
        _close(stores)
        job.kill()
        job = _job(lab, name)
        stores = job.stores(4)
        _check(stores, [1, 2])
        # one host lost whole, rebuilt from its group; then another of the group
        for lost in (1, 2):
            held = stores[lost].info()
            lost_bytes = held["data_bytes"] + held["parity_bytes"]
            _close(stores)
            job.kill()
            _wipe(lab, lost)
            link0 = lab.link_bytes()
            job = _job(lab, name)
            stores = job.stores(4)
            deadline = time.monotonic() + 60
            while stores[lost].info()["health"] != "healthy":
                assert time.monotonic() < deadline, stores[lost].info()
                time.sleep(0.1)
            # the chain repair: about one copy of what was lost crosses the replacement's link
            # (a decode at the replacement would take k = 3 copies)
            into = lab.link_bytes()[lost]["to_host"] - link0[lost]["to_host"]
            assert lost_bytes < into < 2 * lost_bytes, (into, lost_bytes)
            _check(stores, [1, 2], reader=lost)
            info = stores[lost].info()
            assert info["stats"]["rebuilt_chunks"] > 0 and info["stats"]["missing_chunks"] > 0
        # a corrupted chunk, found by a read, repaired from the group
        here = job.root(3) / name / lab.hosts[3]
        manifest = json.loads((here / "steps" / "2.json").read_text())
        [shard] = [sh for sh in manifest["shards"] if sh["rank"] == 3]
        f = here / "data" / shard["buffer"]
        raw = bytearray(f.read_bytes())
        raw[4096 + 7] ^= 0x5A
        f.write_bytes(bytes(raw))
        _check(stores, [2], reader=3)
        assert stores[3].info()["stats"]["checksum_failures"] >= 1
        # more than m=1 hosts of the group lost: a clear error naming them, no wrong bytes
        _close(stores)
        job.kill()
        _wipe(lab, 0)
        _wipe(lab, 3)
        job = _job(lab, name)
        stores = job.stores(4)
        with pytest.raises(storage.SnapshotUnrecoverableError) as info:
            stores[1].get(2, rank=0)
        assert sorted(info.value.lost_hosts) == [lab.hosts[0], lab.hosts[3]]
    finally:
        _close(stores)
        job.stop()


def test_network_faults_link_down_slow_link_and_a_stopped_daemon(lab: Lab) -> None:
    name = f"net{uuid.uuid4().hex[:6]}"
    job = _job(lab, name)
    stores = job.stores(4)
    try:
        _put(stores, 1)
        # (c) a link slowed to 1/100 of its rate during a put: the put completes, slower
        lab.rate(1, 0.02)
        _put(stores, 2, timeout=PEER_TIMEOUT * 3)
        lab.rate(1, 2.0)
        # (d) a daemon stopped (alive, silent) and continued within the peer timeout: a put
        # waits for it and completes; the job carries on
        pid = job.daemon_pid(2)
        assert stop(pid), job.processes(2)
        with ThreadPoolExecutor(4) as pool:  # rank 2's put waits for its daemon's answer
            puts = [pool.submit(s.put, 3, make_state(r, 3)) for r, s in enumerate(stores)]
            time.sleep(PEER_TIMEOUT / 3)
            assert not puts[2].done()
            handles = [p.result() for p in puts if p.done()]
            assert not any(h.protected.done() for h in handles)
            os.kill(pid, signal.SIGCONT)
            for p in puts:
                assert p.result(PEER_TIMEOUT).wait(PEER_TIMEOUT * 3) == 3
        # a daemon stopped for longer than the store's timeout fails the call, it does not hang
        slow = storage.connect(
            name, rank=2, world_size=4, host=lab.hosts[2], root=job.root(2), timeout=2.0
        )
        try:
            assert stop(pid), job.processes(2)
            t0 = time.monotonic()
            with pytest.raises(storage.DaemonUnavailableError, match="did not answer"):
                slow.steps()
            assert time.monotonic() - t0 < 4.0
            os.kill(pid, signal.SIGCONT)
            assert 3 in slow.steps()  # the next call reconnects
        finally:
            slow.close()
        _check(stores, [2, 3])
        # (a) a host's link down during a put's exchange: the put fails, naming the host; the
        # storage job exits (MPI cannot lose a rank and go on), and a relaunch recovers
        lab.link(1, "down")
        t0 = time.monotonic()
        handles = [s.put(4, make_state(r, 4)) for r, s in enumerate(stores)]
        errors = []
        for h in handles:
            with pytest.raises(storage.StorageError) as info:
                h.wait(PEER_TIMEOUT * 4)
            errors.append(info.value)
        assert time.monotonic() - t0 < PEER_TIMEOUT * 4  # no call hung past its timeout
        named = [e for r, e in enumerate(errors) if r != 1]
        assert all(isinstance(e, storage.PeerUnreachableError) for e in named), errors
        assert all(e.hosts == [lab.hosts[1]] for e in named), [str(e) for e in errors]
        for i in (0, 2, 3):  # the daemons that saw it went down by themselves
            assert job.gone(i, PEER_TIMEOUT * 2), (i, job.processes(i), job.log.read_text())
        text = _status(job, 0)
        assert f"UNREACHABLE: {lab.hosts[1]}" in text, text
        _close(stores)
        job.kill()
        lab.link(1, "up")
        job = _job(lab, name)
        stores = job.stores(4)
        _check(stores, [2, 3])  # nothing protected was lost or changed
        assert 4 not in stores[0].steps()
        # (b) a link down during a rebuild (held open by a 3 s delay of host0's first bulk
        # send): the relaunch cannot finish it and goes down; with the link back, the next
        # relaunch rebuilds
        _close(stores)
        job.kill()
        _wipe(lab, 2)
        spec = {"ECSNAP_FAULTS": f"delay@send:host={lab.hosts[0]}:nth=1:seconds=3"}
        job = _job(lab, name, env=spec, ready=False)
        assert job.logged("adoption: rebuilding step", 60), job.log.read_text()
        assert job.logged("injected fault: delay@send", 30), job.log.read_text()  # it fired
        lab.link(3, "down")
        assert job.gone(0, PEER_TIMEOUT * 4), job.log.read_text()[-3000:]
        job.kill()
        lab.link(3, "up")
        job = _job(lab, name)
        stores = job.stores(4)
        _check(stores, [2, 3], reader=2)
    finally:
        _close(stores)
        job.stop()


def _lab_in(ids: str) -> bool:
    return ids in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_the_janitor_leaves_a_lab_in_use_alone_and_nothing_leaves_for_a_lab_address() -> None:
    """#59, item 6: a lab another live run made, or one from `ecsnap lab up` with a process
    running in a host, is never removed by another run's janitor; once its owner is gone (or
    nothing runs in it) it is. A lab's subnet is unreachable but through its bridge."""
    if os.geteuid() != 0:
        pytest.fail("the lab needs root (network namespaces, veth links, a bridge): run as root")
    code = (
        "import sys, time\nfrom bench.lab import Lab\nlab = Lab.up(2)\n"
        "print(lab.id, lab.hosts[0], lab.subnet, lab.addrs[0], flush=True)\ntime.sleep(120)\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    made: Lab | None = None
    try:
        assert other.stdout is not None
        lab_id, ns, subnet = other.stdout.readline().split()[:3]
        janitor()
        assert _lab_in(ns), "the janitor removed a lab whose owner runs"
        routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout
        assert f"unreachable {subnet}" in routes, routes
        other.kill()
        other.wait()
        assert lab_id in " ".join(janitor())
        assert not _lab_in(ns)
        routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout
        assert subnet not in routes, routes
        # made from the command line (no owner): in use while a process runs in a host
        made = Lab.up(2, owned=False)
        sleeper = subprocess.Popen(["ip", "netns", "exec", made.hosts[1], "sleep", "120"])
        try:
            time.sleep(0.5)
            janitor()
            assert _lab_in(made.hosts[0]), "the janitor removed a lab a process runs in"
            # its bridge gone: an address of the lab is unreachable, never routed elsewhere
            subprocess.run(["ip", "link", "del", made.bridge], check=True)
            got = subprocess.run(
                ["ip", "route", "get", made.addrs[0]], capture_output=True, text=True
            )
            said = (got.stdout + got.stderr).lower()
            assert got.returncode != 0 or "unreachable" in said, got  # EHOSTUNREACH
            assert "unreachable" in said or "no route to host" in said, got
        finally:
            sleeper.kill()
            sleeper.wait()
        janitor()
        assert not _lab_in(made.hosts[0])
        made = None
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()
        if other.stdout is not None:
            other.stdout.close()
        if made is not None:
            made.down()
        janitor()
