"""What waits, shown (#61, item 4). Two groups (8 virtual hosts): step 1 protected, host3's
daemon stopped (SIGSTOP), every other rank puts step 2. ``ecsnap status`` (text and JSON) lists
step 2 on the other hosts with its state, its age, and that it waits on a round a peer is not
joining; the metrics say one step in flight and how old it is. Once host3 goes on, step 2 is
protected and nothing is in flight."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from bench.harness import Cluster, close_all
from storage import status
from tests.mpi.test_metrics import scrape
from tests.mpi.test_warm import _until


def _metric(c: Cluster, name: str) -> float:
    return scrape(c.root, c.job, "host0")[(name, ())]


def test_a_step_stuck_on_a_stopped_daemon_is_shown_with_its_age_and_cause(
    shm_root: Path,
) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1, extra=["--metrics-port", "0"])
    stores = c.stores(8)
    try:
        state = {r: {"w": torch.full((10_000,), float(r))} for r in range(8)}
        for h in [s.put(1, state[r]) for r, s in enumerate(stores)]:
            assert h.wait(30) == 1
        assert _metric(c, "ecsnap_steps_in_flight") == 0
        pid = c.daemon_pid("host3")
        os.kill(pid, signal.SIGSTOP)
        try:
            # every rank but host3's own (its put would wait on its stopped daemon)
            handles = [s.put(2, state[r]) for r, s in enumerate(stores) if r != 3]
            time.sleep(3.0)
            hosts = {h["host"]: h for h in status.gather(c.job, c.root)}
            [flight] = hosts["host0"]["in_flight"]
            # allocated (an incremental put's alloc waits for the round that keeps its base) or
            # staged: either way here, outside any round
            assert flight["step"] == 2, flight
            assert flight["state"] in ("allocated here", "staged here"), flight
            assert flight["age_s"] >= 2.5, flight
            assert "a round of the storage job" in flight["waiting_on"], flight
            assert "a peer daemon is not joining" in flight["waiting_on"], flight
            text = status.render(c.job, list(hosts.values()))
            assert f"in flight on host0: step 2 {flight['state']} for" in text, text
            assert _metric(c, "ecsnap_steps_in_flight") == 1
            assert _metric(c, "ecsnap_oldest_in_flight_seconds") >= 2.5
        finally:
            os.kill(pid, signal.SIGCONT)
        handles.append(stores[3].put(2, state[3]))
        for h in handles:
            assert h.wait(60) == 2
        _until(
            "nothing in flight",
            lambda: all(not h.get("in_flight") for h in status.gather(c.job, c.root)),
            10,
        )
        assert _metric(c, "ecsnap_oldest_in_flight_seconds") == 0
    finally:
        close_all(stores)
        assert c.stop() == 0


def test_status_shows_the_jobs_parity_and_names_the_hosts_holding_no_data(
    shm_root: Path,
) -> None:
    """#61, item 5: two ranks on 8 virtual hosts (two groups): the other six hosts hold no data,
    and the job's parity is far above m/k; status says both, and what to do."""
    c = Cluster(shm_root, hosts=8, k=3, m=1)
    stores = c.stores(2)  # ranks 0 and 1, on host0 and host1
    try:
        for h in [s.put(1, {"w": torch.full((300_000,), float(r))}) for r, s in enumerate(stores)]:
            assert h.wait(30) == 1
        text = status.render(c.job, status.gather(c.job, c.root))
        line = next(x for x in text.splitlines() if x.startswith("job: parity"))
        ratio = float(line.split()[2].rstrip("x"))
        assert ratio > 0.5 and "(m/k = 0.33)" in line, line
        assert "hosts holding no data: host2, host3, host4, host5, host6, host7" in text, text
        assert "every rank should put its own shard" in text
    finally:
        close_all(stores)
        assert c.stop() == 0
