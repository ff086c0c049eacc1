"""Errors raised by :mod:`storage`, importable from ``storage``.

One root, :class:`StorageError`; each specific error also subclasses the builtin it means. Errors
raised in a daemon travel to the client by name and are raised there as the same class.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CapacityError",
    "ConfigError",
    "DaemonFailedError",
    "DaemonUnavailableError",
    "DaemonUntrustedError",
    "PeerUnreachableError",
    "PersistError",
    "SnapshotUnrecoverableError",
    "StepExistsError",
    "StepNotFoundError",
    "StorageError",
    "StorageTimeoutError",
    "UnsupportedTypeError",
]


class StorageError(Exception):
    """Root of every error raised by the storage service and its client."""

    def fields(self) -> dict[str, Any]:
        """Data the error carries (sent along when a daemon raises it for a client)."""
        return {}


class StepNotFoundError(StorageError, KeyError):
    """``get``/``status``/``delete`` of a step that is not protected (or not held) on this job."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    def fields(self) -> dict[str, Any]:
        return {"step": self.step}


class StepExistsError(StorageError, ValueError):
    """``put`` of a step this rank already put (staged or protected): steps are write-once."""


class CapacityError(StorageError):
    """A ``put`` would take the host past ``--memory-budget`` (or /dev/shm is full).

    Nothing already stored is touched: the newest protected step stays readable.
    """


class DaemonFailedError(StorageError, RuntimeError):
    """Inside a daemon: a thread it needs failed (:meth:`storage.host.Host.fail`), so the daemon
    goes down (``ecsnap serve`` exits 4) rather than live on half-alive."""


class DaemonUnavailableError(StorageError, ConnectionError):
    """No daemon answered on the host's control socket within the timeout, or it went away."""


class UnsupportedTypeError(StorageError, TypeError):
    """A state dict holds a value ecsnap does not store; ``path`` names where it is."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def fields(self) -> dict[str, Any]:
        return {"path": self.path}


class DaemonUntrustedError(StorageError, PermissionError):
    """The control socket is served by a process of another uid: not this user's daemon (another
    local user may pose as it, to read the trainers' state or have them overwrite files)."""


class ConfigError(StorageError, ValueError):
    """Daemon options that cannot work (hosts that cannot form groups, a bad chunk size...)."""


class SnapshotUnrecoverableError(StorageError):
    """More than m hosts of a group are lost: the step cannot be rebuilt from memory.

    ``lost_hosts`` names the lost hosts, ``ranks`` the ranks whose shards are gone, and
    ``newest_recoverable`` the newest step that can still be read (None if none).
    """

    def __init__(
        self,
        message: str,
        lost_hosts: list[str] | None = None,
        ranks: list[int] | None = None,
        newest_recoverable: int | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.lost_hosts = lost_hosts or []
        self.ranks = ranks or []
        self.newest_recoverable = newest_recoverable
        self.step = step

    def fields(self) -> dict[str, Any]:
        return {
            "lost_hosts": self.lost_hosts,
            "ranks": self.ranks,
            "newest_recoverable": self.newest_recoverable,
            "step": self.step,
        }


class StorageTimeoutError(StorageError, TimeoutError):
    """A wait on the storage job ran past its timeout: a step not protected in time, a round,
    a fetch or a repair that did not complete (a peer daemon stuck, dead or unreachable)."""


class PeerUnreachableError(StorageError, ConnectionError):
    """The storage job is going down: a peer daemon did not answer within ``--peer-timeout``
    (its host's link down, its daemon stopped or dead). ``hosts`` names the silent hosts, when
    the daemon knows them. What is protected stays on every host; relaunch the storage job."""

    def __init__(self, message: str, hosts: list[str] | None = None) -> None:
        super().__init__(message)
        self.hosts = hosts or []

    def fields(self) -> dict[str, Any]:
        return {"hosts": self.hosts}


class PersistError(StorageError):
    """A step on the persistent tier is missing, incomplete or fails its checksum."""


_BY_NAME: dict[str, type[StorageError]] = {
    cls.__name__: cls
    for cls in (
        StorageError,
        StepNotFoundError,
        StepExistsError,
        CapacityError,
        DaemonUnavailableError,
        UnsupportedTypeError,
        ConfigError,
        SnapshotUnrecoverableError,
        PersistError,
        PeerUnreachableError,
        StorageTimeoutError,
    )
}


def to_wire(exc: StorageError) -> dict[str, Any]:
    """The error as a reply message."""
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "fields": exc.fields()}


def from_wire(reply: dict[str, Any]) -> StorageError:
    """The exception a daemon's error reply stands for."""
    cls = _BY_NAME.get(str(reply.get("error")), StorageError)
    message = str(reply.get("message", "daemon error"))
    fields = reply.get("fields") or {}
    try:
        return cls(message, **fields)
    except TypeError:
        return cls(message)
