"""One host's storage daemon: its modules wired together, started, run and closed.

Call sequence (every daemon of the job runs the same, in lock-step rounds)::

    mpiexec -n H ecsnap serve --job J [--virtual-hosts] [--k K --m M] ...     (storage.serve)

    Daemon(config, comm, hooks)   who this daemon is (storage.host): name, groups, pool, links
    start()                       host names gathered; adoption (storage.adoption) claims a slot,
                                  agrees on manifests, checks every chunk, rebuilds what was lost;
                                  then the socket service and /metrics start serving
    run()                         the round engine (storage.rounds) until a daemon is stopped
    close()

Threads: the main thread drives MPI (the round engine and everything it calls); one thread per
trainer connection answers requests (storage.service); a checksum thread (storage.exchange) and
the persistent tier's writer (storage.tier); the warmer, making shared memory ahead of need in
idle time (storage.warm). Trainers talk to the daemon over
``<root>/<job>/<host>/ctl.sock`` (framed JSON) and write shard bytes straight into its shared
memory.

Slots, not machines: the layout has H slots; MPI rank r serves slot ``slot_of_rank[r]``, the one
whose files its host holds (or one nobody holds). The storage job is one failure domain: a dead
peer makes the mpich job die or hang, so every wait on a peer has a timeout after which this
daemon aborts the job. State stays in the host directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any

from storage import adoption
from storage.config import ServeConfig
from storage.errors import ConfigError
from storage.exchange import Exchange
from storage.faults import Hooks
from storage.fetch import Fetcher
from storage.health import snapshot
from storage.host import Host
from storage.leases import Leases
from storage.metrics import Endpoint, ProcessMetrics, SnapshotCollector
from storage.protocol import Snapshot
from storage.repair import Repairer
from storage.rounds import Rounds
from storage.service import Service
from storage.tier import Tier
from storage.warm import Warmer
from transport import shm
from transport.control import Server
from transport.mpi import single_copy_off

__all__ = ["Daemon"]


def _unlink_mpi_segments() -> None:
    """Unlink the /dev/shm files MPICH made at MPI_Init, once every local rank has them mapped
    (after the first collective): mappings outlive names, and a SIGKILLed storage job then
    leaves nothing behind (it left one 4 MB ``mpich_shm_*`` file per job, measured)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith("/dev/shm/mpich_shm_"):
            try:
                os.unlink(path)
            except OSError:
                pass  # another local rank was first


def check_owner(root: Path) -> None:
    """Refuse a root that another user owns, or that others may write to: whoever owns it (or
    may write there) could pose as this job's daemons, or read the trainers' state. Raises
    :class:`ConfigError` saying what is wrong and what to do."""
    st = os.stat(root)
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"the root {root} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
            "another user made it first; give a root of your own (--root or ECSNAP_ROOT)"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"the root {root} may be written by others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"`chmod 700 {root}`, or give a root of your own (--root or ECSNAP_ROOT)"
        )


def _memory_kind(path: Path) -> str:
    """What the ready line says of the memory under ``path``: huge pages or not (on a tmpfs)."""
    huge = shm.huge_pages(path)
    if huge is None:
        return ""
    if huge in ("always", "within_size"):
        return f", shared memory on a tmpfs with huge={huge}"
    # never, or advise: huge pages only where a mapping asks for them, which ours do not
    return (
        f", shared memory on a tmpfs without huge pages (huge={huge}; transfers cost more: "
        'README, "Huge pages for shared memory")'
    )


def _write_atomic(path: Path, body: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)


