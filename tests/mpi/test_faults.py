"""The fault matrix in short mode: every virtual-host fault once, randomized, the invariants
checked (``ecsnap bench faults --trials N`` runs it in full; the network faults, one of each
kind, run in ``tests/lab``)."""

from __future__ import annotations

import os

from bench.faults import FAULTS, run_matrix


def test_fault_matrix_short() -> None:
    seed = int(os.environ.get("ECSNAP_FAULT_SEED", "1"))
    assert run_matrix(trials=1, seed=seed, only=FAULTS, record=False) == 0
