"""Peers watched outside MPI, for launchers that do not end the job when a daemon dies.

Under Hydra (``mpiexec``, ``mpirun``) a daemon that dies ends the storage job at once: Hydra
kills the others. Under ``srun --mpi=pmi2`` nothing does, and the others' next MPI call that
touches the dead peer crashes inside MPI (a segmentation fault in their round's collective,
with ``health.json`` left saying "healthy": measured on the Slurm lab, ``tests/slurm``).

So, when no Hydra proxy supervises the daemon (none of its variables is set), each daemon
keeps one TCP connection to the next daemon of the job and accepts one from the previous (a
ring: two descriptors a daemon, whatever the job's size). A daemon that dies has both closed by the
kernel, so its two neighbours hear at once. A neighbour then stops this process's MPI calls
(:func:`transport.mpi.halt`), tells the next daemon round the ring which host is gone, and hands
the host's name to ``gone`` (``ecsnap serve``: ``PeerUnreachableError`` naming it for every
waiting trainer and in ``health.json``, then exit 3). A daemon that stops cleanly says ``bye``
first. The connection opens with a token the job drew at start (gathered over MPI), so nothing
else that reaches the port is heard.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Watch", "wanted"]


# what a Hydra proxy sets in the ranks it starts (HYDI_CONTROL_FD only with the fork launcher;
# MPI_LOCALNRANKS with every launcher, ssh and slurm too); Slurm's own PMI sets neither
_HYDRA = ("HYDI_CONTROL_FD", "MPI_LOCALNRANKS")


def wanted(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this daemon needs the watch: no Hydra proxy started it (or ``ECSNAP_WATCH=1``)."""
    forced = environ.get("ECSNAP_WATCH")
    if forced is not None:
        return forced == "1"
    return not any(v in environ for v in _HYDRA)


def _addresses(virtual: bool) -> list[str]:
    """The IPv4 addresses peers may reach this host at: loopback for virtual hosts, else every
    interface's but loopback. No name is looked up: a resolver that does not answer held the
    daemons for seconds before their rounds began (seen on the lab, whose host names no
    resolver knows)."""
    if virtual:
        return ["127.0.0.1"]
    out: list[str] = []
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                raw = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue
            out.append(socket.inet_ntoa(raw[20:24]))
    return [a for a in dict.fromkeys(out) if not a.startswith("127.")] or ["127.0.0.1"]


class Watch:
    """One daemon's place in the ring (module docstring)."""

    def __init__(
        self, name: str, gone: Callable[[str], None], timeout: float, log: Callable[[str], None]
    ) -> None:
        self.name = name
        self.log = log
        self.gone = gone
        self.timeout = timeout
        self.token = b""
        self.prev: socket.socket | None = None  # from the previous daemon
        self.next: socket.socket | None = None  # to the next one
        self.names: dict[socket.socket, str] = {}
        self.leaving: set[str] = set()  # neighbours that said bye
        self.fired = False
        self.lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepted = threading.Event()

    def start(self, links: Any, virtual: bool) -> None:
        """Open the ring (collective over ``links``: every daemon of the job calls it)."""
        lsock = socket.socket()
        lsock.bind(("127.0.0.1" if virtual else "0.0.0.0", 0))
        lsock.listen(8)
        self._listener = lsock
        mine = {
            "host": self.name,
            "addrs": _addresses(virtual),
            "port": lsock.getsockname()[1],
            "token": secrets.token_hex(16),
        }
        parts = links.allgather_json(mine, "the peer watch (addresses)")
        n, me = len(parts), links.rank
        if n < 2:
            lsock.close()
            return
        self.token = str(parts[0]["token"]).encode()
        nxt, prv = parts[(me + 1) % n], parts[(me - 1) % n]
        threading.Thread(
            target=self._accept, args=(str(prv["host"]),), name="ecsnap-watch-accept", daemon=True
        ).start()
        self.next = self._connect(nxt)
        self.names[self.next] = str(nxt["host"])
        if not self._accepted.wait(self.timeout):
            raise TimeoutError(f"the peer watch: {prv['host']} did not connect")
        threading.Thread(target=self._run, name="ecsnap-watch", daemon=True).start()
        self.log(f"peer watch: ring of {n} daemons (to {nxt['host']}, from {prv['host']})")

    def _connect(self, peer: dict[str, Any]) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        last: OSError | None = None
        while time.monotonic() < deadline:
            for addr in peer["addrs"]:
                try:
                    s = socket.create_connection((addr, int(peer["port"])), timeout=2.0)
                except OSError as exc:
                    last = exc
                    continue
                s.settimeout(None)
                s.sendall(self.token + b"\n")
                return s
            time.sleep(0.1)
        raise TimeoutError(
            f"the peer watch: cannot reach {peer['host']} at {peer['addrs']}: {last}"
        )

    def _accept(self, prev_host: str) -> None:
        assert self._listener is not None
        while self.prev is None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.settimeout(5.0)
            try:
                line = conn.recv(len(self.token) + 1)
            except OSError:
                line = b""
            if line != self.token + b"\n":
                conn.close()  # not a daemon of this job
                continue
            conn.settimeout(None)
            self.prev = conn
            self.names[conn] = prev_host
        self._listener.close()
        self._accepted.set()

    def _run(self) -> None:
        socks = [s for s in (self.prev, self.next) if s is not None]
        buffers: dict[socket.socket, bytes] = {s: b"" for s in socks}
        while socks:
            ready, _, _ = select.select(socks, [], [])
            for s in ready:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                who = self.names[s]
                if not data:
                    socks.remove(s)
                    if who not in self.leaving:
                        self._dead(who)
                    continue
                buffers[s] += data
                while b"\n" in buffers[s]:
                    line, buffers[s] = buffers[s].split(b"\n", 1)
                    word, _, rest = line.decode(errors="replace").partition(" ")
                    if word == "bye":
                        self.leaving.add(who)
                    elif word == "dead" and rest:
                        self._dead(rest)

    def _dead(self, host: str) -> None:
        """``host``'s daemon is gone: tell the ring (once), then ``gone``."""
        with self.lock:
            if self.fired:
                return
            self.fired = True
        for s in (self.next, self.prev):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.sendall(f"dead {host}\n".encode())
        self.gone(host)

    def bye(self) -> None:
        """This daemon stops cleanly: its neighbours must not take it for dead."""
        for s in (self.next, self.prev):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.sendall(b"bye\n")
