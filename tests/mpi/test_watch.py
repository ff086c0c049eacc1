"""The peer watch (storage.watch) on virtual hosts: forced on (``ECSNAP_WATCH=1``) under Hydra,
it opens its ring, stays quiet through puts and a clean stop (every daemon says bye), and
exits 0. Its other half, a dead daemon heard at once and named, runs under srun in
tests/slurm (Hydra kills the others itself, first)."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.harness import Cluster, close_all
from storage import watch


def test_who_needs_the_watch() -> None:
    assert watch.wanted({"PMI_FD": "3", "SLURM_STEP_ID": "1"})  # srun --mpi=pmi2
    assert not watch.wanted({"HYDI_CONTROL_FD": "7", "PMI_FD": "9"})  # a Hydra proxy's child
    assert not watch.wanted({"MPI_LOCALNRANKS": "1", "PMI_FD": "9"})  # Hydra's ssh launcher
    assert watch.wanted({"HYDI_CONTROL_FD": "7", "ECSNAP_WATCH": "1"})
    assert not watch.wanted({"ECSNAP_WATCH": "0"})


def test_the_ring_is_quiet_through_puts_and_a_clean_stop(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=8, k=3, m=1, env={"ECSNAP_WATCH": "1"})
    stores = c.stores(8)
    try:
        for step in (1, 2):
            for h in [
                s.put(step, {"w": torch.full((1000,), float(r))}) for r, s in enumerate(stores)
            ]:
                assert h.wait(30) == step
        assert all(s.info()["health"] == "healthy" for s in stores)
        assert c.log.read_text().count("peer watch: ring of 8 daemons") == 8  # it was on
    finally:
        close_all(stores)
        assert c.stop() == 0
    assert "is gone" not in c.log.read_text()
