"""Bad input, each a named error and nothing lost: odd names, a stale socket from a dead daemon,
relaunching with another k/m or chunk size than the files were written with, two daemons
claiming one host, a client of another job, malformed and truncated files under the root."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import storage
from bench.harness import REPO, Cluster
from bench.lab import process_state
from storage import launch
from transport import control

from ._trainer import trainers


def _serve(root: Path, job: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a storage job that is expected to refuse to start; return how it ended."""
    cmd = launch.serve_command(4, job, root, extra=["--peer-timeout", "20", *args])
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_odd_names_are_refused_by_name(shm_root: Path) -> None:
    for bad in ("a/b", "../up", "x" * 65, "sp ace", ".hidden", "-dash"):
        with pytest.raises(storage.ConfigError, match="not allowed"):
            storage.connect(bad, rank=0, world_size=1, host="h", root=shm_root, timeout=0.2)
        with pytest.raises(storage.ConfigError, match="not allowed"):
            storage.connect("job", rank=0, world_size=1, host=bad, root=shm_root)
    for rank, world in ((-1, 2), (2, 2), (0, 0)):
        with pytest.raises(storage.StorageError, match="rank"):
            storage.connect("job", rank=rank, world_size=world, host="h", root=shm_root)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "storage.cli",
            "serve",
            "--job",
            "no/slash",
            "--root",
            str(shm_root),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "not allowed" in out.stderr, out.stderr
    out = _serve(shm_root, "vh", "--virtual-hosts", "host0,host 1,host2,host3")
    assert out.returncode != 0 and "not allowed" in out.stderr, out.stderr


def test_a_shard_staged_past_its_buffer_is_refused_and_the_job_serves_on(shm_root: Path) -> None:
    """A ``staged`` whose nbytes ran past the buffer ``alloc`` gave was taken: its chunks lay
    past the file's end, the group's exchange hung on them, and after the peer timeout the
    storage job went down."""
    import torch

    cluster = Cluster(shm_root, hosts=3, k=2, m=1)
    try:
        sock = control.connect(shm_root / cluster.job / "host1" / "ctl.sock")
        try:
            hello = sock.request({"op": "hello", "job": cluster.job, "rank": 0})
            assert hello is not None and hello["ok"], hello
            put = {"step": 5, "rank": 0, "world_size": 1}
            alloc = sock.request({"op": "alloc", "nbytes": 64, **put})
            assert alloc is not None and alloc["ok"], alloc
            staged = {"op": "staged", "buffer": alloc["buffer"], "table": [0, 8], **put}
            reply = sock.request({**staged, "nbytes": 10**9})
            assert reply is not None and not reply["ok"], reply
            assert f"nbytes 1000000000 is more than the {alloc['size']} bytes" in reply["message"]
            # the put is still allocated: it can be given up (or staged as it really is)
            reply = sock.request({"op": "abort", "step": 5, "rank": 0})
            assert reply is not None and reply["ok"], reply
        finally:
            sock.close()
        with storage.connect(cluster.job, rank=0, world_size=1, host="host1", root=shm_root) as st:
            st.put(5, {"w": torch.arange(8.0)}).wait(60)
            assert torch.equal(st.get(5)["w"], torch.arange(8.0))
    finally:
        assert cluster.stop() == 0, cluster.log.read_text()


def test_a_relaunch_without_chunk_bytes_takes_the_chunk_its_files_were_written_with(
    shm_root: Path,
) -> None:
    # the default chunk differs between virtual hosts and a network, and changed for networks:
    # a job relaunched with the arguments it was started with (none for the chunk) must adopt
    # its steps, not refuse them; a chunk given explicitly must still match (the test below)
    import torch

    w = torch.arange(300_000.0)
    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=["--chunk-bytes", "65536"])
    try:
        with storage.connect(c.job, rank=0, world_size=1, host="host0", root=shm_root) as st:
            st.put(1, {"w": w}).wait(60)
    finally:
        assert c.stop() == 0, c.log.read_text()
    again = c.relaunch(extra=[])  # 4 MiB chunks by default between virtual hosts
    try:
        sock = control.connect(shm_root / c.job / "host0" / "ctl.sock")
        reply = sock.request({"op": "hello", "job": c.job, "rank": 0})
        sock.close()
        assert reply is not None and reply["chunk_bytes"] == 65536, reply
        with storage.connect(c.job, rank=0, world_size=1, host="host0", root=shm_root) as st:
            assert st.steps() == [1]
            assert torch.equal(st.get(1)["w"], w)
            st.put(2, {"w": w + 1}).wait(60)
            assert torch.equal(st.get(2)["w"], w + 1)
    finally:
        assert again.stop() == 0, again.log.read_text()


