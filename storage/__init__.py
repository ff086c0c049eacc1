"""ecsnap's storage service: daemons, the trainer client, and their errors.

>>> import storage                                              # doctest: +SKIP
>>> store = storage.connect("myjob", rank=0, world_size=8)      # doctest: +SKIP
>>> store.put(100, model.state_dict()).wait()                   # doctest: +SKIP
>>> state = store.get()                                         # doctest: +SKIP
"""

from storage.client import SaveHandle, StepStatus, Store, connect
from storage.errors import (
    CapacityError,
    ConfigError,
    DaemonUnavailableError,
    PersistError,
    SnapshotUnrecoverableError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    StorageTimeoutError,
    UnsupportedTypeError,
)

__all__ = [
    "CapacityError",
    "ConfigError",
    "DaemonUnavailableError",
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
