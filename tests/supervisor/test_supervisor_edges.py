"""`runner run` at its edges, with real processes and real signals: the exit code tells the
truth about the final checkpoint, exit codes 2 and 3 are not retried, nothing the trainer
started outlives the supervisor, and the give-up report keeps attempts apart."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.storage.file import FileStorage
from tests.fixtures.supervised import Supervised

REPO = Path(__file__).resolve().parents[2]
TRAINER = [sys.executable, str(REPO / "tests" / "trainers" / "edge_trainer.py")]


@pytest.fixture
def started() -> Iterator[list[Supervised]]:
    runs: list[Supervised] = []
    yield runs
    for run in runs:
        run.kill()


@pytest.fixture
def pid_dir(tmp_path: Path) -> Iterator[Path]:
    """Where trainers write the pids of the processes they leave behind; any still alive
    after the test is killed by pid."""
    d = tmp_path / "pids"
    d.mkdir()
    yield d
    for pid in _pids(d):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _pids(d: Path) -> list[int]:
    f = d / "pids"
    return [int(p) for p in f.read_text().split()] if f.exists() else []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def _run(runs: list[Supervised], run_dir: Path, *args: str) -> Supervised:
    s = Supervised(["--run-dir", str(run_dir), "--restart-backoff", "0.05", *args])
    runs.append(s)
    return s


@pytest.mark.slow
def test_trainer_that_ignores_sigterm_and_commits_nothing_exits_1_naming_the_standing_checkpoint(
    tmp_path: Path, started: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    s = _run(started, run_dir, "--grace-seconds", "1", "--", *TRAINER, "stubborn")
    s.expect("^ready$")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=30) == 1, s.err
    step5 = run_dir.absolute() / "checkpoints" / "step_000005"
    assert (
        "trainer stopped (killed at the end of the grace period)" in s.err
        and "without committing a final checkpoint; the checkpoint that stands is step 5 in "
        f"{step5}, committed before the stop"
        in s.err
    ), s.err
    assert "exiting 1, not 75" in s.err
    assert list_checkpoints(FileStorage(run_dir)) == [5]


def test_clean_exit_on_stop_with_its_step_already_committed_is_75(
    tmp_path: Path, started: list[Supervised]
) -> None:
    """Nothing new during the stop, but the trainer exited cleanly and its loss log ends at
    the committed step: its state at the stop is that checkpoint."""
    run_dir = tmp_path / "run"
    s = _run(started, run_dir, "--", *TRAINER, "clean-stop", "5")
    s.expect("^ready$")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=30) == 75, s.err
    assert "final (already committed before the stop) checkpoint: step 5" in s.err


def test_clean_exit_on_stop_with_steps_logged_past_the_checkpoint_is_not_75(
    tmp_path: Path, started: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    s = _run(started, run_dir, "--", *TRAINER, "clean-stop", "7")
    s.expect("^ready$")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=30) == 1, s.err
    assert "the checkpoint that stands is step 5" in s.err
    assert "steps up to 7 it logged after it are lost" in s.err


@pytest.mark.parametrize("code", [2, 3])
def test_child_exit_2_or_3_is_not_restarted_and_passed_on(
    tmp_path: Path, started: list[Supervised], code: int
) -> None:
    s = _run(started, tmp_path / "run", "--max-restarts", "3", "--", *TRAINER, "exit", str(code))
    assert s.wait(timeout=30) == code, s.err
    assert s.stdout == ["attempt 1"]  # exactly one attempt
    assert "restart" not in s.err.replace("not restarted", "")
    assert f"exited {code} (" in s.err and "not restarted, it would fail the same way" in s.err
    assert "--- attempt 1 (pid " in s.err and ": exit code " + str(code) in s.err


@pytest.mark.slow
def test_setsid_double_forked_helper_ignoring_sigterm_is_gone_after_exit(
    tmp_path: Path, started: list[Supervised], pid_dir: Path
) -> None:
    s = _run(started, tmp_path / "run", "--", *TRAINER, "leave-setsid", str(pid_dir))
    s.expect("^ready$")
    (helper,) = _pids(pid_dir)
    assert _alive(helper)
    assert os.getsid(helper) != os.getsid(s.proc.pid)  # out of the trainer's session
    (pid_dir / "go").touch()
    assert s.wait(timeout=30) == 0, s.err
    assert not _alive(helper)
    assert f"terminated pids {helper}" in s.err


@pytest.mark.slow
def test_detached_helper_holding_the_output_pipes_is_swept_and_named(
    tmp_path: Path, started: list[Supervised], pid_dir: Path
) -> None:
    s = _run(started, tmp_path / "run", "--", *TRAINER, "leave-pipes", str(pid_dir))
    assert s.wait(timeout=30) == 0, s.err
    (helper,) = _pids(pid_dir)
    assert not _alive(helper)
    assert f"terminated pids {helper}" in s.err


@pytest.mark.slow
def test_helper_in_the_trainers_group_ignoring_sigterm_is_gone_after_the_stop(
    tmp_path: Path, started: list[Supervised], pid_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    s = _run(started, run_dir, "--", *TRAINER, "leave-group", str(pid_dir))
    s.expect("^ready$")
    (helper,) = _pids(pid_dir)
    assert _alive(helper)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=30) == 75, s.err  # step 1 was committed during the stop
    assert not _alive(helper)
    assert list_checkpoints(FileStorage(run_dir)) == [1]
    assert f"terminated pids {helper}" in s.err


@pytest.mark.slow
def test_restart_waits_until_the_crashed_attempts_helpers_are_gone(
    tmp_path: Path, started: list[Supervised], pid_dir: Path
) -> None:
    s = _run(started, tmp_path / "run", "--", *TRAINER, "crash-leaving", str(pid_dir))
    assert s.wait(timeout=30) == 0, s.err
    (helper,) = _pids(pid_dir)
    assert s.stdout == [
        "attempt 1 left a helper and crashes",
        "attempt 2: leftover alive: no",
    ]
    assert not _alive(helper)


@pytest.mark.slow
def test_give_up_report_has_one_header_per_attempt_and_lines_in_order(
    tmp_path: Path, started: list[Supervised]
) -> None:
    s = _run(started, tmp_path / "run", "--max-restarts", "2", "--", *TRAINER, "interleave")
    assert s.wait(timeout=60) == 1, s.err
    report = s.err[s.err.index("Its last output, attempt by attempt:") :].splitlines()[1:]
    header = r"  --- attempt {n} \(pid \d+\): exit code 1 after \d+\.\d s ---"
    expected = []
    for n in (1, 2, 3):
        expected += [header.format(n=n), f"    out A{n}", f"    err B{n}", f"    out C{n}"]
    assert len(report) >= len(expected), s.err
    for pattern, line in zip(expected, report, strict=False):
        assert re.fullmatch(pattern, line), (pattern, line, s.err)


def test_readme_lists_exactly_the_variables_the_child_gets(tmp_path: Path) -> None:
    section = (REPO / "README.md").read_text().split("## Any trainer: `runner run`", 1)[1]
    table = section[: section.index("\n\n`RUNNER_MIRROR`")]  # up to the removed ones
    documented = set(re.findall(r"`(RUNNER_[A-Z_]+)`", table))
    removed = {"RUNNER_MIRROR", "RUNNER_METRICS_PORT", "RUNNER_NOTICES", "RUNNER_NOTICE_ENDPOINT"}
    script = "import os; print(' '.join(sorted(k for k in os.environ if k.startswith('RUNNER_'))))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")}
    # every training setting given, and supervisor-only ones in the environment
    env |= {"PYTHONPATH": str(REPO), "RUNNER_NOTICES": "off", "RUNNER_METRICS_PORT": "0"}
    env["RUNNER_MIRROR"] = (tmp_path / "bucket").as_uri()
    done = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--run-dir", str(tmp_path / "run"),
         "--steps", "9", "--ckpt-every", "3", "--ckpt-every-seconds", "60", "--keep", "2",
         "--grace-seconds", "5", "--seed", "7", "--", sys.executable, "-c", script],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # exit 1: the trainer finished with --mirror (from the environment) but no checkpoint
    assert done.returncode == 1 and "committed no checkpoint" in done.stderr, done.stderr
    got = set(done.stdout.split())
    assert got == documented, (got ^ documented, done.stdout)
    assert not got & removed


@pytest.mark.slow
def test_runner_child_committing_its_own_checkpoint_dir_on_stop_is_75(
    tmp_path: Path, started: list[Supervised]
) -> None:
    """A trainer that commits checkpoint directories itself (a runner child): the step it
    committed during the stop is the final checkpoint the supervisor names."""
    run_dir = tmp_path / "run"
    demo = [sys.executable, "-m", "runner", "demo", "--device", "cpu", "--threads", "1"]
    s = _run(
        started, run_dir, "--steps", "100000", "--ckpt-every", "100000", "--grace-seconds", "60",
        "--", *demo, "--no-progress",
    )  # fmt: skip
    loss = run_dir / "loss.jsonl"
    end = time.monotonic() + 120
    while not (loss.exists() and loss.read_text().count("\n") >= 3):
        assert time.monotonic() < end and s.proc.poll() is None, s.err
        time.sleep(0.1)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=120) == 75, s.err
    (step,) = list_checkpoints(FileStorage(run_dir))
    assert step >= 3
    assert f"final checkpoint: step {step}" in s.err, s.err


@pytest.mark.slow
def test_sweep_spares_processes_that_were_already_the_supervisors_children(
    tmp_path: Path, pid_dir: Path
) -> None:
    """Embedded in a process with children of its own (a test harness), the supervisor
    sweeps only what its trainer left behind."""
    from runner.config import RunConfig
    from runner.preemption.stop import StopController
    from runner.supervisor.supervise import Supervisor

    bystander = subprocess.Popen(["sleep", "600"])
    controller = StopController()
    try:
        with open(tmp_path / "child.log", "wb") as log:
            # a helper in the trainer's group, off its pipes, that ignores SIGTERM (a detached
            # one would escape: only `runner run` makes the process a child subreaper)
            leave = (
                '"$0" "$1" helper "$2" </dev/null >/dev/null 2>&1 & '
                'while [ ! -s "$2" ]; do sleep 0.05; done'
            )
            sup = Supervisor(
                ["sh", "-c", leave, *TRAINER, str(pid_dir / "pids")],
                config=RunConfig(run_dir=tmp_path / "run", max_restarts=0),
                controller=controller,
                scan_interval=0.05,
                stdout=log,
                stderr=log,
            )
            assert sup.run() == 0
        (helper,) = _pids(pid_dir)
        assert not _alive(helper)
        assert bystander.poll() is None  # still running
    finally:
        controller.close()
        bystander.kill()
        bystander.wait()


def _zombie_children(pid: int) -> list[int]:
    """Children of `pid` (any of its threads) that have exited and not been reaped."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    zombies = []
    for child in children:
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{child}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":
                zombies.append(child)
    return zombies