class Daemon:
    """One host's daemon. ``run()`` is the MPI engine; trainers are served on other threads."""

    def __init__(self, config: ServeConfig, comm: Any, hooks: Hooks | None = None) -> None:
        self.host = h = Host(config, comm, hooks or Hooks())
        self.leases = Leases(h)
        self.exchange = Exchange(h)
        self.repairer = Repairer(h)
        self.fetcher = Fetcher(h)
        self.tier = Tier(h, self.leases)
        self.rounds = Rounds(h, self.exchange, self.repairer, self.fetcher, self.tier, self.leases)
        self.endpoint = Endpoint(h.latency.registry)
        self.service = Service(
            h, self.leases, self.tier, self.fetcher, self.repairer, self.snapshot
        )
        h.latency.registry.register(SnapshotCollector(self.snapshot))
        # the process's own: resident memory, CPU, open_fds against max_fds (an alert at 80 %)
        h.latency.registry.register(ProcessMetrics(config.job, h.name))
        self.server: Server | None = None
        self.warmer = Warmer(h, config.reserve, first=self.exchange.warm)
        self.service.warmer = self.warmer
        self._lock_fd: int | None = None  # daemon.lock, held for the daemon's life

    def snapshot(self) -> Snapshot:
        errors = self.server.accept_errors if self.server is not None else {}
        return snapshot(self.host, self.tier, self.endpoint.port, errors)

    def _lock_host_dir(self) -> None:
        """Hold ``daemon.lock`` in the host directory for this daemon's life (``flock``, let go
        by the kernel when the process ends, however it ends), before anything under it is
        touched: a second launch of a live job (a duplicated launch line, a relaunch that fires
        early) is refused here instead of wiping ``tmp/`` and sweeping the live job's files.
        Raises :class:`ConfigError` naming the live daemon."""
        h = self.host
        Path(h.config.root).mkdir(mode=0o700, parents=True, exist_ok=True)
        check_owner(Path(h.config.root))
        for d in (h.dir.parent, h.dir):
            d.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(h.dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                pid = json.loads((h.dir / "health.json").read_text()).get("pid")
            except (OSError, ValueError, AttributeError):
                pid = None
            who = f" (pid {pid})" if pid else ""
            raise ConfigError(
                f"{h.dir} is served by a live daemon{who} of job {h.config.job}: a second launch "
                "would break the live job; stop the running one first (SIGTERM to its mpiexec), "
                "or launch with another --job or --root"
            ) from None
        self._lock_fd = fd

    def _prepare_dirs(self) -> None:
        h = self.host
        job_dir = h.dir.parent
        Path(h.config.root).mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (job_dir, h.dir, *(h.dir / s for s in ("data", "parity", "steps", "tmp"))):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
        for f in (h.dir / "tmp").iterdir():
            f.unlink()

    def start(self) -> None:
        h = self.host
        hosts_by_rank = h.links.allgather_json(h.name, "host names")
        _unlink_mpi_segments()  # every local rank is past MPI_Init: they all have them mapped
        dupes = sorted({n for n in hosts_by_rank if hosts_by_rank.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"two daemons claim host {', '.join(dupes)} (one host directory each); run one "
                "daemon per host, or --virtual-hosts to test on one machine"
            )
        self._lock_host_dir()  # before anything under the host directory is touched
        self._prepare_dirs()
        h.measure_memory_limit()
        if h.config.virtual_hosts is not None and h.rank == 0:
            # trainers on this machine map rank r to virtual host r % H (storage.client)
            _write_atomic(h.dir.parent / "virtual-hosts.json", {"hosts": hosts_by_rank})
        h.write_health()
        adoption.adopt(h, self.repairer, self.tier, hosts_by_rank)
        self.warmer.start()  # after adoption, which sweeps the files it does not know
        self.server = Server(
            h.dir / "ctl.sock",
            self.service.handle,
            on_close=self.service.closed,
            log=h.log,
            on_fatal=lambda exc: h.fail("the control socket's accept loop", exc),
        )
        self.server.start()
        config = h.config
        if config.metrics_port is not None:
            port = config.metrics_port
            if port and config.virtual_hosts is not None:
                port += h.rank
            try:
                self.endpoint.serve(port, config.metrics_addr, h.dir / "metrics.port")
            except OSError as exc:
                raise ConfigError(f"cannot serve metrics on port {port}: {exc}") from exc
        h.links.barrier("start-up")
        if config.virtual_hosts is not None and h.rank == 0:
            self._warn_two_copies()
        h.log(
            f"ready: job {config.job} slot {h.slot}/{h.nslots} "
            f"group {h.group.index} RS({h.group.k},{h.group.m}) "
            f"chunks up to {h.chunk_bytes} B, {len(h.catalog.protected())} protected step(s), "
            f"socket {h.dir / 'ctl.sock'}"
            + (f", metrics on :{self.endpoint.port}" if self.endpoint.port else "")
            + _memory_kind(h.dir)
        )

    def _warn_two_copies(self) -> None:
        """Say so when MPICH will move the virtual hosts' bytes in two copies (see
        :func:`transport.mpi.single_copy_off`): puts between them take 10-20x longer."""
        from mpi4py import MPI

        off = single_copy_off(MPI.Get_library_version())
        if off is None:
            return
        why, fix = off
        self.host.log(
            f"warning: MPICH moves the bytes between these virtual hosts in two copies ({why}), "
            "not with its single-copy path (CMA, which needs ptrace permission between the "
            f"daemons), so puts take 10-20x longer than they need; {fix}"
        )

    def run(self) -> int:
        return self.rounds.run()

    def stop(self) -> None:
        """Ask every daemon to stop after the next round (safe from a signal handler)."""
        self.host.stopping = True

    def close(self) -> None:
        self.warmer.close()
        if self.server is not None:
            self.server.close()
        self.endpoint.close()
        self.host.close()
        self.exchange.close()
        self.tier.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the host directory is free for the next daemon
            self._lock_fd = None
