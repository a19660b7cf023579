"""A trainer with checkpoints of its own, as Hugging Face's Trainer writes them: a directory
`OUT/checkpoint-N/` per save, written in place file after file (`weights.bin`, then after
`--pause` seconds `state.json`); with --rename it writes the directory under a temp name and
renames it into place, then waits until the runner's copy of it is committed; with --file, one
file `OUT/ckpt-N.pt` per save instead (a nanoGPT-style loop). Its "weights" are a sha256
chain over the steps, so a resume from any checkpoint is exact exactly when the final weights
equal an uninterrupted run's.

It resumes from RUNNER_RESUME_FROM (a `files` checkpoint put back by `runner run --adopt`),
prints `step N` each step, and at the end writes OUT/final.txt (the weights' hex). On SIGTERM
it dies (the default), or with --save-on-term saves the current step and exits 0 (HF's
`enable_jit_checkpoint`). --hold-open keeps weights.bin open for writing during the pause.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--hold-open", action="store_true")
    parser.add_argument("--save-on-term", action="store_true")
    parser.add_argument("--keep-last", type=int, default=0, help="delete older checkpoints")
    parser.add_argument("--rename", action="store_true")
    parser.add_argument("--file", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    stop = []
    if args.save_on_term:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

    step, weights = 0, hashlib.sha256(b"init").digest()
    resume = os.environ.get("RUNNER_RESUME_FROM") or ""
    if resume:
        assert os.environ.get("RUNNER_RESUME_FORMAT") == "files", os.environ
        src = Path(resume)
        if args.file:
            state = json.loads(src.read_text())
            step, weights = state["step"], bytes.fromhex(state["weights"])
        else:
            state = json.loads((src / "state.json").read_text())
            step, weights = state["step"], (src / "weights.bin").read_bytes()
        assert int(os.environ["RUNNER_RESUME_STEP"]) == step
        print(f"resumed from {src} at step {step}", flush=True)

    while step < args.steps:
        time.sleep(args.step_seconds)
        step += 1
        weights = hashlib.sha256(weights + step.to_bytes(8, "little")).digest()
        print(f"step {step}", flush=True)
        if (step % args.save_every == 0 or stop) and args.file:
            path = out / f"ckpt-{step}.pt"
            path.write_text(json.dumps({"step": step, "weights": weights.hex()}))
            print(f"saved {path.name}", flush=True)
        elif step % args.save_every == 0 or stop:
            save(out, step, weights, pause=args.pause, hold_open=args.hold_open, rename=args.rename)
            prune(out, keep=args.keep_last)
        if stop:
            print(f"saved step {step} after SIGTERM", flush=True)
            return 0
    (out / "final.txt").write_text(weights.hex())
    print(f"final {weights.hex()}", flush=True)
    return 0


def save(
    out: Path, step: int, weights: bytes, *, pause: float, hold_open: bool, rename: bool
) -> None:
    final = out / f"checkpoint-{step}"
    ckpt = out / f".tmp-checkpoint-{step}" if rename else final
    ckpt.mkdir(exist_ok=True)
    with open(ckpt / "weights.bin", "wb") as f:
        f.write(weights)
        f.flush()
        if hold_open:
            time.sleep(pause)
    if not hold_open:
        time.sleep(pause)
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    if rename:
        os.rename(ckpt, final)
        adopted = Path(os.environ["RUNNER_CKPT_DIR"]) / f"step_{step:06d}" / "manifest.json"
        deadline = time.monotonic() + 20
        while not adopted.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"{'adopted' if adopted.exists() else 'NOT adopted'} checkpoint-{step}", flush=True)
    print(f"saved checkpoint-{step}", flush=True)


def prune(out: Path, *, keep: int) -> None:
    if keep <= 0:
        return
    import shutil

    ckpts = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for old in ckpts[:-keep]:
        shutil.rmtree(old)


if __name__ == "__main__":
    sys.exit(main())
