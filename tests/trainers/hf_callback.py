"""A Hugging Face `Trainer` script with spot-runner's callback, as the README shows it: the
lines marked `# spot` are all it adds. A tiny GPT-2 built from a config (no hub download), a
synthetic dataset, `save_steps`; alone or under torchrun (gloo on CPU). At the end rank 0
writes out/final.sha256: sha256 over every parameter's bytes in name order.

Usage: python hf_callback.py RUN_DIR MIRROR|- MAX_STEPS SAVE_STEPS [STEP_SECONDS]
"""

from __future__ import annotations

from runner.preemption.early import install_early_handlers

install_early_handlers()

import hashlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from runner import log_to_stderr  # noqa: E402
from runner.integrations.transformers import (  # noqa: E402  # spot
    RunConfig,
    SpotRunnerCallback,
    exit_process,
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
        rank = os.environ.get("RANK", "0")
        print(f"rank {rank} pid {os.getpid()} step {state.global_step}", flush=True)
        time.sleep(self.seconds)


def main() -> None:
    run_dir, mirror = sys.argv[1], sys.argv[2]
    max_steps, save_steps = int(sys.argv[3]), int(sys.argv[4])
    pace = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    log_to_stderr()
    config = RunConfig(run_dir=run_dir, mirror=None if mirror == "-" else mirror)  # spot
    spot = SpotRunnerCallback(config)  # spot
    torch.set_num_threads(1)
    set_seed(7)  # before the model is built: its random init
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        output_dir="out",
        max_steps=max_steps,
        save_steps=save_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=7,
    )
    callbacks = [Pace(pace), spot]  # spot: `spot` in callbacks
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    print(f"resume from {spot.resume_from}", flush=True)
    trainer.train(resume_from_checkpoint=spot.resume_from)  # spot: resume_from
    if int(os.environ.get("RANK", "0")) == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        Path("out", "final.sha256").write_text(digest.hexdigest())
        print(f"final {digest.hexdigest()}", flush=True)
    print(f"rank {os.environ.get('RANK', '0')} exit {spot.exit_code}", flush=True)
    exit_process(spot.exit_code)  # spot


if __name__ == "__main__":
    main()
