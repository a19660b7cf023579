"""Trainers for `runner run` adoption tests: each writes one or two seed checkpoints in a way
a real trainer might (stdlib only, no training). Every file holds the same deterministic
payload, so a test can compare hashes with what the trainer says it wrote.

Usage: seed_writer.py MODE [STEP]
  prealloc         create step_STEP.bin at full size (header, then zeros), hold it open 1.5 s,
                   then fill it and exit 0; says whether the file was still in place before
                   the fill ("in place: yes"), i.e. nobody took the zeros
  rename-then-fill the same, but the preallocated file is renamed to its final name first
  inplace          write the file in place in two halves, closed in between (1.5 s pause), stay
                   alive 1 s more, exit 0
  bad              write a file 4 bytes short (temp name, rename), wait until the runner set
                   it aside while we still run (step_STEP.bin.rejected), exit 0 (5 if not
                   within 20 s)
  rename           temp name + rename, then wait until the runner mirrored it
                   ($TEST_MIRROR_DIR/checkpoints/step_STEP/manifest.json): exit 0 if it did
                   while we still ran, 5 if not within 20 s
  bad-on-term      write step 1 properly, then wait for SIGTERM; then write step 2 four bytes
                   short and exit 0
  report           print the resume point and the sha256 of its bytes, exit 0
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import sys
import time
from pathlib import Path

N_PARAMS = 64


def payload(step: int) -> bytes:
    floats = [float(i % 97) / 7.0 + step for i in range(3 * N_PARAMS)]
    return struct.pack("<ii", step, N_PARAMS) + struct.pack(f"<{3 * N_PARAMS}f", *floats)


def say(line: str) -> None:
    print(line, flush=True)


def final_path(step: int) -> Path:
    return Path(os.environ["RUNNER_CKPT_DIR"]) / f"step_{step:06d}.bin"


def write_renamed(step: int, data: bytes) -> None:
    tmp = final_path(step).with_name(f".tmp-step_{step:06d}.bin-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final_path(step))
    say(f"wrote step {step} sha256 {hashlib.sha256(data).hexdigest()}")


def preallocated(step: int, *, rename_first: bool) -> int:
    data = payload(step)
    target = final_path(step)
    path = target.with_name(".tmp-prealloc") if rename_first else target
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, data[:8])  # a valid header: the size check alone cannot tell it is unfinished
    os.ftruncate(fd, len(data))
    if rename_first:
        os.rename(path, target)
    time.sleep(1.5)
    try:
        still = os.stat(target).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:  # taken (moved into a checkpoint) while unfinished
        still = False
    say(f"in place: {'yes' if still else 'no'}")
    os.pwrite(fd, data[8:], 8)
    os.fsync(fd)
    os.close(fd)
    say(f"wrote step {step} sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


def in_place(step: int) -> int:
    data = payload(step)
    half = len(data) // 2
    with open(final_path(step), "wb") as f:
        f.write(data[:half])
    time.sleep(1.5)
    with open(final_path(step), "ab") as f:
        f.write(data[half:])
    say(f"wrote step {step} sha256 {hashlib.sha256(data).hexdigest()}")
    time.sleep(1.0)  # closed and complete, trainer still running
    return 0


def renamed_then_wait(step: int) -> int:
    write_renamed(step, payload(step))
    return wait_for(
        Path(os.environ["TEST_MIRROR_DIR"]) / f"checkpoints/step_{step:06d}/manifest.json"
    )


def wait_for(path: Path) -> int:
    """Stay alive until `path` exists (the runner judged our file while we ran): 0, or 5 if
    it does not within 20 s."""
    end = time.monotonic() + 20
    while time.monotonic() < end:
        if path.exists():
            say(f"saw {path.name}")
            return 0
        time.sleep(0.05)
    say(f"no {path.name}")
    return 5


def bad_on_term() -> int:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    write_renamed(1, payload(1))
    say("waiting")
    while not stop:
        time.sleep(0.02)
    write_renamed(2, payload(2)[:-4])
    return 0


def report() -> int:
    resume = os.environ.get("RUNNER_RESUME_FROM", "")
    digest = hashlib.sha256(Path(resume).read_bytes()).hexdigest() if resume else "-"
    say(f"resume {resume or '-'} sha256 {digest}")
    return 0


def main() -> int:
    mode = sys.argv[1]
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    if mode == "prealloc":
        return preallocated(step, rename_first=False)
    if mode == "rename-then-fill":
        return preallocated(step, rename_first=True)
    if mode == "inplace":
        return in_place(step)
    if mode == "bad":
        write_renamed(step, payload(step)[:-4])
        return wait_for(final_path(step).with_name(final_path(step).name + ".rejected"))
    if mode == "rename":
        return renamed_then_wait(step)
    if mode == "bad-on-term":
        return bad_on_term()
    if mode == "report":
        return report()
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
