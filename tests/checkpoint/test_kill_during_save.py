"""SIGKILL a process that saves checkpoints in a loop, at random instants, many times.

After every kill: `runner verify` accepts the newest checkpoint, it loads with the exact state
that was saved at that step, every file under a final (non-`.tmp-`) name is complete, and
leftovers of the killed writer are cleaned up by the next one.

Importing torch costs more than a second here, so the savers are forked from one long-lived
"zygote" process that imported it once (run as
`python -m tests.checkpoint.test_kill_during_save DIR`);
each saver is a real process killed with a real SIGKILL.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.load import load_state
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter

TRIALS = 80
KEEP = 3
FLOATS = 96 * 1024  # ~0.8 MB per checkpoint: long enough that kills land mid-write


def _state(step: int) -> dict[str, Any]:
    import torch

    return {
        "schema": "2",
        "model": {"w": torch.full((FLOATS,), float(step)), "b": torch.arange(step + 1.0)},
        "optimizer": {"state": {0: {"exp_avg": torch.full((FLOATS,), -float(step))}}},
        "counters": {"step": step},
    }


def _fingerprint(step: int) -> str:
    return hashlib.sha256(f"kill-test-{step}".encode()).hexdigest()


def _save(writer: CheckpointWriter, step: int) -> None:
    """Commit the state of `step` (every third one through a sharding writer)."""
    meta = CheckpointMeta(
        step=step,
        samples_seen=step * 4,
        world_size=1,
        epoch=0,
        batch_in_epoch=step,
        fingerprint=_fingerprint(step),
    )
    writer.write_state(_state(step), meta=meta)


def _saver(run_dir: Path) -> None:
    """Child body: clean up, then save step after step (pruning to KEEP) until killed."""
    from runner.checkpoint.retention import prune
    from runner.checkpoint.writer import committed_steps
    from runner.storage.file import FileStorage

    ckpt_dir = run_dir / "checkpoints"
    writers = [
        CheckpointWriter(
            ckpt_dir,
            run_id="kill",
            writer_id=str(os.getpid()),
            stale_seconds=0,
            chunk_bytes=chunk_bytes,
        )
        for chunk_bytes in (None, None, FLOATS)  # FLOATS bytes: a chunk per big tensor
    ]
    writers[0].cleanup_partial()
    step = (committed_steps(ckpt_dir) or [0])[-1]
    while True:
        step += 1
        _save(writers[step % 3], step)
        prune(FileStorage(run_dir), keep=KEEP, newest_ok=step)


def _zygote(run_dir: Path) -> None:
    import torch

    torch.set_num_threads(1)
    torch.save(_state(0), io.BytesIO())  # warm up what the savers use before forking
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    _saver(run_dir)
                finally:
                    os._exit(1)  # never return into the zygote's loop
            print(pid, flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(arg), 0)
            print(status, flush=True)


def _runner_verify(run_dir: Path) -> tuple[int, list[dict[str, Any]]]:
    """`runner verify RUN_DIR --json`, through the real CLI entry point, in this process."""
    from runner.cli.main import main

    out = io.StringIO()
    code = 0
    with redirect_stdout(out):
        try:
            main(["verify", str(run_dir), "--json"])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, json.loads(out.getvalue() or "[]")


def load_manifest_format(run_dir: Path, step: int) -> str:
    return verify_dir(run_dir / "checkpoints" / f"step_{step:06d}").format


def _check_final_names(ckpt_dir: Path) -> list[int]:
    """Every non-temp entry is a committed step dir whose files all verify."""
    steps = []
    for entry in ckpt_dir.iterdir():
        if entry.name.startswith(".tmp-"):
            continue
        assert entry.name.startswith("step_") and (entry / "manifest.json").is_file(), entry
        manifest = verify_dir(entry)
        listed = {f.path for f in manifest.files}
        assert {p.name for p in entry.iterdir()} == {"manifest.json", *listed}, entry
        steps.append(manifest.step)
    return sorted(steps)


@pytest.mark.slow
def test_sigkill_at_random_instants_never_breaks_the_newest_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _save(CheckpointWriter(run_dir / "checkpoints", run_id="kill", writer_id="seed"), 0)
    rng = random.Random(1234)
    zygote = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.test_kill_during_save", str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert zygote.stdin is not None and zygote.stdout is not None

    def ask(command: str) -> int:
        zygote.stdin.write(command + "\n")  # type: ignore[union-attr]
        zygote.stdin.flush()  # type: ignore[union-attr]
        return int(zygote.stdout.readline())  # type: ignore[union-attr]

    started = time.monotonic()
    newest_seen = 0
    formats: set[str] = set()
    mid_save = 0  # kills that left a temp dir behind: they interrupted a save or a prune
    try:
        assert zygote.stdout.readline().strip() == "ready"
        for trial in range(TRIALS):
            pid = ask("fork")
            # a save takes tens of ms here (mostly fsync): most kills land mid-save, some between
            time.sleep(rng.uniform(0.0, 0.2))
            os.kill(pid, signal.SIGKILL)
            status = ask(f"reap {pid}")
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"trial {trial}: the saver was not alive when killed (status {status})"
            )

            mid_save += any(p.name[:5] == ".tmp-" for p in (run_dir / "checkpoints").iterdir())
            code, report = _runner_verify(run_dir)
            assert code == 0, f"trial {trial}: runner verify exited {code}: {report}"
            newest = report[0]
            assert newest["ok"] and newest["fingerprint"] == _fingerprint(newest["step"])
            state = load_state(run_dir / "checkpoints" / f"step_{newest['step']:06d}")
            assert float(state["model"]["w"][0]) == newest["step"]
            assert float(state["optimizer"]["state"][0]["exp_avg"][-1]) == -newest["step"]
            assert newest["step"] >= newest_seen
            newest_seen = newest["step"]

            formats.add(load_manifest_format(run_dir, newest["step"]))
            steps = _check_final_names(run_dir / "checkpoints")
            assert steps[-1] == newest["step"]
            leftovers = [p for p in (run_dir / "checkpoints").iterdir() if p.name[:5] == ".tmp-"]
            assert len(leftovers) <= 2, f"trial {trial}: leftovers pile up: {leftovers}"
    finally:
        zygote.kill()
        zygote.wait()
    elapsed = time.monotonic() - started
    assert newest_seen >= TRIALS // 4, f"only {newest_seen} saves committed in {TRIALS} trials"
    assert formats == {"torch-state", "torch-chunked"}
    assert mid_save >= TRIALS // 4, f"only {mid_save} of {TRIALS} kills interrupted a write"
    print(f"{TRIALS} kills, {mid_save} mid-write, {newest_seen} commits, {elapsed:.1f}s")
    assert elapsed < 90, f"{TRIALS} trials took {elapsed:.0f}s"


if __name__ == "__main__":
    _zygote(Path(sys.argv[1]))
