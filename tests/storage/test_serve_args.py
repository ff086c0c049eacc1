"""``ecsnap serve``'s options: sizes with units, and values that name what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import REPO
from storage.config import CHUNK_BYTES, NET_CHUNK_BYTES
from storage.errors import ConfigError
from storage.serve import parse_args


def test_sizes_take_bytes_or_binary_units() -> None:
    cfg = parse_args(["--job", "j", "--reserve", "1.5GiB", "--memory-budget", "2g"])
    assert cfg.reserve == int(1.5 * (1 << 30)) and cfg.memory_budget == 2 << 30
    assert parse_args(["--job", "j", "--reserve", "1500000000"]).reserve == 1_500_000_000


@pytest.mark.parametrize("size", ["1XB", "infG", "nanM", "", "G"])
def test_a_size_that_is_no_size_says_what_is_accepted(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--job", "j", "--reserve", size])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --reserve: {size!r} is no size" in err and "512M, 1.5GiB" in err, err


@pytest.mark.parametrize("seconds", ["nan", "inf", "0", "-1"])
def test_the_peer_timeout_is_a_positive_number_of_seconds(seconds: str) -> None:
    with pytest.raises(ConfigError, match="--peer-timeout must be a positive number of seconds"):
        parse_args(["--job", "j", "--peer-timeout", seconds])


def test_the_chunk_defaults_to_the_transports_and_an_explicit_one_stays() -> None:
    # over a network a smaller chunk: RS(2,2) puts with 4 MiB chunks were a quarter slower there;
    # 0 says none was given (a relaunch then takes what its files were written with)
    net, virtual = parse_args(["--job", "j"]), parse_args(["--job", "j", "--virtual-hosts"])
    assert (net.chunk_bytes, net.largest_chunk) == (0, NET_CHUNK_BYTES)
    assert (virtual.chunk_bytes, virtual.largest_chunk) == (0, CHUNK_BYTES)
    given = parse_args(["--job", "j", "--virtual-hosts", "--chunk-bytes", "1M"])
    assert (given.chunk_bytes, given.largest_chunk) == (1 << 20, 1 << 20)
    assert parse_args(["--job", "j", "--chunk-bytes", "8M"]).largest_chunk == 8 << 20
    with pytest.raises(ConfigError, match=r"--chunk-bytes must be in 4 KiB\.\.1 GiB"):
        parse_args(["--job", "j", "--chunk-bytes", "1K"])


def test_a_world_of_one_under_srun_names_the_missing_pmi() -> None:
    from storage.serve import launch_check

    assert launch_check(4, {"SLURM_STEP_NUM_TASKS": "4"}) is None
    assert launch_check(1, {}) is None  # a world of 1 alone: placement says it needs 2 hosts
    assert launch_check(1, {"SLURM_NTASKS": "1", "PMI_SIZE": "1"}) is None
    why = launch_check(1, {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "32"})
    assert why is not None and "srun gave the daemons no PMI" in why and "4 tasks" in why
    assert "SLURM_OVERLAP=1 mpirun -ppn 1 -n $SLURM_NNODES" in why
    why = launch_check(1, {"PMI_SIZE": "3"})
    assert why is not None and "3 processes" in why and "mpiexec" in why


def test_serve_started_by_srun_without_pmi_exits_2_saying_why(tmp_path: Path) -> None:
    """The real process, as srun --mpi=none starts it: an MPI world of 1 (a singleton) with
    Slurm's variables saying the step has 4 tasks."""
    env = dict(os.environ, SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4", SLURM_PROCID="2")
    for var in ("PMI_SIZE", "PMI_RANK", "PMI_FD", "PMI_PORT"):
        env.pop(var, None)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    out = subprocess.run(
        [sys.executable, "-m", "storage.cli", "serve", "--job", "j", "--root", str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 2, out
    assert "srun gave the daemons no PMI" in out.stderr, out.stderr
    assert list(root.iterdir()) == []  # nothing made
