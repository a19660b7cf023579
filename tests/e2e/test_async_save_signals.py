"""A stop while a checkpoint is being written in the background: real `runner demo`
processes, real signals, one process and two ranks under torchrun.

- test_sigterm_during_a_background_save_*: the demo (async saves every step) is frozen with
  SIGSTOP at an instant its staging dir `.tmp-step_N-<pid>-*` exists (a save of step N in
  flight), sent SIGTERM, and let go. The loop had gone on training past N while N was being
  written, so the stop lands at step N+1: the save of N is finished, then the final
  checkpoint is committed at N+1, the stop step, and the demo exits 75. With sync saves the
  loop itself is inside the save of N and the stop lands at N: this test fails. Re-running
  the command resumes at N+1 and ends at the fingerprint of an uninterrupted 200-step run made
  in the same session (`straight_demo`), bit-exact.
- test_two_ranks_async_*: one rank of a 2-rank torchrun launch (async saves) gets SIGTERM
  once the checkpoint of step 8 is being written; both ranks stop at one agreed step S and
  exit 75 with the final checkpoint at S (both ranks' files); the same command resumes at S
  and ends at the fingerprint of an uninterrupted 2-rank run with sync saves made in the same
  session (`straight_2rank`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.verify import verify_dir
from tests.fixtures.async_saves import freeze, staging_dirs
from tests.fixtures.demo_process import (
    checkpoint_steps,
    demo_cmd,
    manifest,
    run_demo,
    wait_for_step,
)
from tests.fixtures.multirank import (
    STEPS,
    Straight,
    demo_args,
    final_fingerprint,
    rank_exits,
    stops,
    wait_until,
)
from tests.fixtures.torchrun import Torchrun

pytestmark = pytest.mark.e2e

_STOPPED = re.compile(r"stopped by SIGTERM at step (\d+)")
_COMMITTED = re.compile(r"checkpoint step (\d+) committed in [0-9.]+s \(([^)]*)\)")


def commits(log: str) -> dict[int, str]:
    """step -> the parenthesis of its "checkpoint step N committed" line."""
    return {int(m[1]): m[2] for m in _COMMITTED.finditer(log)}


def sigterm_during_a_save(proc: subprocess.Popen[bytes], ckpt_dir: Path) -> int:
    """Freeze `proc` at an instant one of its staging dirs exists, SIGTERM it, let it go;
    returns the step whose save was in flight then."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the demo ended before a save was caught in flight"
        if not staging_dirs(ckpt_dir, proc.pid):
            time.sleep(0.0005)
            continue
        freeze(proc.pid)
        staging = staging_dirs(ckpt_dir, proc.pid)  # what is in flight while it stands still
        if not staging:  # committed between the look and the stop: try the next one
            os.kill(proc.pid, signal.SIGCONT)
            continue
        os.kill(proc.pid, signal.SIGTERM)  # pending until it runs again
        os.kill(proc.pid, signal.SIGCONT)
        ((step,),) = {(int(name[len(".tmp-step_") :][:6]),) for name in staging}
        return step
    raise AssertionError("no save caught in flight in 60 s")


def test_sigterm_during_a_background_save_finishes_it_commits_the_stop_step_and_resumes_exactly(
    tmp_path: Path, straight_demo: Callable[[int], str]
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            demo_cmd(run_dir, "--save-mode", "async", steps=200, ckpt_every=1),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_step(proc, run_dir, 5)
        in_flight = sigterm_during_a_save(proc, run_dir / "checkpoints")
        assert proc.wait(timeout=60) == 75, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    ((stopped,),) = [(int(m[1]),) for m in _STOPPED.finditer(text)]
    # the loop trained on while step `in_flight` was written: it stopped one step later
    assert stopped == in_flight + 1, (in_flight, stopped, text)
    assert checkpoint_steps(run_dir)[-2:] == [in_flight, stopped]
    final = manifest(run_dir, stopped)
    assert final["step"] == stopped
    assert verify_dir(run_dir / "checkpoints" / f"step_{stopped:06d}").step == stopped
    assert verify_dir(run_dir / "checkpoints" / f"step_{in_flight:06d}").step == in_flight
    assert commits(text)[in_flight].endswith(" ms")  # "(steps, 1.4 MB, async, copied in N ms)"
    assert ", async, copied in " in commits(text)[in_flight]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]

    again = run_demo(run_dir, steps=200, ckpt_every=100)
    assert again.returncode == 0, again.stderr
    assert f"resuming from local checkpoint step {stopped}" in again.stderr
    reference = straight_demo(200)
    assert f"step 200/200 fingerprint {reference}" in again.stdout + again.stderr
    assert manifest(run_dir, 200)["fingerprint"] == reference


def test_two_ranks_async_sigterm_to_one_rank_stops_both_at_one_step_and_resumes_to_the_straight_fingerprint(  # noqa: E501
    torchrun: Callable[..., Torchrun], tmp_path: Path, straight_2rank: Straight
) -> None:
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    # the straight run's length and batch (its sync saves every 10 steps: same fingerprint)
    args = demo_args(run_dir, "--save-mode", "async", steps=STEPS, ckpt_every=8)
    first = torchrun(2, args)
    first.worker_pids()

    def step_8_saving() -> bool:
        names = os.listdir(ckpt_dir) if ckpt_dir.exists() else []
        return any(n.startswith((".tmp-step_000008-", "step_000008")) for n in names)

    wait_until(step_8_saving, lambda: first.proc.poll() is None, "save of step 8", timeout=120)
    first.signal_rank(1, signal.SIGTERM)
    # the ranks exit 75, which torchrun's agent counts as a failed launch: exit 1
    assert first.wait(90) == 1, first.output()
    assert rank_exits(first) == {0: 75, 1: 75}, first.output()
    ((reason0, step0),) = stops(first.rank_stderr(0))
    ((reason1, step1),) = stops(first.rank_stderr(1))
    assert (reason0, reason1) == ("stop requested on another rank", "SIGTERM")
    assert step0 == step1
    stopped = step0
    assert 8 < stopped < STEPS
    periodic = set(range(8, stopped + 1, 8))
    assert checkpoint_steps(run_dir) == sorted(periodic | {stopped})[-3:]  # --keep 3
    final = manifest(run_dir, stopped)
    assert (final["step"], final["world_size"], final["format"]) == (stopped, 2, "torch-dcp")
    assert verify_dir(ckpt_dir / f"step_{stopped:06d}").step == stopped
    saved = commits(first.rank_stderr(0))
    assert sorted(saved) == sorted(periodic | {stopped})
    assert all(", 2 ranks, async, copied in " in how for how in saved.values()), saved

    again = torchrun(2, args)
    assert again.wait(180) == 0, again.output()
    assert rank_exits(again) == {0: 0, 1: 0}, again.output()
    assert f"resuming from local checkpoint step {stopped}" in again.rank_stderr(0)
    assert final_fingerprint(again.rank_stderr(0)) == (STEPS, straight_2rank.fingerprint)
    assert manifest(run_dir, STEPS)["fingerprint"] == straight_2rank.fingerprint
