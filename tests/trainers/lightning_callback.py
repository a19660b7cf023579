"""A Lightning script with spot-runner's callback, as the README shows it: the lines marked
`# spot` are all it adds. A tiny regression module with dropout, a shuffled synthetic dataset
(8 batches an epoch), ModelCheckpoint every EVERY steps; alone or under torchrun (DDP, gloo).
At the end rank 0 writes final.sha256: sha256 over every parameter's bytes in name order.

Usage: python lightning_callback.py RUN_DIR MIRROR|- MAX_STEPS EVERY [STEP_SECONDS]
"""

from __future__ import annotations

from runner.preemption.early import install_early_handlers

install_early_handlers()

import hashlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from runner import log_to_stderr  # noqa: E402
from runner.integrations.lightning import (  # noqa: E402  # spot
    RunConfig,
    SpotRunnerCallback,
    exit_process,
)


class Tiny(pl.LightningModule):
    def __init__(self, pace: float) -> None:
        super().__init__()
        layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2)]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))
        self.pace = pace

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        rank = os.environ.get("RANK", "0")
        print(f"rank {rank} pid {os.getpid()} step {self.trainer.global_step}", flush=True)
        time.sleep(self.pace)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    run_dir, mirror = sys.argv[1], sys.argv[2]
    max_steps, every = int(sys.argv[3]), int(sys.argv[4])
    pace = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    log_to_stderr()
    config = RunConfig(run_dir=run_dir, mirror=None if mirror == "-" else mirror)  # spot
    spot = SpotRunnerCallback(config)  # spot
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(1234)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    x = torch.randn(64 * world, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath="ckpts", every_n_train_steps=every, filename="{step}", save_top_k=-1
            ),
            spot,  # spot
        ],
    )
    print(f"resume from {spot.resume_from}", flush=True)
    trainer.fit(Tiny(pace), data, ckpt_path=spot.resume_from)  # spot: ckpt_path
    if trainer.global_rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(trainer.lightning_module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().numpy().tobytes())
        Path("final.sha256").write_text(digest.hexdigest())
        print(f"final {digest.hexdigest()} at step {trainer.global_step}", flush=True)
    print(f"rank {os.environ.get('RANK', '0')} exit {spot.exit_code}", flush=True)
    exit_process(spot.exit_code)  # spot


if __name__ == "__main__":
    main()
