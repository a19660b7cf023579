"""A Lightning script as its users write it, untouched but for the one resume line: a tiny
regression module, an unshuffled synthetic dataset, `ModelCheckpoint(every_n_train_steps=N,
filename="{step}")` into CKPTS/, and `ckpt_path=os.environ.get("RUNNER_RESUME_FROM")`. At the
end it writes CKPTS/../final.sha256: sha256 over every parameter's bytes in name order.

Usage: python lightning_trainer.py CKPTS MAX_STEPS EVERY_N_STEPS [STEP_SECONDS]
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self, pace: float) -> None:
        super().__init__()
        layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
        self.net = torch.nn.Sequential(*layers)
        self.pace = pace

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        print(f"step {self.trainer.global_step}", flush=True)
        time.sleep(self.pace)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    ckpts, max_steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pace = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = Tiny(pace)
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=ckpts, every_n_train_steps=every, filename="{step}", save_top_k=-1
            )
        ],
    )
    resume = os.environ.get("RUNNER_RESUME_FROM") or None
    print(f"resume from {resume}", flush=True)
    trainer.fit(model, data, ckpt_path=resume)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    Path(ckpts).parent.joinpath("final.sha256").write_text(digest.hexdigest())
    print(f"final {digest.hexdigest()} at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
