"""The daemon's file descriptors: the soft limit raised to the hard one, and what a layout needs.

A daemon runs for the whole training job. What holds its descriptors: the MPI links to its peers,
the trainers' connections to its control socket, its own few (the socket it listens on, the
metrics server, a manifest being written). Shared-memory mappings hold none
(:func:`transport.shm.map_file`), so the count does not grow with ``--keep`` or with the sizes the
daemon has seen.

The soft ``RLIMIT_NOFILE`` that ``mpirun`` and ``srun`` hand down is often 1,024, far below the
hard one; like every Go program since Go 1.19 (go.dev/issue/46279), the daemon raises its soft
limit to the hard limit at start. :func:`check` refuses to start where even the hard limit is
below what the layout needs.

Who calls it: ``ecsnap serve`` (:mod:`storage.serve`), before MPI starts (:func:`raise_soft`) and
once the job's size is known (:func:`check`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from storage.errors import ConfigError

__all__ = ["BASE", "PER_PEER", "TRAINERS", "Raised", "check", "needed", "raise_soft"]

BASE = 64  # stdio, MPI's own (its process manager, shared-memory segments), listen, metrics
PER_PEER = 2  # MPI's connections to each other daemon, both ways at worst
# the trainers of one host: up to 32 local ranks, each with up to 16 connections at once (its
# session, its mapping threads, one wait per put in flight)
TRAINERS = 32 * 16


@dataclass(frozen=True)
class Raised:
    """The soft limit before and after :func:`raise_soft`, and the hard limit."""

    before: int
    soft: int
    hard: int

    def text(self, hosts: int) -> str:
        """What the daemon's start log says of its descriptors."""
        was = (
            f"soft limit raised from {self.before} to {self.soft} (the hard limit)"
            if self.soft != self.before
            else f"limit {self.soft}"
        )
        return (
            f"descriptors: {was}; this layout needs about {needed(hosts)} ({BASE} own, "
            f"{PER_PEER} per peer, {TRAINERS} for trainers' connections), whatever --keep and the "
            "sizes put (shared-memory mappings hold none)"
        )


def _finite(n: int) -> int:
    return 1 << 62 if n == resource.RLIM_INFINITY else n


def raise_soft() -> Raised:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (as far as the kernel lets:
    ``nr_open`` caps an infinite hard limit); what it was and is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if _finite(soft) < _finite(target):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft  # a sandbox that refuses: keep what we have
    else:
        target = soft
    return Raised(before=soft, soft=target, hard=hard)


def needed(hosts: int) -> int:
    """Descriptors a daemon of a job of ``hosts`` daemons needs at most (see the constants)."""
    return BASE + PER_PEER * max(hosts - 1, 0) + TRAINERS


def check(raised: Raised, hosts: int, host: str) -> None:
    """Raise :class:`ConfigError` if the limit (raised to the hard one) is below what a daemon
    of ``hosts`` needs, naming ``ulimit -n`` and the number."""
    need = needed(hosts)
    if _finite(raised.soft) >= need:
        return
    raise ConfigError(
        f"{host}: the daemon may open only {raised.soft} file descriptors (hard limit "
        f"{raised.hard}), and a job of {hosts} hosts needs up to {need}: raise the hard limit "
        f"where the daemons start (`ulimit -n {need}` or more before mpirun/srun, or the "
        "'nofile' line of /etc/security/limits.conf), then launch again"
    )
