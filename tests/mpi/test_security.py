"""Local security: state files 0600 and directories 0700; the control socket refuses another
uid at three layers (the host directory, the socket file, SO_PEERCRED), tested with a real second
uid; metrics carry counters, never state-dict names or bytes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import urllib.request
from pathlib import Path

import pytest

from bench.harness import Cluster

from ._trainer import trainers

NOBODY = 65534
PROBE = r"""
import json, socket, struct, sys
path = sys.argv[1]
out = {}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
except OSError as exc:
    out["connect"] = type(exc).__name__
else:
    out["connect"] = "ok"
    body = json.dumps({"op": "steps"}).encode()
    try:
        s.sendall(struct.pack(sys.argv[2], len(body)) + body)
        out["reply"] = s.recv(4096).decode(errors="replace")
    except OSError as exc:
        out["reply_error"] = type(exc).__name__
print(json.dumps(out))
"""


def _as_nobody(sock: Path, header: str) -> dict[str, str]:
    """Run the probe as uid/gid 65534 with the system Python (ecsnap's venv may be unreadable)."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    out = subprocess.run(
        ["/usr/bin/python3", "-c", PROBE, str(sock), header],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, str] = json.loads(out.stdout)
    return result


def test_modes_and_a_second_uid_is_refused(shm_root: Path) -> None:
    from transport.control import _HEADER

    c = Cluster(shm_root, hosts=4, k=3, m=1, extra=["--metrics-port", "0"])
    try:
        trainers(c, "put", world=4, per_host=1, params={"steps": [1, 2]})
        job_dir = shm_root / c.job
        for path in [job_dir, *job_dir.rglob("*")]:
            mode = stat.S_IMODE(path.lstat().st_mode)
            if path.is_dir():
                assert mode == 0o700, (path, oct(mode))
            elif path.is_file() or path.is_socket():
                assert mode == 0o600, (path, oct(mode))
            assert path.lstat().st_uid == os.getuid(), path
        # metrics: counters and host names, nothing from the state dicts
        port = int((job_dir / "host0" / "metrics.port").read_text())
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        for name in (b"model", b"weight", b"optim", b"rng"):  # keys of the states put
            assert name not in body, name
        if os.getuid() != 0:
            pytest.skip("switching to a second uid needs root")
        sock = job_dir / "host0" / "ctl.sock"
        header = _HEADER.format
        # 1: the host directory (0700) keeps other users from reaching the socket at all
        assert _as_nobody(sock, header)["connect"] == "PermissionError"
        # 2: with the directories opened up, the socket file itself (0600) refuses them
        opened = [shm_root, job_dir, job_dir / "host0"]
        for d in opened:
            os.chmod(d, 0o711)
        assert _as_nobody(sock, header)["connect"] == "PermissionError"
        # 3: with the socket opened up too, the daemon checks SO_PEERCRED and hangs up
        os.chmod(sock, 0o666)
        got = _as_nobody(sock, header)
        assert got["connect"] == "ok" and got.get("reply", "") == "", got
        os.chmod(sock, 0o600)
        for d in opened:
            os.chmod(d, 0o700)
        # the job's own user is still served
        res = trainers(c, "check", world=4, per_host=1, params={"steps": [2]})
        assert all(r["errors"] == {} for r in res)
    finally:
        assert c.stop() == 0
