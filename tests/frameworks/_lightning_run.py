"""One Lightning training run, as a user writes it: ``python -m tests.frameworks._lightning_run
'<json spec>'``. Checkpoints every step, to ecsnap (``SnapshotCheckpointIO``) or to Lightning's
own files; SIGKILLs itself at ``kill_at`` (before the next step), or resumes and writes the
final weights to ``out``."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


class Net(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width),
            torch.nn.Dropout(0.2),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 2),
        )

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}


class KillAt(Callback):
    """SIGKILL this process as training is about to start step ``at`` (``at`` is saved)."""

    def __init__(self, at: int, pids: Path) -> None:
        self.at = at
        self.pids = pids  # each process killed appends its PID here

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        if trainer.global_step == self.at:
            self.pids.parent.mkdir(parents=True, exist_ok=True)  # no checkpoint made it
            with self.pids.open("a") as f:
                f.write(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    spec = json.loads(sys.argv[1])
    warnings.filterwarnings("ignore")  # Lightning's tips and deprecations
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 8, generator=g), torch.randn(96, 2, generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    ckpt_dir = Path(spec["dir"]) / "checkpoints"
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    ]
    plugins = []
    io = None
    if spec["mode"] == "ecsnap":
        from storage.lightning import SnapshotCheckpointIO

        io = SnapshotCheckpointIO(spec["job"], root=spec["root"])
        plugins.append(io)
    if spec.get("kill_at") is not None:
        callbacks.append(KillAt(spec["kill_at"], Path(spec["dir"]) / "killed.pids"))
    devices = spec.get("devices", 1)
    trainer = L.Trainer(
        max_steps=spec["steps"],
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        plugins=plugins,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=spec["dir"],
    )
    ckpt_path = None
    if spec.get("resume"):
        if io is not None:
            ckpt_path = io.latest()
        else:
            [found] = ckpt_dir.glob(f"*step={spec['resume_at']}.ckpt")
            ckpt_path = str(found)
    model = Net()
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), spec["out"])
        files = sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
        print(json.dumps({"resumed_from": ckpt_path, "files": files, "step": trainer.global_step}))


if __name__ == "__main__":
    main()
