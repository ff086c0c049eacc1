"""The Hugging Face ``Trainer`` with ecsnap: snapshots every N steps, and the way back.

    from storage.hf import SnapshotCallback

    snap = SnapshotCallback("myjob", every=1)
    trainer = Trainer(model, TrainingArguments(..., save_strategy="no"), callbacks=[snap], ...)
    trainer.train(resume_from_checkpoint=snap.restore(args.output_dir))   # None: from scratch

Every N-th step, where the Trainer would save a checkpoint (after the optimizer and scheduler
stepped and the step was logged), every process puts its model, optimizer, scheduler, RNG and
trainer state into ecsnap as that step (process i is rank i of the Trainer's world), without
writing a checkpoint folder; the training loop waits only for the copy, and only at the next
optimizer step (``store.guard``). The put is asynchronous: a process killed right after a step
may lose that step's snapshot, and resumes from the one before.

The way back is the Trainer's own ``resume_from_checkpoint``: :meth:`SnapshotCallback.restore`
writes the newest protected step as the checkpoint folder the Trainer reads (``checkpoint-N``
under ``output_dir``: the model's weights, ``optimizer.pt``, ``scheduler.pt``, the RNG state,
``trainer_state.json``; the same files the Trainer's ``_save_checkpoint`` writes) and returns
its path. Those files are the Trainer's format (``torch.save``); ecsnap itself never pickles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import storage
from storage.errors import StepNotFoundError

__all__ = ["SnapshotCallback"]


def _rng_state() -> dict[str, Any]:
    """What the Trainer's ``_save_rng_state`` keeps (CPU and, where present, CUDA)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper (its ``step`` is the one to guard)."""
    return getattr(optimizer, "optimizer", optimizer)


class SnapshotCallback(TrainerCallback):
    """Snapshots into ecsnap every ``every`` optimizer steps (see the module docstring).

    ``job``, ``root`` and ``host`` as in :func:`storage.connect`.
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        every: int = 1,
        root: str | os.PathLike[str] | None = None,
        host: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.job, self.every, self.root, self.host, self.timeout = job, every, root, host, timeout
        self.store: storage.Store | None = None
        self._guarded: Any = None
        self._due: tuple[int, dict[str, Any]] | None = None  # a step to snapshot, its RNG
        self.last: Any = None  # the newest put's handle

    def _connect(self, args: TrainingArguments) -> storage.Store:
        if self.store is None:
            self.store = storage.connect(
                self.job,
                rank=args.process_index,
                world_size=args.world_size,
                root=self.root,
                host=self.host,
                timeout=self.timeout,
            )
        return self.store

    # -- saving ---------------------------------------------------------------------------------

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """A step is done: due a snapshot, take its RNG state now (the Trainer saves it here,
        before anything draws again) and the rest at the next hook, once the Trainer has logged
        the step (as its own checkpoint's ``trainer_state.json`` holds that log)."""
        if state.global_step % self.every == 0:
            self._due = (state.global_step, _rng_state())

    def _snapshot(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, kw: Any
    ) -> None:
        due, self._due = self._due, None
        model, optimizer, scheduler = kw.get("model"), kw.get("optimizer"), kw.get("lr_scheduler")
        if due is None or model is None or optimizer is None:
            return
        step, rng = due
        store = self._connect(args)
        inner = _inner(optimizer)
        if self._guarded is not inner:
            store.guard(inner)  # the next optimizer step waits for this snapshot's copy
            self._guarded = inner
        # as the Trainer's _save_checkpoint writes trainer_state.json, the control state in it
        trainer_state = dataclasses.asdict(state)
        trainer_state.setdefault("stateful_callbacks", {})["TrainerControl"] = control.state()
        snapshot = {
            "model": model.state_dict(),
            "optimizer": inner.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else {},
            "rng": rng,
            "trainer_state": json.dumps(trainer_state, indent=2, sort_keys=True) + "\n",
        }
        self.last = store.put(step, snapshot)

    # the first hook after a due step's end takes its snapshot: the Trainer has logged it by then,
    # and nothing has changed the model, the optimizer or the scheduler since

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._snapshot(args, state, control, kw)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._snapshot(args, state, control, kw)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._snapshot(args, state, control, kw)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._snapshot(args, state, control, kw)
        if self.last is not None:
            self.last.wait()  # the last snapshot is protected before train() returns

    # -- the way back -----------------------------------------------------------------------------

    def restore(
        self, output_dir: str | os.PathLike[str], args: TrainingArguments | None = None
    ) -> str | None:
        """Write the newest protected step as a Trainer checkpoint folder under ``output_dir``
        and return its path for ``trainer.train(resume_from_checkpoint=...)``; None when no step
        is protected (a first run). Every process calls it (each writes its own RNG file when
        the world is larger than one); ``args`` (default: from the environment) gives the
        process's rank."""
        rank = args.process_index if args is not None else int(os.environ.get("RANK", 0))
        world = args.world_size if args is not None else int(os.environ.get("WORLD_SIZE", 1))
        if self.store is None:
            self.store = storage.connect(
                self.job,
                rank=rank,
                world_size=world,
                root=self.root,
                host=self.host,
                timeout=self.timeout,
            )
        step = self.store.latest_step()
        if step is None:
            return None
        try:
            snap = self.store.get(step)
        except StepNotFoundError:
            return None
        folder = Path(output_dir) / f"checkpoint-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        rng = folder / ("rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth")
        torch.save(snap["rng"], rng)
        if rank == 0:
            torch.save(dict(snap["model"]), folder / "pytorch_model.bin")
            torch.save(snap["optimizer"], folder / "optimizer.pt")
            torch.save(snap["scheduler"], folder / "scheduler.pt")
            (folder / "trainer_state.json").write_text(snap["trainer_state"])
        del snap
        return str(folder)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
