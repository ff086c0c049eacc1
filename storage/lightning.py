"""Lightning with ecsnap: a ``CheckpointIO`` that keeps every checkpoint in the daemons' memory.

    from storage.lightning import SnapshotCheckpointIO

    io = SnapshotCheckpointIO("myjob")
    trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_train_steps=1)])
    trainer.fit(model, ckpt_path=io.latest())      # None on the first run: from scratch

Lightning's ``ModelCheckpoint`` decides when to save and names the checkpoint
(``epoch=0-step=120.ckpt``); this plugin puts the checkpoint dict into ecsnap as the step its
path ends in (see :mod:`storage.ids`; a path that names none, ``last.ckpt``, is the trainer's
``global_step``) and writes no file. ``load_checkpoint`` takes any such path, and
:meth:`SnapshotCheckpointIO.latest` names the newest protected step. ``remove_checkpoint``
(``ModelCheckpoint``'s ``save_top_k``) deletes the step, on a thread of its own (its failure
is raised at the next save, like a save's).

``save_checkpoint`` returns once the checkpoint's bytes are copied into the daemon's memory
(Lightning's ``AsyncCheckpointIO`` contract): training goes on while the daemons protect it. The
protection of a save is waited for at the next save, a load, a removal of that step,
:meth:`SnapshotCheckpointIO.latest` and ``teardown`` (the end of ``fit``), and its failure is
raised there: never lost, and the last checkpoint is protected before ``fit`` returns.

One process saves (Lightning calls ``save_checkpoint`` on global rank 0 only, with the whole
checkpoint), so each step is one shard, rank 0 of world size 1; every process loads it, from
its own host's daemon (a step held elsewhere is fetched). Strategies that save through DCP
(FSDP, ModelParallel) use :mod:`storage.dcp` instead.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

import storage
from storage import ids
from storage.errors import StepNotFoundError, StorageError

__all__ = ["SnapshotCheckpointIO"]


# what an MPI launcher sets in each process it starts (MPICH's Hydra, Slurm's PMI, PMIx, Open
# MPI, MVAPICH)
_MPI_LAUNCHED = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_FD",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


def _no_singleton_mpi() -> None:
    """Lightning chooses its cluster environment by asking each kind whether it applies, and
    its MPI kind initialises MPI to ask whenever mpi4py is importable (ecsnap's daemons need it
    beside the trainer). A singleton MPI makes a 1 MB ``/dev/shm/mpich_shm_*`` file that a
    SIGKILLed trainer leaves for good. A process that no MPI launcher started cannot be an MPI
    job of more than one: Lightning is told so without MPI being initialised, the answer it
    would have got."""
    if any(v in os.environ for v in _MPI_LAUNCHED):
        return
    try:
        from lightning.fabric.plugins.environments import mpi
    except ImportError:
        return
    if "mpi4py.MPI" not in sys.modules and hasattr(mpi, "_MPI4PY_AVAILABLE"):
        setattr(mpi, "_MPI4PY_AVAILABLE", False)  # noqa: B010  (read at each detect())


def _plain(value: Any) -> Any:
    """The checkpoint with dict subclasses (Lightning's ``AttributeDict`` of hyperparameters)
    as plain dicts: ecsnap stores dict and OrderedDict, and never pickles."""
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _plain(v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _own(value: Any) -> Any:
    """Tensors cloned out of the snapshot's shared memory (a loaded checkpoint outlives it)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _own(v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_own(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_own(v) for v in value)
    return value


class SnapshotCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` into ecsnap (see the module docstring).

    ``job``, ``root`` and ``host`` as in :func:`storage.connect`; the store is connected on
    first use, in the process that uses it.
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        root: str | os.PathLike[str] | None = None,
        host: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.job, self.root, self.host, self.timeout = job, root, host, timeout
        _no_singleton_mpi()
        self._store: storage.Store | None = None
        self._aliases: dict[str, int] = {}  # paths that named no step -> the step saved
        self._pending: tuple[int, storage.SaveHandle] | None = None  # staged, not yet protected
        # deletes (save_top_k) run on a thread of their own, on a connection of their own: a
        # delete answers once every host has removed the step (rounds of the storage job), and
        # waiting for it in the loop cost 119 ms a step (6.25M parameters, 2 virtual hosts)
        self._deleter: ThreadPoolExecutor | None = None
        self._delete_store: storage.Store | None = None
        self._deletes: list[Future[None]] = []

    def _connect(self) -> storage.Store:
        return storage.connect(
            self.job, rank=0, world_size=1, root=self.root, host=self.host, timeout=self.timeout
        )

    @property
    def store(self) -> storage.Store:
        if self._store is None:
            self._store = self._connect()
        return self._store

    def _step(self, path: Any, fallback: int | None = None) -> int:
        key = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
        if key in self._aliases:
            return self._aliases[key]
        if ids.valid(path):
            return ids.step_of(path)
        if fallback is not None:
            return fallback
        raise StorageError(
            f"checkpoint path {key!r} names no ecsnap step: give {ids.FORMS}, or "
            "SnapshotCheckpointIO.latest()"
        )

    def _settle(self, deletes: bool = False) -> None:
        """Wait until the last save is protected; raise its failure here (once). Raise a
        delete's failure too (``deletes``: wait for every delete first)."""
        if self._pending is not None:
            _, handle = self._pending
            self._pending = None
            handle.wait()
        done = [f for f in self._deletes if deletes or f.done()]
        self._deletes = [f for f in self._deletes if f not in done]
        for f in done:
            f.result()

    def _delete(self, step: int) -> None:
        """On the deleter's thread: delete ``step`` (gone already is no error)."""
        if self._delete_store is None:
            self._delete_store = self._connect()
        try:
            self._delete_store.delete(step)
        except StepNotFoundError:
            pass

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Put ``checkpoint`` as the step ``path`` names (else its ``global_step``); return once
        its bytes are staged (the previous save's protection is waited for first, and its
        failure raised). A path naming no step, saved at a step already saved (as ``save_last``
        does right after the step's own checkpoint), is an alias of that step."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{type(self).__name__}`."
            )
        global_step = checkpoint.get("global_step")
        step = self._step(path, fallback=global_step if isinstance(global_step, int) else None)
        key = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
        saved = self._pending is not None and self._pending[0] == step
        if not ids.valid(path) and (saved or step in self.store.steps()):
            self._aliases[key] = step
            return
        self._settle()
        handle = self.store.put(step, _plain(checkpoint))
        handle.staged.result()  # copied: the trainer may change its tensors from here on
        self._pending = (step, handle)
        if not ids.valid(path):
            self._aliases[key] = step

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint of the step ``path`` names (or that :meth:`latest` named), its tensors
        copied out of shared memory (onto ``map_location``'s device when it names one)."""
        step = self._step(path)
        self._settle()
        device = map_location if isinstance(map_location, (str, type(None))) else None
        if device is not None and str(device).startswith("cuda"):
            loaded = self.store.get(step, device=device)
        else:
            loaded = _own(self.store.get(step))
        if not isinstance(loaded, dict):
            raise StorageError(f"step {step} holds no Lightning checkpoint (a {type(loaded)})")
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the step ``path`` names (``ModelCheckpoint``'s ``save_top_k``); a step that is
        gone already is no error."""
        try:
            step = self._step(path)
        except StorageError:
            return
        if self._pending is not None and self._pending[0] == step:
            self._settle()  # protected first, so that the delete finds it
        self._aliases = {k: v for k, v in self._aliases.items() if v != step}
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ecsnap-lightning-delete")
        self._deletes.append(self._deleter.submit(self._delete, step))

    def latest(self) -> str | None:
        """A ``ckpt_path`` for ``trainer.fit`` naming the newest protected step, or None when
        there is none (a first run)."""
        self._settle()
        step = self.store.latest_step()
        return None if step is None else f"ecsnap/{self.store.job}/step-{step}"

    def teardown(self) -> None:
        """The end of ``fit``: the last save is protected (its failure raised), then the
        connection closes."""
        try:
            self._settle(deletes=True)
        finally:
            if self._deleter is not None:
                self._deleter.shutdown(wait=True)
                self._deleter = None
            if self._delete_store is not None:
                self._delete_store.close()
                self._delete_store = None
            if self._store is not None:
                self._store.close()
                self._store = None
