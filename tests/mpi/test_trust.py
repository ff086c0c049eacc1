"""Who may talk to whom, by default (#55, finding 11): a root of one's own (per-user default,
its owner and mode checked at start), a client that talks only to a daemon of its own uid and
maps only files under the daemon's directory, and metrics on loopback unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import storage
from storage.config import DEFAULT_ROOT, ServeConfig
from storage.daemon import check_owner
from storage.errors import ConfigError, StorageError
from storage.maps import Maps
from storage.serve import parse_args

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]

# a control socket served by another uid: answers every frame with ok
FAKE = r"""
import json, os, socket, struct, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    try:
        head = c.recv(8)
        (n,) = struct.unpack("<Q", head)
        c.recv(n)
        body = json.dumps({"ok": True, "hosts": ["host0"], "k": 1, "m": 1}).encode()
        c.sendall(struct.pack("<Q", len(body)) + body)
    except OSError:
        pass
"""


def _nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def test_the_default_root_is_the_users_own() -> None:
    import pwd

    assert f"/dev/shm/ecsnap-{pwd.getpwuid(os.getuid()).pw_name}" == DEFAULT_ROOT


def test_metrics_listen_on_loopback_unless_told_otherwise() -> None:
    assert parse_args(["--job", "j"]).metrics_addr == "127.0.0.1"
    assert ServeConfig(job="j").metrics_addr == "127.0.0.1"
    assert parse_args(["--job", "j", "--metrics-host", "0.0.0.0"]).metrics_addr == "0.0.0.0"
    assert parse_args(["--job", "j", "--metrics-addr", "10.0.0.5"]).metrics_addr == "10.0.0.5"


def test_a_root_of_another_user_or_open_to_others_is_refused(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    check_owner(mine)  # fine
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    with pytest.raises(ConfigError, match=r"may be written by others \(mode 777\).*chmod 700"):
        check_owner(open_root)
    if os.geteuid() != 0:
        pytest.fail("making a root of another user needs root: run the tests as root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to this user"):
        check_owner(theirs)


def test_a_daemon_refuses_to_start_under_a_root_it_does_not_own(tmp_path: Path) -> None:
    """End to end: ecsnap serve under a root that another user made first exits 2, saying so,
    and writes nothing there."""
    from storage import launch

    root = tmp_path / "shared"
    root.mkdir(mode=0o755)
    os.chown(root, NOBODY, NOBODY)
    cmd = launch.serve_command(2, "j", root, k=1, m=1)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"belongs to uid {NOBODY}, not to this user" in out.stderr, out.stderr
    assert not any(root.iterdir())


def test_a_client_talks_only_to_a_daemon_of_its_own_uid(shm_root: Path) -> None:
    """A socket where the client looks for its daemon, served by uid 65534: the client refuses
    it at once, whatever it answers, and sends it nothing past the connection."""
    if os.geteuid() != 0:
        pytest.fail("a server of another uid needs root: run the tests as root")
    host = shm_root / "job" / "host0"
    host.mkdir(parents=True, mode=0o700)
    os.chown(host, NOBODY, NOBODY)
    for d in (shm_root, shm_root / "job"):
        d.chmod(0o711)  # nobody may pass through to its own directory
    fake = subprocess.Popen(
        ["/usr/bin/python3", "-c", FAKE, str(host / "ctl.sock")],
        preexec_fn=_nobody,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert fake.stdout is not None
        assert fake.stdout.readline().strip() == "listening", fake.stderr
        t0 = time.monotonic()
        assert issubclass(storage.DaemonUntrustedError, PermissionError)
        with pytest.raises(storage.DaemonUntrustedError, match=f"served by uid {NOBODY}"):
            storage.connect("job", rank=0, world_size=1, host="host0", root=shm_root)
        assert time.monotonic() - t0 < 10  # at once, not after retrying for the timeout
    finally:
        fake.kill()
        fake.communicate()


def test_a_client_maps_only_files_under_the_daemons_directory() -> None:
    maps = Maps("/dev/shm/ecsnap-u/job/host0", "/mnt/seen/host0", lambda a: None)
    assert maps.here("/dev/shm/ecsnap-u/job/host0/data/r0-1") == "/mnt/seen/host0/data/r0-1"
    for bad in (
        "/etc/passwd",
        "/dev/shm/ecsnap-u/job/host0/../host1/data/r0-1",
        "/dev/shm/ecsnap-u/job/host0x/data/r0-1",
        "/dev/shm/ecsnap-u/job/host0",
    ):
        with pytest.raises(StorageError, match="outside its host directory"):
            maps.here(bad)
