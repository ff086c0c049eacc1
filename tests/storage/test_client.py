"""The client's connect against sockets without a working daemon behind them (no MPI needed)."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import threading
import warnings
from pathlib import Path

import pytest

import storage
from storage.errors import DaemonUnavailableError


def _hanging_up_server(path: Path) -> tuple[socket.socket, threading.Thread]:
    """Accepts every connection and closes it at once, as a daemon that is dying does."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_a_daemon_that_hangs_up_counts_as_none_and_nothing_leaks(tmp_path: Path) -> None:
    host = tmp_path / "job" / "host0"
    host.mkdir(parents=True, mode=0o700)
    srv, t = _hanging_up_server(host / "ctl.sock")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(DaemonUnavailableError, match=r"no ecsnap daemon .* answered"):
                storage.connect(
                    "job", rank=0, world_size=1, host="host0", root=tmp_path, timeout=0.3
                )
            gc.collect()
        leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert not leaks, [str(w.message) for w in leaks]
    finally:
        srv.close()
        t.join(5)


def test_nobody_listening(tmp_path: Path) -> None:
    host = tmp_path / "job" / "host0"
    host.mkdir(parents=True, mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(host / "ctl.sock"))  # a socket file nobody listens on: a dead daemon's
    stale.close()
    with pytest.raises(DaemonUnavailableError, match="no ecsnap daemon"):
        storage.connect("job", rank=0, world_size=1, host="host0", root=tmp_path, timeout=0.2)


def test_a_daemon_that_ended_is_named_in_the_error(tmp_path: Path) -> None:
    """A host whose ``health.json`` names a process that is gone (its daemon was killed, as
    Hydra kills every daemon of a job when one dies): the error says the storage job is down
    and to launch it again, not to start one as if none had ever run; a live process named
    there gets the usual words."""
    host = tmp_path / "job" / "host0"
    host.mkdir(parents=True, mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(host / "ctl.sock"))
    stale.close()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (host / "health.json").write_text(json.dumps({"pid": dead.pid, "health": "healthy"}))
    with pytest.raises(DaemonUnavailableError) as err:
        storage.connect("job", rank=0, world_size=1, host="host0", root=tmp_path, timeout=0.2)
    text = str(err.value)
    assert f"the daemon that served this host has ended (pid {dead.pid})" in text, text
    assert "Launch it again with the same job name" in text and "start it with" not in text
    (host / "health.json").write_text(json.dumps({"pid": os.getpid(), "health": "healthy"}))
    with pytest.raises(DaemonUnavailableError, match="start it with `mpiexec"):
        storage.connect("job", rank=0, world_size=1, host="host0", root=tmp_path, timeout=0.2)


def test_status_cells_stay_readable_with_many_steps() -> None:
    from storage.status import steps_text

    assert steps_text([]) == "none"
    assert steps_text([3, 4]) == "3, 4"
    assert steps_text(list(range(1, 89))) == "88 (1-88; newest 86, 87, 88)"


def test_rank_and_world_size_come_from_torchrun_mpi_or_slurm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer started by plain `srun python train.py` has only Slurm's variables; torchrun's
    and MPI's come first where they are set (under `srun torchrun`, SLURM_PROCID is the node's)."""
    from storage.client import RANK_VARS, WORLD_VARS, rank_and_world

    for name in (*RANK_VARS, *WORLD_VARS):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(storage.StorageError, match=r"SLURM_PROCID and .*SLURM_NTASKS"):
        rank_and_world(None, None)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert rank_and_world(None, None) == (5, 8)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    assert rank_and_world(None, None) == (3, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rank_and_world(None, None) == (1, 2)
    assert rank_and_world(0, 16) == (0, 16)  # given wins