@pytest.mark.slow
def test_orphans_of_a_running_trainer_are_reaped_while_it_runs(
    tmp_path: Path, started: list[Supervised]
) -> None:
    """`os.system("true &")` 20 times: each `true` is re-parented to the runner (a child
    subreaper); none stays a zombie while the trainer keeps running."""
    s = _run(started, tmp_path / "run", "--", *TRAINER, "orphans", "20")
    s.expect("^ready$")
    trainer = int(re.search(r"started trainer pid (\d+)", s.err)[1])  # type: ignore[index]
    end = time.monotonic() + 10
    while zombies := _zombie_children(s.proc.pid):
        assert time.monotonic() < end, f"zombies of the runner: {zombies}"
        time.sleep(0.1)
    time.sleep(1.5)  # a few more reaping rounds: still none, and the trainer was spared
    assert _zombie_children(s.proc.pid) == []
    assert _alive(trainer)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=30) == 1, s.err  # killed by the forwarded SIGTERM, nothing committed
    assert "killed by SIGTERM" in s.err, s.err


def test_embedded_supervisor_spares_a_child_its_own_process_starts_during_the_attempt(
    tmp_path: Path,
) -> None:
    """A child the host process starts while the trainer runs (a credential_process of the
    mirror thread, say) is in the host's process group: not swept with the trainer's."""
    from runner.config import RunConfig
    from runner.preemption.stop import StopController
    from runner.supervisor.supervise import Supervisor

    gate = tmp_path / "gate"
    gate.mkdir()
    host_children: list[subprocess.Popen[bytes]] = []

    def host() -> None:
        end = time.monotonic() + 30
        while not (gate / "ready").exists() and time.monotonic() < end:
            time.sleep(0.02)
        host_children.append(subprocess.Popen(["sleep", "600"]))
        (gate / "go").touch()

    thread = threading.Thread(target=host, daemon=True)
    controller = StopController()
    try:
        with open(tmp_path / "child.log", "wb") as log:
            sup = Supervisor(
                [*TRAINER, "wait-go", str(gate)],
                config=RunConfig(run_dir=tmp_path / "run", max_restarts=0),
                controller=controller,
                scan_interval=0.05,
                stdout=log,
                stderr=log,
            )
            thread.start()
            assert sup.run() == 0
        thread.join(5)
        (bystander,) = host_children
        assert bystander.poll() is None  # neither signalled nor reaped
        assert os.getpgid(bystander.pid) == os.getpgrp()
    finally:
        controller.close()
        for child in host_children:
            child.kill()
            child.wait()


