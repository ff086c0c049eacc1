"""The storage service end to end: real daemons under mpiexec, trainers as separate processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest

import storage
from bench.harness import REPO, Cluster, close_all, make_state, same
from storage import launch
from storage.rounds import IDLE_LONGEST

from ._trainer import trainers


@pytest.mark.parametrize(("k", "m"), [(3, 1), (2, 2)])
def test_round_trip_overlapping_puts_retention(shm_root: Path, k: int, m: int) -> None:
    cluster = Cluster(shm_root, hosts=4, k=k, m=m)
    try:
        results = trainers(cluster, "round_trip", world=8, per_host=2, params={"per_host": 2})
    finally:
        assert cluster.stop() == 0, cluster.log.read_text()
    # what stayed: steps 3 and 4 on every host, with parity in the parity directory
    for h in range(4):
        manifests = sorted(
            p.name for p in (shm_root / cluster.job / f"host{h}" / "steps").iterdir()
        )
        assert manifests == ["3.json", "4.json"], manifests
    sent = [r["info"]["sent_bytes"] for r in results[::2]]
    assert all(s > 0 for s in sent)
    # every line of the daemons' log is one message, whole (from every thread and process)
    lines = cluster.log.read_text().splitlines()
    assert lines and all(
        re.fullmatch(r"ecsnap\[host\d\] [^\n]*", line) and line.count("ecsnap[") == 1
        for line in lines
    ), lines


def test_after_a_put_of_every_host_the_daemons_nap_the_longest_at_once(shm_root: Path) -> None:
    """Once a put of a rank on every host is protected, the daemons' next quiet round naps
    IDLE_LONGEST: the rounds of the next 4 such naps come at their ticks, at most 5, where naps
    doubling from 0.5 ms would have run about 8 in the first IDLE_LONGEST alone. (A slower
    machine runs fewer rounds, never more.)"""
    cluster = Cluster(shm_root, hosts=4, k=3, m=1)
    try:
        stores = cluster.stores(4)
        try:
            for step in (1, 2):
                handles = [
                    s.put(step, make_state(r, step, nbytes=1 << 20, tensors=2))
                    for r, s in enumerate(stores)
                ]
                for h in handles:
                    h.wait(60)
            before = stores[0].info()["rounds"]
            time.sleep(4 * IDLE_LONGEST)
            rounds = stores[0].info()["rounds"] - before
        finally:
            close_all(stores)
    finally:
        assert cluster.stop() == 0
    assert 1 <= rounds <= 5, rounds


def test_partial_step_never_visible(shm_root: Path) -> None:
    cluster = Cluster(shm_root, hosts=4, k=3, m=1)
    try:
        results = trainers(cluster, "partial", world=4, per_host=1, params={})
    finally:
        assert cluster.stop() == 0
    assert all(r["seen"] == [1] for r in results)
    assert {r["state2"] for r in results[::2]} == {"staging"}


def test_capacity_error_loses_nothing(shm_root: Path) -> None:
    cluster = Cluster(shm_root, hosts=2, k=1, m=1, extra=["--memory-budget", "64M"])
    try:
        results = trainers(
            cluster, "capacity", world=2, per_host=1, params={"huge_bytes": 100 << 20}
        )
    finally:
        assert cluster.stop() == 0
    assert "memory-budget" in results[0]["message"]


@pytest.mark.parametrize(("k", "m"), [(3, 1), (2, 2)])
def test_a_host_without_parity_memory_fails_the_step_and_nothing_else(
    shm_root: Path, k: int, m: int
) -> None:
    """host2's pool fails its 4th take (step 2's parity; takes 1-3 are step 1's shard and
    parity and step 2's shard): step 2 fails on every rank with an error that names host2. Step
    1 stays whole and step 3 is protected by the same job."""
    cluster = Cluster(
        shm_root, hosts=4, k=k, m=m, env={"ECSNAP_FAULTS": "enospc@alloc:host=host2:nth=4"}
    )
    try:
        stores = cluster.stores(4)
        states = {
            step: [make_state(r, step, nbytes=3 << 20, tensors=4) for r in range(4)]
            for step in (1, 2, 3)
        }
        for step in (1, 2, 3):
            handles = [s.put(step, st) for s, st in zip(stores, states[step], strict=True)]
            if step != 2:
                assert [h.wait(60) for h in handles] == [step] * 4
                continue
            for h in handles:
                with pytest.raises(storage.CapacityError, match="host host2 had no memory"):
                    h.wait(60)
        for step in (1, 3):
            for r, store in enumerate(stores):
                assert same(store.get(step), states[step][r])
        assert stores[0].steps() == [1, 3]
        for store in stores:
            store.close()
    finally:
        assert cluster.stop() == 0, cluster.log.read_text()
    log = cluster.log.read_text()
    assert "ecsnap[host2] injected fault: enospc@alloc (hit 4)" in log, log
    assert "step 2: no memory for this host's parity" in log, log


def test_bad_input_named_errors(shm_root: Path) -> None:
    cluster = Cluster(shm_root, hosts=2)
    try:
        results = trainers(cluster, "bad_input", world=2, per_host=1, params={})
    finally:
        assert cluster.stop() == 0
    errors = results[0]["errors"]
    assert errors["unsupported"] == "['bad']['inner'][0]"
    assert "step must be an int" in errors["step"]
    assert "not protected" in errors["missing"]
    assert errors["delete_twice"] == "ok"


def test_the_largest_step_is_stored_and_larger_numbers_are_refused_by_the_client(
    shm_root: Path,
) -> None:
    """The ballot holds steps (and their negation) and rank squares in int64 fields: the
    largest step round-trips; a larger step or world size is refused before any request (the
    daemon's own refusal of such frames: test_bad_input)."""
    import torch

    from storage.protocol import MAX_STEP

    cluster = Cluster(shm_root, hosts=3, k=2, m=1)
    try:
        with pytest.raises(storage.StorageError, match="over the 1048576 ranks"):
            storage.connect(cluster.job, rank=0, world_size=2**41, root=shm_root, host="host1")
        with storage.connect(cluster.job, rank=0, world_size=1, root=shm_root, host="host1") as st:
            with pytest.raises(ValueError, match=r"0\.\.9223372036854775807"):
                st.put(MAX_STEP + 1, {"w": torch.ones(4)})
            st.put(MAX_STEP, {"w": torch.arange(4.0)}).wait(60)
            assert st.steps() == [MAX_STEP]
            assert torch.equal(st.get(MAX_STEP)["w"], torch.arange(4.0))
    finally:
        assert cluster.stop() == 0, cluster.log.read_text()


def test_a_store_refuses_a_forked_child_and_serves_its_parent_on(shm_root: Path) -> None:
    """A data loader's worker forked after connect shared the Store's socket: the parent read
    the child's replies (a KeyError for 'steps'), and the child's put never staged (no
    threads of the parent's pool live in a child). The child is told to connect again."""
    import torch

    cluster = Cluster(shm_root, hosts=3, k=2, m=1)
    try:
        with storage.connect(cluster.job, rank=0, world_size=1, root=shm_root, host="host1") as st:
            st.put(1, {"w": torch.ones(4)}).wait(60)
            read, write = os.pipe()
            with warnings.catch_warnings():  # (3.12+ warns of forking a threaded process)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # the child: every use of the parent's Store is refused, by name
                said = b""
                try:
                    st.steps()
                except storage.StorageError as exc:
                    said = str(exc).encode()
                try:
                    st.put(2, {"w": torch.ones(4)})
                except storage.StorageError as exc:
                    said += b"|" + str(exc).encode()
                st.close()  # (leaves the parent's connection alone)
                os.write(write, said)
                os._exit(0)
            os.close(write)
            for _ in range(50):  # while the child runs: every reply is this process's own
                assert st.steps() == [1]
            assert os.waitpid(pid, 0)[1] == 0
            with os.fdopen(read, "rb") as f:
                steps_said, put_said = f.read().decode().split("|")
            for said in (steps_said, put_said):
                assert f"connected in process {os.getpid()}, and this is process {pid}" in said
                assert "storage.connect() again" in said
            st.put(2, {"w": torch.arange(4.0)}).wait(60)
            assert st.steps() == [1, 2] and torch.equal(st.get(2)["w"], torch.arange(4.0))
    finally:
        assert cluster.stop() == 0, cluster.log.read_text()


def test_hosts_that_cannot_form_groups_fail_at_start(shm_root: Path) -> None:
    cmd = launch.serve_command(5, "bad", shm_root, k=3, m=1)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "leave a last group of 1 host(s)" in out.stderr, out.stderr
    assert "--k 4 --m 1" in out.stderr


def test_no_daemon_is_daemon_unavailable(shm_root: Path) -> None:
    with pytest.raises(storage.DaemonUnavailableError) as info:
        storage.connect("nobody", rank=0, world_size=1, host="h", root=shm_root, timeout=0.3)
    assert isinstance(info.value, ConnectionError)
    assert "mpiexec" in str(info.value)


def test_guarded_training_loop_snapshots_the_right_parameters(shm_root: Path) -> None:
    import torch

    cluster = Cluster(shm_root, hosts=2, k=1, m=1)
    try:
        params = {"device": "cuda"} if torch.cuda.is_available() else {}
        results = trainers(cluster, "guarded", world=2, per_host=1, params=params)
    finally:
        assert cluster.stop() == 0
    assert all(r["checked"] == [3, 4] for r in results)


def test_delete_and_protection_are_durable_when_acknowledged(shm_root: Path) -> None:
    """Told "protected" or "deleted", a trainer can rely on it even if every daemon is SIGKILLed
    at that very moment: the relaunched job agrees (found by the stateful test: a deleted step
    came back after a restart)."""
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=["--keep", "8"])
    try:
        for round_ in range(3):
            stores = c.stores(4)
            base = 10 * round_
            for step in (base + 1, base + 2):
                hs = [s.put(step, make_state(r, step)) for r, s in enumerate(stores)]
                for h in hs:
                    h.wait(60)
            stores[0].delete(base + 1)
            os.killpg(c.proc.pid, signal.SIGKILL)  # the moment both were acknowledged
            c.proc.wait()
            for s in stores:
                s.close()
            c = c.relaunch()
            with storage.connect(c.job, rank=0, world_size=4, host="host0", root=shm_root) as s:
                held = s.steps()
            assert base + 1 not in held and base + 2 in held, (round_, held)
    finally:
        assert c.stop() == 0
