"""The commit of a step is one decision for the whole job (#55, finding 1): a crash in the middle
of it, with the groups at different points of their local work, never loses a step the trainers
were told is protected. Real daemons on 8 and 12 virtual hosts (two and three groups): one group's
daemons are killed as they commit a step (before writing its manifest) while the other groups
commit it; after a relaunch the job agrees on what it holds, and it holds the step every rank saw
protected (or a newer one), bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import storage
from bench.harness import Cluster, close_all, make_state, same
from tests.mpi.test_warm import _until

PEER_TIMEOUT = 5.0


def _state(rank: int, step: int) -> dict[str, Any]:
    # a frozen part: with incremental puts, every later step refers to the first one's bytes
    return make_state(rank, step, nbytes=60_000, frozen=200_000)


@pytest.mark.parametrize(
    ("hosts", "k", "m", "keep", "incremental"),
    [
        (8, 3, 1, 1, False),  # as measured: step 1 protected, then nothing adopted
        (8, 3, 1, 2, True),  # the same through a base one group had retired
        (12, 2, 2, 1, True),  # three groups, the first one killed
    ],
    ids=["8h-keep1", "8h-keep2-incremental", "12h-keep1-incremental"],
)
def test_a_group_killed_mid_commit_loses_no_acknowledged_step(
    shm_root: Path, hosts: int, k: int, m: int, keep: int, incremental: bool
) -> None:
    group = k + m
    last = keep + 1  # the step whose commit the first group dies in
    faults = ",".join(f"kill@committing:host=host{i}:nth={last}" for i in range(group))
    c = Cluster(
        shm_root,
        hosts=hosts,
        k=k,
        m=m,
        extra=["--keep", str(keep)],
        env={"ECSNAP_FAULTS": faults},
        peer_timeout=PEER_TIMEOUT,
    )
    stores = c.stores(hosts, timeout=10.0, incremental=incremental)
    seen: set[int] = set()  # steps every rank saw protected
    try:
        for step in range(1, last):
            for h in [s.put(step, _state(r, step)) for r, s in enumerate(stores)]:
                assert h.wait(30) == step
            seen.add(step)
        handles = [s.put(last, _state(r, last)) for r, s in enumerate(stores)]
        for h in handles:
            try:
                h.wait(3 * PEER_TIMEOUT)
            except (storage.StorageError, TimeoutError):
                pass
        # the killed group's daemons are gone; the job ends by itself (peer timeout)
        _until("the end of the job whose group was killed", lambda: not c.alive, 60)
    finally:
        close_all(stores)
        c.kill()
    log = c.log.read_text()
    # the fault fired: on every host of the group, or on fewer where mpiexec, seeing the first
    # one die, killed the rest of the job wherever each daemon was (a whole-job SIGKILL)
    assert log.count("injected fault: kill@committing") >= 1, log
    c2 = c.relaunch(env=None)
    stores = c2.stores(hosts, timeout=10.0, incremental=incremental)
    try:
        held = [s.steps() for s in stores]
        assert all(x == held[0] for x in held), f"the ranks disagree on the steps: {held}"
        newest = max(seen)
        assert held[0] and max(held[0]) >= newest, (
            f"step {newest} was protected on every rank, yet after the relaunch the job holds "
            f"{held[0]}\n{c2.log.read_text()[-4000:]}"
        )
        for step in held[0]:
            for r, s in enumerate(stores):
                assert same(s.get(step), _state(r, step)), f"step {step} rank {r}: wrong bytes"
        # the job goes on: a new step is protected and read back
        nxt = last + 1
        for h in [s.put(nxt, _state(r, nxt)) for r, s in enumerate(stores)]:
            assert h.wait(30) == nxt
        for r, s in enumerate(stores):
            assert same(s.get(nxt), _state(r, nxt))
    finally:
        close_all(stores)
        assert c2.stop() == 0
