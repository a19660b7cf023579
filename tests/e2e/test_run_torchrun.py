"""`runner run --mirror file://... -- torchrun --standalone --nproc-per-node 2 -m runner demo`:
the demo trained data-parallel on two ranks under the supervisor. A stop (SIGTERM to the
supervisor, or to one rank only) ends every rank after the same step with one torch-dcp
checkpoint of world size 2, committed, verified, mirrored (`.metadata` and every rank's
files), and the supervisor exits 75; the same command then resumes from it and finishes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from runner.checkpoint.listing import list_checkpoints
from runner.storage.file import FileStorage
from tests.fixtures.cli_process import runner as run_runner
from tests.fixtures.demo_process import logged_steps
from tests.fixtures.supervised import Supervised
from tests.fixtures.torchrun import children, environ_of

# Long enough that a stop always lands mid-run; a stop ends it after one more step.
STEPS = 2000
CKPT_EVERY = 4
# A run that is resumed to its end: its length is fixed when it starts (in samples, carried in
# the checkpoint), so the resumed run ends here too. 25-100 ms a step on two CPU cores: long
# enough that the stop, sent once a checkpoint is in the mirror, lands before the end.
SHORT_STEPS = 200


def _start(
    started: list[Supervised], run_dir: Path, mirror: Path, steps: int, ckpt_every: int = CKPT_EVERY
) -> Supervised:
    args = [
        "--run-dir", str(run_dir), "--mirror", mirror.as_uri(), "--grace-seconds", "60", "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "runner", "demo", "--run-dir", str(run_dir), "--steps", str(steps),
        "--ckpt-every", str(ckpt_every), "--batch-size", "4", "--device", "cpu",
        "--threads", "1", "--no-progress",
    ]  # fmt: skip
    s = Supervised(args, env={"OMP_NUM_THREADS": "1"})
    started.append(s)
    return s


def _wait_committed(s: Supervised, run_dir: Path, step: int, timeout: float = 180) -> None:
    manifest = run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json"
    end = time.monotonic() + timeout
    while not manifest.exists():
        assert s.proc.poll() is None, f"exited {s.proc.returncode}:\n{s.err}"
        assert time.monotonic() < end, f"no step {step} in {timeout} s:\n{s.err}"
        time.sleep(0.05)


def _ranks(s: Supervised) -> dict[int, int]:
    """rank -> pid of the two workers (children of torchrun, RANK from their environment)."""
    (torchrun,) = children(s.proc.pid)
    found = {int(environ_of(pid)["RANK"]): pid for pid in children(torchrun)}
    assert sorted(found) == [0, 1], found
    return found


def _assert_final(s: Supervised, run_dir: Path, mirror: Path, after: int) -> int:
    """The newest checkpoint is the stop's final one: torch-dcp, world size 2, past `after`,
    nothing logged past it, verified locally and in the mirror; its step."""
    steps = list_checkpoints(FileStorage(run_dir))
    final = steps[-1]
    assert final > after, steps
    step_dir = run_dir / "checkpoints" / f"step_{final:06d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2, manifest
    assert manifest["format"] == "torch-dcp", manifest
    names = {f["path"] for f in manifest["files"]}
    assert ".metadata" in names, names
    for name in names:
        assert (step_dir / name).is_file(), name
    assert max(logged_steps(run_dir)) == final  # every rank stopped after the same step
    assert f"final checkpoint: step {final}" in s.err, s.err
    assert f"final checkpoint step {final} is in the mirror" in s.err, s.err
    local = run_runner("verify", str(run_dir))
    assert local.returncode == 0, local.stdout + local.stderr
    remote = run_runner("verify", mirror.as_uri(), "--step", str(final))
    assert remote.returncode == 0, remote.stdout + remote.stderr
    uploaded = [p.name for p in (mirror / "checkpoints" / f"step_{final:06d}").rglob("*")]
    assert ".metadata" in uploaded, uploaded
    return final


def _assert_resumes(started: list[Supervised], run_dir: Path, mirror: Path, final: int) -> None:
    """The same command resumes from the final checkpoint and finishes the run."""
    again = _start(started, run_dir, mirror, SHORT_STEPS)
    assert again.wait(300) == 0, again.err
    assert f"resume from {run_dir.absolute()}/checkpoints/step_{final:06d}" in again.err
    assert list_checkpoints(FileStorage(run_dir))[-1] == SHORT_STEPS
    assert list_checkpoints(FileStorage(mirror))[-1] == SHORT_STEPS


def test_sigterm_to_runner_run_stops_both_ranks_with_one_final_dcp_checkpoint(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    s = _start(supervised_launches, run_dir, mirror, SHORT_STEPS)
    _wait_committed(s, run_dir, CKPT_EVERY)
    # a periodic checkpoint is mirrored while the ranks train, not only the final one (the
    # newest queued wins: under load the first one mirrored may be a later one)
    end = time.monotonic() + 60
    while not list_checkpoints(FileStorage(mirror)):
        assert s.proc.poll() is None, s.err
        assert time.monotonic() < end, s.err
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(180) == 75, s.err
    final = _assert_final(s, run_dir, mirror, after=CKPT_EVERY)
    _assert_resumes(supervised_launches, run_dir, mirror, final)


def test_sigterm_to_one_rank_stops_every_rank_and_runner_run_exits_75(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """Only rank 1 gets SIGTERM: the ranks agree on it, each exits 75, torchrun exits 1 with
    its failure summary, and the supervisor passes on 75 instead of restarting."""
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    s = _start(supervised_launches, run_dir, mirror, STEPS)
    _wait_committed(s, run_dir, CKPT_EVERY)
    os.kill(_ranks(s)[1], signal.SIGTERM)
    assert s.wait(180) == 75, s.err
    assert "torchrun exited 1 because its workers exited 75" in s.err
    assert s.err.count("started trainer pid") == 1
    final = list_checkpoints(FileStorage(run_dir))[-1]
    manifest = json.loads(
        (run_dir / "checkpoints" / f"step_{final:06d}" / "manifest.json").read_text()
    )
    assert (manifest["world_size"], manifest["format"]) == (2, "torch-dcp")
    assert max(logged_steps(run_dir)) == final
    assert run_runner("verify", str(run_dir)).returncode == 0


def _wait_logged(s: Supervised, run_dir: Path, step: int, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while max(logged_steps(run_dir), default=0) < step:
        assert s.proc.poll() is None, f"exited {s.proc.returncode}:\n{s.err}"
        assert time.monotonic() < end, f"step {step} not logged in {timeout} s:\n{s.err}"
        time.sleep(0.05)


def test_sigusr1_checkpoints_both_ranks_and_they_train_on(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """No periodic checkpoints: SIGUSR1 to the supervisor reaches the workers (not torchrun,
    which it would kill) and gives one checkpoint of world size 2; the ranks train on, and
    the stop's final checkpoint comes later."""
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    s = _start(supervised_launches, run_dir, mirror, STEPS, ckpt_every=0)
    _wait_logged(s, run_dir, 2)
    s.proc.send_signal(signal.SIGUSR1)
    end = time.monotonic() + 120
    while not (steps := list_checkpoints(FileStorage(run_dir))):
        assert s.proc.poll() is None, s.err
        assert time.monotonic() < end, s.err
        time.sleep(0.05)
    (requested,) = steps
    manifest = json.loads(
        (run_dir / "checkpoints" / f"step_{requested:06d}" / "manifest.json").read_text()
    )
    assert (manifest["world_size"], manifest["format"]) == (2, "torch-dcp")
    _wait_logged(s, run_dir, requested + 3)  # trains on
    assert "forwarding SIGUSR1 to 2 torchrun worker(s)" in s.err
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(180) == 75, s.err
    steps = list_checkpoints(FileStorage(run_dir))
    # the requested checkpoint, the stop's final one and, when the forwarded signal reached
    # the two workers on either side of a step boundary, one more at the next step (the later
    # rank's own request, agreed one step after the first: a known straddle)
    assert steps[0] == requested and steps[-1] >= requested + 3, steps
    assert steps[1:-1] in ([], [requested + 1]), steps
