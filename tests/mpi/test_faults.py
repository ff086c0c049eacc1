"""The fault matrix in short mode: every virtual-host fault once, randomized, the invariants
checked (``ecsnap bench faults --trials N`` runs it in full; the network faults, one of each
kind, run in ``tests/lab``)."""

from __future__ import annotations

import os

from bench.faults import FAULTS, run_matrix


def test_fault_matrix_short() -> None:
    seed = int(os.environ.get("ECSNAP_FAULT_SEED", "1"))
    assert run_matrix(trials=1, seed=seed, only=FAULTS, record=False) == 0


def test_group_and_job_crashes_at_every_phase_on_two_groups() -> None:
    """One group's daemons, then the whole job's, killed at each phase of a round (staging,
    encoding, sending, committing, retiring) on 8 virtual hosts; every step a rank saw
    protected (or a newer one) reads back bit-exact after the relaunch."""
    from bench.faults import GROUP_FAULTS

    seed = int(os.environ.get("ECSNAP_FAULT_SEED", "1"))
    assert run_matrix(trials=1, seed=seed, only=GROUP_FAULTS, record=False, hosts=8) == 0
