"""The end of a trainer that finished on its own (runner.supervisor.ending.finish_mirrored):
waiting for the mirror is unbounded on a normal finish, and bounded by the stop's deadline
when a stop arrived meanwhile. The mirror is a fake that records the wait it was given and
never becomes idle (a real store will not hang on cue)."""

from __future__ import annotations

import time
from pathlib import Path

from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import EXIT_OK
from runner.preemption.stop import StopController
from runner.supervisor.ending import finish_mirrored


class FakeNeverIdleMirror:
    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.upload_deadlines: list[float | None] = []

    def submit(self, ckpt: CommittedCheckpoint) -> None:
        raise AssertionError("nothing is submitted at the end")

    def upload_now(self, ckpt: CommittedCheckpoint, *, deadline: float | None = None) -> bool:
        self.upload_deadlines.append(deadline)
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return False


def _newest(tmp_path: Path) -> CommittedCheckpoint:
    # the fake mirror never reads the manifest
    return CommittedCheckpoint(step=3, path=tmp_path / "step_000003", manifest=None)  # type: ignore[arg-type]


def test_fake_never_idle_mirror_a_normal_finish_waits_without_a_limit(tmp_path: Path) -> None:
    mirror = FakeNeverIdleMirror()
    code = finish_mirrored(
        _newest(tmp_path), mirror=mirror, stop=StopController(), grace_seconds=5, run_dir=tmp_path
    )
    assert code == EXIT_OK
    assert mirror.waits == [None] and mirror.upload_deadlines == [None]


def test_fake_never_idle_mirror_a_stop_meanwhile_bounds_the_wait(tmp_path: Path) -> None:
    mirror = FakeNeverIdleMirror()
    stop = StopController()
    before = time.monotonic()
    stop.request_stop("SIGTERM", deadline=before + 30)
    code = finish_mirrored(
        _newest(tmp_path), mirror=mirror, stop=stop, grace_seconds=5, run_dir=tmp_path
    )
    assert code == EXIT_OK
    [waited] = mirror.waits
    assert waited is not None and 29 < waited <= 30
    [deadline] = mirror.upload_deadlines
    assert deadline is not None and 29 < deadline - before <= 30.1