def test_relaunch_mismatch_claims_other_job_stale_socket_and_junk(shm_root: Path) -> None:
    c = Cluster(shm_root, hosts=4, k=3, m=1)
    job = c.job
    pids = [c.daemon_pid(f"host{i}") for i in range(4)]
    try:
        trainers(c, "put", world=4, per_host=1, params={"steps": [1, 2]})
        # a client of another job, at this job's socket: refused by name
        with storage.connect(job, rank=0, world_size=4, host="host0", root=shm_root) as ok:
            assert ok.steps() == [1, 2]
        sock = control.connect(shm_root / job / "host0" / "ctl.sock")
        reply = sock.request({"op": "hello", "job": "someone-else", "rank": 0})
        assert reply is not None and not reply["ok"] and "serves job" in reply["message"]
        # frames that break the protocol: each refused by name, and the daemon serves on
        for frame, says in (
            ({"op": "alloc", "step": -1, "rank": 0, "world_size": 4, "nbytes": 1}, "step must"),
            ({"op": "alloc", "step": 1, "rank": 0, "world_size": 0, "nbytes": 1}, "in 1.."),
            # past what the ballot's int64 fields hold: a rank of 2**40 reached the rounds (they
            # sum each rank's square) and killed the job; a step of 2**70 hung its put
            (
                {"op": "alloc", "step": 1, "rank": 2**40, "world_size": 2**41, "nbytes": 1},
                "rank must be an int in 0..1048575",
            ),
            (
                {"op": "alloc", "step": 2**70, "rank": 0, "world_size": 4, "nbytes": 1},
                "step must be an int in 0..9223372036854775807",
            ),
            ({"op": "wait", "step": 1, "timeout": math.nan}, "timeout must be"),
            ({"op": "get"}, "lacks 'rank'"),
            ({"op": "unlease", "buffers": [3]}, "buffers must be"),
            ({"op": "zap"}, "unknown request 'zap'"),
            ([1, 2], "not a JSON object"),
        ):
            if isinstance(frame, dict):
                reply = sock.request(frame)
                assert reply is not None and not reply["ok"], (frame, reply)
                assert reply["error"] == "StorageError" and says in reply["message"], reply
            else:  # not an object at all: the daemon drops the connection, nothing else
                sock.send(frame)  # type: ignore[arg-type]
                assert sock.recv() is None
                sock.close()
                sock = control.connect(shm_root / job / "host0" / "ctl.sock")
        reply = sock.request({"op": "steps"})
        assert reply is not None and reply["ok"] and reply["steps"] == [1, 2]
        sock.close()
    finally:
        os.killpg(c.proc.pid, signal.SIGKILL)  # the sockets stay behind, stale
        c.proc.wait()
    # mpiexec reaped is not every daemon gone: one still dying can accept a connection
    deadline = time.monotonic() + 30
    while any(process_state(p) not in (None, "Z") for p in pids):
        assert time.monotonic() < deadline, "the SIGKILLed daemons are still there"
        time.sleep(0.05)
    # a stale socket: nobody listens; a client says so within its timeout
    assert (shm_root / job / "host0" / "ctl.sock").exists()
    with pytest.raises(storage.DaemonUnavailableError, match="no ecsnap daemon"):
        storage.connect(job, rank=0, world_size=4, host="host0", root=shm_root, timeout=0.5)
    # relaunching with other parameters than the files were written with: refused, files kept
    for args in (
        ["--virtual-hosts", "--k", "2", "--m", "2"],
        ["--virtual-hosts", "--k", "3", "--m", "1", "--chunk-bytes", "65536"],
    ):
        out = _serve(shm_root, job, *args)
        assert out.returncode != 0, out.stderr
        assert "Relaunch with the same arguments" in out.stderr, out.stderr
    # two daemons claiming one host directory: named twice, or one machine running two
    twice = "host0,host1,host1,host3"
    out = _serve(shm_root, job, "--virtual-hosts", twice, "--k", "3", "--m", "1")
    assert out.returncode != 0 and "names a host twice: " + twice in out.stderr, out.stderr
    same_machine = [
        launch.mpiexec(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "storage.cli",
        "serve",
        "--job",
        job,
        "--root",
        str(shm_root),
        "--peer-timeout",
        "20",
    ]
    out = subprocess.run(same_machine, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "two daemons claim host" in out.stderr, out.stderr
    # junk under the root: a malformed manifest, a stray truncated data file, garbage health
    host1 = shm_root / job / "host1"
    (host1 / "steps" / "9.json").write_text("{not json")
    (host1 / "steps" / "notes.txt").write_text("hello")
    (host1 / "data" / "r9-123-4").write_bytes(b"\0" * 100)
    (host1 / "health.json").write_text("garbage")
    c = Cluster(shm_root, hosts=4, k=3, m=1, job=job)
    try:
        res = trainers(c, "check", world=4, per_host=1, params={"steps": [1, 2]})
        assert all(r["errors"] == {} and r["steps"] == [1, 2] for r in res), res
        assert not (host1 / "data" / "r9-123-4").exists()  # not state: swept
    finally:
        assert c.stop() == 0
