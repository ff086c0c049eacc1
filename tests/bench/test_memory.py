"""``ecsnap bench memory`` measures real daemons: samples through puts, the crash and the
rebuild, and the newest step read back after each."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import memory


def test_the_soak_samples_every_daemon_through_the_crash_and_the_rebuild() -> None:
    args = argparse.Namespace(
        hosts=4,
        k=3,
        m=1,
        keep=2,
        puts=60,
        nbytes=200_000,
        crash_at=55,
        wipe=1,
        every=0.1,
        settle=0.5,
        seed=1,
        progress=0,
    )
    out = memory.run(args)
    phases = {s["phase"] for s in out["samples"]}
    assert {"puts", "rebuild", "puts after", "end"} <= phases, phases
    assert set(out["baseline"]) == {f"host{i}" for i in range(4)}
    assert all(v > 0 for v in out["end"].values()), out["end"]
    assert out["rebuild_peak"] and all(v > 0 for v in out["rebuild_peak"].values())
    assert out["kept_end"] > 0 and out["worst_pool_over_kept"] > 1
    assert not Path(out["root"]).exists(), "the run left its root"
