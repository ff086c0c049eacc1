"""ecsnap's storage service: daemons, the trainer client, and their errors.

>>> import storage                                              # doctest: +SKIP
>>> store = storage.connect("myjob", rank=0, world_size=8)      # doctest: +SKIP
>>> store.put(100, model.state_dict()).wait()                   # doctest: +SKIP
>>> state = store.get()                                         # doctest: +SKIP

The client's names load on first use: a daemon (``ecsnap serve``) imports this package without
torch, which only the trainers' side needs.
"""

from typing import TYPE_CHECKING, Any

from storage.errors import (
    CapacityError,
    ConfigError,
    DaemonUnavailableError,
    DaemonUntrustedError,
    PeerUnreachableError,
    PersistError,
    SnapshotUnrecoverableError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    StorageTimeoutError,
    UnsupportedTypeError,
)

if TYPE_CHECKING:
    from storage.client import SaveHandle, StepStatus, Store, connect

__all__ = [
    "CapacityError",
    "ConfigError",
    "DaemonUnavailableError",
    "DaemonUntrustedError",
    "PeerUnreachableError",
    "PersistError",
    "SaveHandle",
    "SnapshotUnrecoverableError",
    "StepExistsError",
    "StepNotFoundError",
    "StepStatus",
    "StorageError",
    "StorageTimeoutError",
    "Store",
    "UnsupportedTypeError",
    "connect",
]

_CLIENT = {"SaveHandle", "StepStatus", "Store", "connect"}


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from storage import client

        return getattr(client, name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