@pytest.mark.slow
def test_stop_with_a_stubborn_trainer_and_a_helper_on_its_pipes_ends_within_the_grace(
    tmp_path: Path, started: list[Supervised], pid_dir: Path
) -> None:
    """After the SIGKILL at the deadline, the helper that keeps the output pipes open is
    killed at once, not after a fixed drain and a second grace: `runner run` exits within
    --grace-seconds + 1.5 s of the SIGTERM (a pod is SIGKILLed soon after its grace)."""
    grace = 2.0
    s = _run(
        started, tmp_path / "run", "--grace-seconds", str(grace), "--",
        *TRAINER, "stubborn-pipes", str(pid_dir),
    )  # fmt: skip
    s.expect("^ready$")
    (helper,) = _pids(pid_dir)
    sent = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(timeout=30)
    took = time.monotonic() - sent
    assert s.wait() == code == 1, s.err  # killed at the deadline, nothing committed
    assert took < grace + 1.5, (took, s.err)
    assert not _alive(helper)
    assert "killed at the end of the grace period" in s.err
    assert f"terminated pids {helper}" in s.err


def test_fake_reused_or_emptied_trainer_group_is_not_matched(pid_dir: Path) -> None:
    """Fake: the trainer's group id taken by an unrelated session leader (a start time other
    than the recorded leader's), or a group seen empty, stops being matched for good."""
    from runner.supervisor.reap import Descendants

    # a session (and group) leader that is not our child: forked, then setsid
    leave = (
        "import os, sys, time\n"
        "if os.fork() > 0: os._exit(0)\n"
        "os.setsid()\n"
        "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
        "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", leave, str(pid_dir / "pids")])
    launcher.wait(10)
    end = time.monotonic() + 10
    while not _pids(pid_dir):
        assert time.monotonic() < end
        time.sleep(0.02)
    (leader,) = _pids(pid_dir)  # leads a session and group of its own; not our child
    assert os.getpgid(leader) == leader and os.getppid() != leader

    matched = Descendants()
    matched.set_group(leader)
    assert leader in matched.pids() and matched.group == leader  # the real leader

    reused = Descendants()
    reused.set_group(leader)
    reused._group_start = -1  # as if recorded from an earlier process with that pid
    assert leader not in reused.pids() and reused.group is None

    gone = subprocess.Popen(["true"])
    gone.wait()
    empty = Descendants()
    empty.set_group(gone.pid)  # no process left in that group
    assert empty.pids() == [] and empty.group is None
