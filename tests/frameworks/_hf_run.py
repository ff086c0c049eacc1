"""One Hugging Face Trainer run, as a user writes it: ``python -m tests.frameworks._hf_run
'<json spec>'``. A tiny GPT-2 built from a config (no download) trains on fixed tokens with a
snapshot every step to ecsnap (``SnapshotCallback``, no checkpoint folders) or Trainer
checkpoints every step; SIGKILLs itself at ``kill_at`` (before the next step), or resumes and
writes the final weights and every logged loss to ``out``."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (48, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAt(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    spec = json.loads(sys.argv[1])
    warnings.filterwarnings("ignore")
    # one thread: the test compares losses bit for bit between runs, and a kernel that splits its
    # sums over threads by the machine's load at the time rounds differently (CI once read a loss
    # 1 ulp apart after resuming, while the snapshots' copies and mappings ran beside training)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(config)
    out_dir = Path(spec["dir"])
    args = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        max_steps=spec["steps"],
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="steps" if spec["mode"] == "file" else "no",  # "none": no checkpoints
        save_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = []
    snap = None
    if spec["mode"] == "ecsnap":
        from storage.hf import SnapshotCallback

        snap = SnapshotCallback(spec["job"], root=spec["root"])
        callbacks.append(snap)
    if spec.get("kill_at") is not None:
        callbacks.append(KillAt(spec["kill_at"]))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    resume = None
    if spec.get("resume"):
        if snap is not None:
            resume = snap.restore(out_dir, args)
        else:
            resume = str(out_dir / f"checkpoint-{spec['resume_at']}")
    folders_before = sorted(p.name for p in out_dir.glob("checkpoint-*"))  # restore's, if any
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.save(model.state_dict(), spec["out"])
    print(json.dumps({"resumed_from": resume, "losses": losses, "folders": folders_before}))


if __name__ == "__main__":
    main()
