"""A Hugging Face `Trainer` script as its users write it, untouched but for the one resume line:
a tiny GPT-2 built from a config (no hub download), a synthetic dataset, `save_steps`, and
`resume_from_checkpoint=os.environ.get("RUNNER_RESUME_FROM") or None`. At the end it writes
OUT/final.sha256: sha256 over every parameter's bytes in name order (equal = bit-identical).

Usage: python hf_trainer.py OUT MAX_STEPS SAVE_STEPS [STEP_SECONDS]
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 256, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Pace(TrainerCallback):
    """Slows each step down so that a test can stop it mid-run; prints the step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"step {state.global_step}", flush=True)
        time.sleep(self.seconds)


def main() -> None:
    out, max_steps, save_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pace = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    torch.set_num_threads(1)
    set_seed(7)  # before the model is built: its random init
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        save_steps=save_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=7,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Pace(pace)])
    resume = os.environ.get("RUNNER_RESUME_FROM") or None
    print(f"resume from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    Path(out, "final.sha256").write_text(digest.hexdigest())
    print(f"final {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
