"""SIGKILL trainers whose checkpoints are written in the background, at random instants, 60
times, on one run dir: each next trainer resumes what the killed one left.

The trainers are real processes forked from a zygote that imported torch and runner once
(tests/fixtures/async_saves.py): each runs a TrainSession with `save_mode="async"` and a save
every step (a 6.3 MB state: the loop goes on while the previous step's checkpoint is still
being serialised, hashed and fsynced on its saver thread). Each kill is a real SIGKILL at a
random instant after the trainer restored (seeded; the seed is printed). The trainer is first
frozen with SIGSTOP, so that what was in flight at the kill instant can be read exactly: a
`.tmp-step_*-<pid>-*` staging dir of the killed trainer means a background save was cut.

After every kill:
- every `checkpoints/step_*` entry (no `.tmp-`) is a committed checkpoint whose files all
  verify against its manifest, and holds exactly those files: nothing partial under a final
  name;
- the newest one loads into a fresh state whose fingerprint is the manifest's, at its step,
  and the newest never goes backwards;
- the next trainer resumes from exactly that newest step.
At the end, every newest checkpoint's fingerprint equals the one an uninterrupted run
recorded at that step, and a good share of the kills (>= 30) cut a background save.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointWriter
from runner.session.capture import load_into
from tests.fixtures.async_saves import (
    freeze,
    kill_state,
    mounted_tmpfs,
    staging_dirs,
    thread_states,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
TRIALS = 60

SEED = int(os.environ.get("ASYNC_KILL_SEED", "1313"))
KILL_WINDOW_S = 0.2  # after the trainer restored: a kill lands in the middle of its saves


class Zygote:
    def __init__(self, run_dir: Path, work_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fixtures.async_saves", str(run_dir), str(work_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            # OpenBLAS (numpy's, imported by torch) starts its worker threads at import
            # unless told to use one: the zygote must have no thread but its own at a fork
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        )
        assert self.readline() == "ready"

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"the zygote ended (exit {self.proc.poll()})"
        return line

    def ask(self, command: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return int(self.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def wait_started(work_dir: Path, pid: int, timeout: float = 30) -> dict[str, int | None]:
    marker = work_dir / f"{pid}.started"
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if not Path(f"/proc/{pid}").exists() or thread_states(pid) == "Z":
            log = (work_dir / f"{pid}.log").read_text(errors="replace")
            raise AssertionError(f"trainer {pid} ended before it started training:\n{log}")
        assert time.monotonic() < deadline, f"trainer {pid} did not start in {timeout:g} s"
        time.sleep(0.002)
    started: dict[str, int | None] = json.loads(marker.read_text())
    return started


def committed(ckpt_dir: Path) -> dict[int, Manifest]:
    """Every entry under a final name, each verified in full: step -> its manifest."""
    found = {}
    for entry in ckpt_dir.iterdir():
        if entry.name.startswith(".tmp-"):
            continue
        assert re.fullmatch(r"step_\d{6}", entry.name), entry
        assert (entry / "manifest.json").is_file(), f"{entry} has no manifest: partial"
        manifest = verify_dir(entry)  # every file's size and sha256
        listed = {f.path for f in manifest.files}
        assert {p.name for p in entry.iterdir()} == {"manifest.json", *listed}, entry
        assert manifest.step == int(entry.name[5:])
        found[manifest.step] = manifest
    return found


def loaded_fingerprint(step_dir: Path) -> tuple[int, str]:
    """Load a checkpoint into a fresh state as a resume does; its step and fingerprint."""
    fresh = kill_state()
    counters = load_into(fresh, lambda _template: load_state(step_dir))
    return counters.step, fresh.fingerprint()


def test_sigkill_during_background_saves_never_breaks_the_newest_checkpoint(
    tmp_path: Path,
) -> None:
    print(f"seed {SEED} (ASYNC_KILL_SEED to replay)")
    with mounted_tmpfs(tmp_path / "disk", "512m") as disk:
        kill_trainers(disk / "run", tmp_path / "work")


def kill_trainers(run_dir: Path, work_dir: Path) -> None:
    rng = random.Random(SEED)
    work_dir.mkdir()
    ckpt_dir = run_dir / "checkpoints"
    # removes the killed trainers' staging dirs at once (their pids are gone), as a writer
    # with stale_seconds=0 would; the trainers' own 300 s grace would let them pile up here
    sweeper = CheckpointWriter(ckpt_dir, run_id="sweep", writer_id="test", stale_seconds=0)
    newest_fp: dict[int, str] = {}  # newest step after a kill -> its manifest fingerprint
    newest: int | None = None
    cut_saves = 0  # kills while the saver thread persisted a snapshot
    cut_writes = 0  # of those, kills while it was writing the staging dir
    started = time.monotonic()
    zygote = Zygote(run_dir, work_dir)
    try:
        for trial in range(TRIALS):
            pid = zygote.ask("fork")
            resumed = wait_started(work_dir, pid)
            assert resumed["resumed"] == newest, f"trial {trial}: resumed {resumed} not {newest}"
            time.sleep(rng.uniform(0.0, KILL_WINDOW_S))
            freeze(pid)
            cut_writes += bool(staging_dirs(ckpt_dir, pid))
            cut_saves += (work_dir / f"{pid}.persisting").exists()
            os.kill(pid, signal.SIGKILL)
            status = zygote.ask(f"reap {pid}")
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"trial {trial}: the trainer had ended before the kill (status {status}): "
                + (work_dir / f"{pid}.log").read_text(errors="replace")
            )

            manifests = committed(ckpt_dir) if ckpt_dir.exists() else {}
            if not manifests:
                assert newest is None, f"trial {trial}: checkpoints up to {newest} vanished"
                continue
            assert newest is None or max(manifests) >= newest, (trial, sorted(manifests), newest)
            newest = max(manifests)
            fingerprint = manifests[newest].fingerprint
            step_dir = ckpt_dir / f"step_{newest:06d}"
            assert loaded_fingerprint(step_dir) == (newest, fingerprint), trial
            newest_fp[newest] = fingerprint
            sweeper.cleanup_partial()
            (work_dir / f"{pid}.log").unlink()

        assert newest is not None and newest >= TRIALS // 2, (
            f"only {newest} steps in {TRIALS} kills"
        )
        assert zygote.ask("reference " + " ".join(map(str, sorted(newest_fp)))) == 0, (
            work_dir / "reference.log"
        ).read_text(errors="replace")
    finally:
        zygote.close()
    reference = {
        int(k): v for k, v in json.loads((work_dir / "reference.json").read_text()).items()
    }
    assert reference == newest_fp  # each newest checkpoint is the uninterrupted run's state
    elapsed = time.monotonic() - started
    print(
        f"{TRIALS} SIGKILLs, {cut_saves} during a background save ({cut_writes} while writing "
        f"its staging dir), newest step {newest}, "
        f"{len(newest_fp)} distinct newest checkpoints checked, {elapsed:.1f} s"
    )
    assert cut_saves >= 18, f"only {cut_saves} of {TRIALS} kills landed during a background save"
    # 18 and 19 of 100 were seen on a fresh CI machine (~11 of 60): the floor guards that the
    # write path is hit at all, not a rate
    assert cut_writes >= 6, f"only {cut_writes} of {TRIALS} kills cut a checkpoint's write"
