"""The one run lifecycle (runner/runtime/lifecycle.py) shared by TrainSession and `runner
run`: the resume resolver over the run dir ∪ a file:// mirror (refuse, never replace), the
resume report (metrics, steps lost, loss.jsonl marker and backfill, the log line), the one
deadline rule of a stop and the final upload's exit code. Real checkpoints (CheckpointWriter),
a real Mirror over FileStorage, a real RunnerMetrics registry."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import verify_dir
from runner.errors import (
    EXIT_FAILURE,
    EXIT_INTEGRITY,
    EXIT_OK,
    EXIT_PREEMPTED,
    PayloadNotLoadableError,
    StartupInterrupted,
    StorageError,
    UnusableCheckpointsError,
)
from runner.metrics.registry import RunnerMetrics
from runner.mirror import Mirror, upload_checkpoint
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import end_run, find_resume, report_resume, stop_deadline
from runner.state.counters import Counters
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import make_checkpoint, tree_hashes
from tests.fixtures.stalled_store import FakeStalledStore


@pytest.fixture
def stop() -> Iterator[StopController]:
    controller = StopController()
    yield controller
    controller.close()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def _corrupt(run_dir: Path, step: int) -> None:
    path = run_dir / "checkpoints" / f"step_{step:06d}" / "weights.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _read_weights(step_dir: Path, manifest: Manifest) -> bytes:
    return (step_dir / "weights.bin").read_bytes()


# -- the resolver ------------------------------------------------------------------------------


def test_local_newest_corrupt_is_refused_counted_and_the_older_one_loaded(
    tmp_path: Path, stop: StopController, registry: CollectorRegistry
) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 10)
    make_checkpoint(run_dir, 20)
    _corrupt(run_dir, 20)
    before = tree_hashes(run_dir / "checkpoints")
    metrics = RunnerMetrics(registry)
    point = find_resume(run_dir, stop=stop, load=_read_weights, metrics=metrics)
    assert point is not None
    assert point.step == 10 and point.manifest.step == 10
    assert point.step_dir == run_dir / "checkpoints" / "step_000010"
    assert point.checkpoint.path == point.step_dir
    assert point.loaded == (point.step_dir / "weights.bin").read_bytes()
    assert point.from_mirror is False
    assert _value(registry, "runner_checkpoint_failures_total", stage="verify") == 1.0
    assert tree_hashes(run_dir / "checkpoints") == before  # the corrupt one is not replaced


def test_verify_only_resolution_loads_nothing(tmp_path: Path, stop: StopController) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 7)
    point = find_resume(run_dir, stop=stop)
    assert point is not None and point.step == 7 and point.loaded is None


def test_a_checkpoint_load_refuses_is_skipped_for_the_next_older(
    tmp_path: Path, stop: StopController
) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 10)
    make_checkpoint(run_dir, 20)
    tried: list[int] = []

    def load(step_dir: Path, manifest: Manifest) -> int:
        tried.append(manifest.step)
        if manifest.step == 20:
            raise PayloadNotLoadableError("this runner cannot read it")
        return manifest.step

    point = find_resume(run_dir, stop=stop, load=load)
    assert point is not None and point.loaded == 10
    assert tried == [20, 10]


def test_nothing_anywhere_is_a_fresh_start(tmp_path: Path, stop: StopController) -> None:
    assert find_resume(tmp_path / "run", stop=stop, load=_read_weights) is None


def test_only_unusable_checkpoints_refuse_with_exit_3_and_change_nothing(
    tmp_path: Path, stop: StopController
) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 10)
    _corrupt(run_dir, 10)
    before = tree_hashes(run_dir)
    with pytest.raises(UnusableCheckpointsError, match="refusing to start") as caught:
        find_resume(run_dir, stop=stop, load=_read_weights)
    assert caught.value.exit_code == 3
    assert "step 10:" in str(caught.value)
    assert tree_hashes(run_dir) == before
    # --fresh-start sets it aside (kept, not deleted) and starts from scratch
    assert find_resume(run_dir, stop=stop, load=_read_weights, fresh_start=True) is None
    assert list_checkpoints(FileStorage(run_dir)) == []
    (aside,) = (run_dir / "aside").iterdir()
    assert aside.name.startswith("step_000010-") and aside.name.endswith("-corrupt")


def test_the_mirror_newer_checkpoint_is_downloaded_into_the_run_dir(
    tmp_path: Path, stop: StopController
) -> None:
    bucket = FileStorage(tmp_path / "bucket")
    source = tmp_path / "elsewhere"
    upload_checkpoint(bucket, make_checkpoint(source, 10).path, writer_id="pod-a")
    upload_checkpoint(bucket, make_checkpoint(source, 30).path, writer_id="pod-a")
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 10)
    mirror = Mirror(bucket, keep=2, writer_id="pod-b")
    point = find_resume(run_dir, stop=stop, mirror=mirror, load=_read_weights)
    assert point is not None and point.step == 30 and point.from_mirror is True
    assert point.step_dir == run_dir / "checkpoints" / "step_000030"
    assert verify_dir(point.step_dir).step == 30
    assert point.loaded == (source / "checkpoints" / "step_000030" / "weights.bin").read_bytes()


def test_a_stop_before_resolution_gives_it_up(tmp_path: Path, stop: StopController) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 10)
    stop.request_stop("SIGTERM")
    with pytest.raises(StartupInterrupted, match=r"stop requested \(SIGTERM\) before resume"):
        find_resume(run_dir, stop=stop, load=_read_weights)


# -- the resume report -------------------------------------------------------------------------


def _log_steps(run_dir: Path, steps: range) -> None:
    with LossLog(run_dir, attempt="earlier") as losses:
        for step in steps:
            losses.append(step, float(step))


def test_report_of_a_resume_counts_lost_steps_marks_them_and_backfills(
    tmp_path: Path,
    stop: StopController,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 5)
    _log_steps(run_dir, range(3, 9))  # 1 and 2 lost with an old disk, 6..8 past the checkpoint
    point = find_resume(run_dir, stop=stop)
    metrics = RunnerMetrics(registry)
    history = [0.5, 0.25, 3.0, 4.0, 5.0]  # what the checkpoint carries: steps 1..5
    with caplog.at_level(logging.INFO, logger="runner"), LossLog(run_dir, attempt="now") as log:
        lost = report_resume(
            point,
            run_dir=run_dir,
            loss_log=log,
            metrics=metrics,
            history=history,
            counters=Counters(step=5, samples_seen=40),
        )
    assert lost == 3
    assert LossLog(run_dir).read() == {1: 0.5, 2: 0.25, 3: 3.0, 4: 4.0, 5: 5.0}
    assert _value(registry, "runner_resumes_total") == 1.0
    assert _value(registry, "runner_steps_lost_total") == 3.0
    assert _value(registry, "runner_train_step") == 5.0
    assert _value(registry, "runner_checkpoint_last_step", location="local") == 5.0
    assert (
        f"resumed from {run_dir / 'checkpoints' / 'step_000005'} (step 5, 40 samples seen; "
        "3 logged steps after it are redone)"
    ) in caplog.text
    assert "loss.jsonl: restored 2 entries from the checkpoint" in caplog.text


def test_report_of_a_fresh_start_and_of_a_restart_from_scratch(
    tmp_path: Path, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = RunnerMetrics(registry)
    with caplog.at_level(logging.INFO, logger="runner"), LossLog(run_dir) as log:
        assert report_resume(None, run_dir=run_dir, loss_log=log, metrics=metrics) == 0
    assert f"no checkpoint to resume from in {run_dir}: starting at step 0" in caplog.text
    assert _value(registry, "runner_resumes_total") == 0.0  # a first start is no resume
    _log_steps(run_dir, range(1, 4))  # the first attempt crashed before any checkpoint
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"), LossLog(run_dir) as log:
        lost = report_resume(
            None, run_dir=run_dir, loss_log=log, metrics=metrics, attempt=2, announce=False
        )
    assert lost == 3
    assert _value(registry, "runner_resumes_total") == 1.0  # a restart is one, from scratch
    assert _value(registry, "runner_steps_lost_total") == 3.0
    assert LossLog(run_dir).read() == {}  # superseded by the marker
    assert "no checkpoint to resume from" not in caplog.text


def test_a_restart_reports_the_checkpoint_found_only_on_the_first_attempt(
    tmp_path: Path, stop: StopController
) -> None:
    run_dir = tmp_path / "run"
    make_checkpoint(run_dir, 5)
    point = find_resume(run_dir, stop=stop)
    found: list[int] = []

    class Recorded(RunnerMetrics):
        def checkpoint_found(self, *, location: str, step: int, created_at: float) -> None:
            found.append(step)
            super().checkpoint_found(location=location, step=step, created_at=created_at)

    metrics = Recorded(CollectorRegistry())
    for attempt in (1, 2):
        with LossLog(run_dir) as log:
            report_resume(point, run_dir=run_dir, loss_log=log, metrics=metrics, attempt=attempt)
    assert found == [5]


# -- the deadline and the end -------------------------------------------------------------------


def test_stop_deadline_is_the_requests_own_else_grace_from_the_first_arrival() -> None:
    now = [100.0]
    stop = StopController(clock=lambda: now[0])
    try:
        assert stop_deadline(stop, grace_seconds=30.0) is None  # no stop: no deadline
        stop.request_stop("in-process", at=90.0)
        now[0] = 120.0
        stop.request_stop("second")  # later arrival: the first one counts
        assert stop_deadline(stop, grace_seconds=30.0) == 120.0
        stop.request_stop("aws notice", deadline=150.0)
        stop.request_stop("SIGTERM", deadline=140.0)
        assert stop_deadline(stop, grace_seconds=30.0) == 140.0  # the earliest carried one
    finally:
        stop.close()


@pytest.mark.slow
def test_fake_stalled_store_a_stop_without_deadline_gets_the_grace_from_its_arrival(
    tmp_path: Path, stop: StopController
) -> None:
    store = FakeStalledStore(tmp_path / "bucket")
    mirror = Mirror(store, keep=2, writer_id="pod-a")
    ckpt = make_checkpoint(tmp_path / "run", 10)
    arrived = time.monotonic()
    stop.request_stop("in-process")  # no deadline of its own
    try:
        ending = end_run(mirror=mirror, ckpt=ckpt, stop=stop, grace_seconds=1.0, stopped=True)
        returned = time.monotonic()
    finally:
        store.release.set()
    assert ending.landed is False
    assert ending.exit_code == EXIT_PREEMPTED  # the final checkpoint is committed locally
    assert arrived + 1.0 - 0.1 <= returned <= arrived + 1.0 + 1.0, returned - arrived


@pytest.mark.slow
def test_fake_stalled_store_a_normal_finish_waits_for_the_upload_without_deadline(
    tmp_path: Path, stop: StopController
) -> None:
    store = FakeStalledStore(tmp_path / "bucket")
    mirror = Mirror(store, keep=2, writer_id="pod-a")
    ckpt = make_checkpoint(tmp_path / "run", 10)
    threading.Timer(1.5, store.release.set).start()
    started = time.monotonic()
    ending = end_run(mirror=mirror, ckpt=ckpt, stop=stop, grace_seconds=0.1, stopped=False)
    assert time.monotonic() - started >= 1.4  # far past the grace: a finish has no deadline
    assert ending.landed is True and ending.exit_code == EXIT_OK
    assert list_checkpoints(store) == [10]


@pytest.mark.slow
def test_fake_stalled_store_a_finish_with_a_stop_pending_gets_the_grace_too(
    tmp_path: Path, stop: StopController
) -> None:
    store = FakeStalledStore(tmp_path / "bucket")
    mirror = Mirror(store, keep=2, writer_id="pod-a")
    ckpt = make_checkpoint(tmp_path / "run", 10)
    arrived = time.monotonic()
    stop.request_stop("in-process")  # arrived as the run reached its target
    try:
        ending = end_run(mirror=mirror, ckpt=ckpt, stop=stop, grace_seconds=1.0, stopped=False)
        returned = time.monotonic()
    finally:
        store.release.set()
    assert ending.landed is False
    assert ending.exit_code == EXIT_FAILURE  # finished, its final checkpoint not mirrored
    assert arrived + 1.0 - 0.1 <= returned <= arrived + 1.0 + 1.0, returned - arrived


def test_exit_codes_of_the_ending(tmp_path: Path, stop: StopController) -> None:
    ckpt = make_checkpoint(tmp_path / "run", 10)
    mirror = Mirror(FileStorage(tmp_path / "bucket"), keep=2, writer_id="pod-a")
    ok = end_run(mirror=mirror, ckpt=ckpt, stop=stop, grace_seconds=5.0, stopped=False)
    assert (ok.exit_code, ok.landed) == (EXIT_OK, True)
    alone = end_run(mirror=None, ckpt=ckpt, stop=stop, grace_seconds=5.0, stopped=False)
    assert (alone.exit_code, alone.landed) == (EXIT_OK, None)
    stop.request_stop("SIGTERM", deadline=time.monotonic() + 5.0)
    nothing = end_run(mirror=mirror, ckpt=None, stop=stop, grace_seconds=5.0, stopped=True)
    assert (nothing.exit_code, nothing.landed) == (EXIT_PREEMPTED, None)
    lost = end_run(
        mirror=mirror, ckpt=ckpt, stop=stop, grace_seconds=5.0, stopped=True, final=False
    )
    assert (lost.exit_code, lost.landed) == (EXIT_FAILURE, True)
    refused = end_run(
        mirror=None,
        ckpt=None,
        stop=stop,
        grace_seconds=5.0,
        stopped=True,
        final=False,
        stopped_without_final=EXIT_INTEGRITY,
    )
    assert refused.exit_code == EXIT_INTEGRITY


def test_fake_unwritable_store_a_finish_whose_upload_fails_exits_1(
    tmp_path: Path, stop: StopController
) -> None:
    class FakeBrokenStore(FileStorage):
        def put_file(self, key: str, src: Path, **kw: object) -> None:
            raise StorageError(f"{self.uri}/{key}: cannot write: No space left on device")

    ckpt = make_checkpoint(tmp_path / "run", 10)
    mirror = Mirror(FakeBrokenStore(tmp_path / "bucket"), keep=2, writer_id="pod-a")
    ending = end_run(mirror=mirror, ckpt=ckpt, stop=stop, grace_seconds=5.0, stopped=False)
    assert (ending.exit_code, ending.landed) == (EXIT_FAILURE, False)
