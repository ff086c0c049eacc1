"""The control socket between trainers and their host's daemon: framed JSON over a Unix socket.

A frame is an 8-byte little-endian length followed by that many bytes of UTF-8 JSON. Nothing is
ever unpickled. The server accepts only peers of its own uid (``SO_PEERCRED``). Bulk bytes never
travel here: they go through shared memory.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transport.errors import ProtocolError

__all__ = ["Connection", "Server", "connect", "peer_uid"]

MAX_FRAME = 256 << 20
_HEADER = struct.Struct("<Q")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class Connection:
    """One framed-JSON connection. ``request`` is send-then-receive; not for concurrent use."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed the connection."""
        header = self._read(_HEADER.size)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME} byte limit")
        body = self._read(length)
        if body is None:
            raise ProtocolError("connection closed in the middle of a frame")
        try:
            message = json.loads(body)
        except ValueError as exc:
            raise ProtocolError(f"frame is not JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise ProtocolError("frame is not a JSON object")
        return message

    def request(self, message: dict[str, Any]) -> dict[str, Any] | None:
        with self._lock:
            self.send(message)
            return self.recv()

    def _read(self, n: int) -> bytes | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            r = self.sock.recv_into(view[got:])
            if r == 0:
                if got == 0:
                    return None
                raise ProtocolError("connection closed in the middle of a frame")
            got += r
        return bytes(buf)

    def shutdown(self) -> None:
        """Wake a thread blocked on this connection: its recv returns as if the peer closed."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(path: str | os.PathLike[str], timeout: float | None = None) -> Connection:
    """Connect to the socket at ``path``; ``OSError`` if nobody listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except OSError:
        sock.close()
        raise
    return Connection(sock)


Handler = Callable[[dict[str, Any], Connection], dict[str, Any] | None]

# accept(2) failures that pass: out of descriptors (this process's or the system's), or of
# kernel memory. Go's net/http server treats them as temporary the same way: it sleeps from
# 5 ms, doubling up to 1 s, and accepts again.
TEMPORARY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_FIRST = 0.005
BACKOFF_LONGEST = 1.0


class Server:
    """Serves ``handler(message, connection) -> reply`` on a Unix socket, a thread per client.

    A stale socket file left by a dead daemon is replaced; a live one (somebody answers) is an
    error, so two daemons never serve one host directory.

    The accept loop outlives what passes: an accept that fails with one of :data:`TEMPORARY`
    is counted in ``accept_errors`` (by errno name), told to ``log`` once per burst of them, and
    tried again after a back-off (:data:`BACKOFF_FIRST` doubling up to :data:`BACKOFF_LONGEST`);
    the clients queued meanwhile wait in the listen backlog. Any other failure of the loop ends
    it and is handed to ``on_fatal`` (the daemon then goes down loudly), never swallowed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Handler,
        on_close: Callable[[Connection], None] | None = None,
        *,
        log: Callable[[str], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.handler = handler
        self.on_close = on_close
        self.log = log
        self.on_fatal = on_fatal
        self.accept_errors: dict[str, int] = {}  # errno name -> accepts that failed so
        if self.path.exists():
            try:
                connect(self.path, timeout=1.0).close()
            except OSError:
                self.path.unlink()  # stale: nobody listens
            else:
                raise OSError(f"a live daemon already serves {self.path}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(os.fspath(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.sock.listen(128)
        self._uid = os.getuid()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ecsnap-ctl", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _accept(self) -> None:
        try:
            self._accept_loop()
        except BaseException as exc:
            if self._closed.is_set():
                return  # closing: the listening socket went away under accept
            if self.on_fatal is None:
                raise
            self.on_fatal(exc)

    def _accept_loop(self) -> None:
        delay = 0.0  # the back-off now; 0 outside a burst of temporary failures
        burst, since = 0, 0.0
        while not self._closed.is_set():
            try:
                sock, _ = self.sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                if exc.errno not in TEMPORARY:
                    raise
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                self.accept_errors[name] = self.accept_errors.get(name, 0) + 1
                if not burst:
                    since = time.monotonic()
                    self._say(
                        f"accept: {name} ({os.strerror(exc.errno or 0)}); trying again from "
                        f"{BACKOFF_FIRST * 1000:.0f} ms, doubling up to {BACKOFF_LONGEST:.0f} s"
                    )
                burst += 1
                delay = min(max(delay * 2, BACKOFF_FIRST), BACKOFF_LONGEST)
                self._closed.wait(delay)
                continue
            if burst:
                self._say(
                    f"accept: serving again after {burst} failed accept(s) in "
                    f"{time.monotonic() - since:.2f} s"
                )
                delay, burst = 0.0, 0
            try:
                trusted = peer_uid(sock) == self._uid
            except OSError:
                trusted = False  # the client is gone already
            if not trusted:
                sock.close()  # another local user: not trusted
                continue
            conn = Connection(sock)
            try:
                threading.Thread(
                    target=self._serve, args=(conn,), daemon=True, name="ecsnap-client"
                ).start()
            except RuntimeError:  # no thread to be had (a limit on tasks): as EMFILE above
                conn.close()
                self.accept_errors["threads"] = self.accept_errors.get("threads", 0) + 1
                self._closed.wait(BACKOFF_FIRST)

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    message = conn.recv()
                except (ProtocolError, OSError):
                    return
                if message is None:
                    return
                reply = self.handler(message, conn)
                if reply is not None:
                    conn.send(reply)
        except OSError:
            return
        finally:
            if self.on_close is not None:
                self.on_close(conn)
            conn.close()

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
