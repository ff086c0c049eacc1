"""The control socket's server: an accept loop that outlives running out of descriptors, and
dies loudly on anything else."""

from __future__ import annotations

import errno
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from transport import control


class FailingAccepts:
    """The listening socket, whose next ``fail`` accepts raise ``OSError(code)`` (then it
    accepts for real): the kernel's answer when a process is out of descriptors."""

    def __init__(self, sock: socket.socket, code: int, fail: int) -> None:
        self.sock, self.code, self.left = sock, code, fail
        self.fired = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.left:
            self.left -= 1
            self.fired += 1
            raise OSError(self.code, "injected")
        return self.sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ecsnap-test-ctl-") as d:
        yield Path(d) / "ctl.sock"


def _echo(message: dict[str, Any], conn: control.Connection) -> dict[str, Any]:
    return {"ok": True, "echo": message}


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM])
def test_the_accept_loop_backs_off_and_serves_again(sock_path: Path, code: int) -> None:
    lines: list[str] = []
    fatal: list[BaseException] = []
    server = control.Server(sock_path, _echo, log=lines.append, on_fatal=fatal.append)
    faulty = FailingAccepts(server.sock, code, fail=8)
    server.sock = faulty  # type: ignore[assignment]
    server.start()
    try:
        t0 = time.monotonic()
        conn = control.connect(sock_path, timeout=30)  # waits in the backlog meanwhile
        try:
            assert conn.request({"op": "x"}) == {"ok": True, "echo": {"op": "x"}}
        finally:
            conn.close()
        waited = time.monotonic() - t0
    finally:
        server.close()
    name = errno.errorcode[code]
    assert faulty.fired == 8  # the fault fired, every time
    assert server.accept_errors == {name: 8}
    assert not fatal
    # told once for the burst, and once when it was over; backed off 5+10+...+640 ms
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"accept: {name}") and "5 ms" in lines[0]
    assert lines[1].startswith("accept: serving again after 8 failed accept(s)")
    assert waited >= 0.005 * (2**8 - 1) * 0.9


def test_the_back_off_stops_doubling_at_a_second(sock_path: Path) -> None:
    naps: list[float] = []
    server = control.Server(sock_path, _echo)
    server.sock = FailingAccepts(server.sock, errno.EMFILE, fail=12)  # type: ignore[assignment]
    wait = server._closed.wait

    def nap(timeout: float | None = None) -> bool:
        naps.append(timeout or 0.0)
        return wait(0)

    server._closed.wait = nap  # type: ignore[method-assign]
    server.start()
    try:
        conn = control.connect(sock_path, timeout=30)
        try:
            assert conn.request({"op": "y"})
        finally:
            conn.close()
    finally:
        server.close()
    assert naps == [min(0.005 * 2**i, 1.0) for i in range(12)]


def test_any_other_accept_failure_ends_the_loop_loudly(sock_path: Path) -> None:
    """EBADF is no passing shortage: the loop ends and says so (the daemon then goes down),
    instead of leaving a process that accepts nobody."""
    fatal: list[BaseException] = []
    done = threading.Event()

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        done.set()

    server = control.Server(sock_path, _echo, on_fatal=on_fatal)
    server.sock = FailingAccepts(server.sock, errno.EBADF, fail=1)  # type: ignore[assignment]
    server.start()
    try:
        assert done.wait(10)
        assert isinstance(fatal[0], OSError) and fatal[0].errno == errno.EBADF
        assert not server._thread.is_alive() or server._thread.join(5) is None
        assert not server._thread.is_alive()
    finally:
        server.close()
