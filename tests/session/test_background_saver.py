"""BackgroundSaver on its own, with a persist that fails on purpose (a fake: it writes nothing):
one save in flight, every failure reported exactly once, to whoever asks first."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.writer import CheckpointMeta, CommittedCheckpoint
from runner.session.background import BackgroundSaver
from runner.session.checkpointer import Snapshot
from runner.system.priority import BACKGROUND_NICE


def _snapshot(step: int) -> Snapshot:
    meta = CheckpointMeta(
        step=step, samples_seen=step, world_size=1, epoch=0, batch_in_epoch=step, fingerprint=""
    )
    return Snapshot(payload={}, meta=meta, captured_at=0.0)


class _FakePersist:
    """Fails the steps in `failing`, returns a stand-in for the others; `gate` holds a save
    in flight until the test lets it go."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing
        self.gate = threading.Event()
        self.gate.set()
        self.persisted: list[int] = []

    def __call__(self, snapshot: Snapshot) -> Any:
        self.gate.wait(timeout=30)
        self.persisted.append(snapshot.step)
        if snapshot.step in self.failing:
            raise OSError(28, f"No space left on device (step {snapshot.step})")
        return f"committed {snapshot.step}"


def test_fake_failure_replaced_by_the_next_save_before_anyone_asked_is_still_reported() -> None:
    persist = _FakePersist(failing={1})
    saver = BackgroundSaver(persist)  # type: ignore[arg-type]
    try:
        saver.save(_snapshot(1))
        assert saver.wait_for_saving() is None  # ended with a failure: not raised here
        saver.save(_snapshot(2))  # the loop's next save replaces the failed one
        saver.wait_for_saving()
        failure = saver.take_failure()
        assert failure is not None
        step, exc = failure
        assert (step, type(exc), str(exc)) == (
            1,
            OSError,
            "[Errno 28] No space left on device (step 1)",
        )
        assert saver.take_failure() is None  # once
        assert saver.wait_for_saving() == "committed 2"
    finally:
        saver.close()
    assert persist.persisted == [1, 2]


def test_fake_failure_is_not_reported_while_the_save_runs_and_result_claims_it() -> None:
    persist = _FakePersist(failing={3})
    saver = BackgroundSaver(persist)  # type: ignore[arg-type]
    try:
        persist.gate.clear()
        pending = saver.save(_snapshot(3))
        assert saver.in_flight and saver.take_failure() is None  # still running: no failure yet
        persist.gate.set()
        with pytest.raises(OSError, match="step 3"):
            pending.result()
        assert saver.take_failure() is None  # result() claimed it: not reported twice
    finally:
        saver.close()


def test_fake_unclaimed_failure_is_logged_at_close(caplog: pytest.LogCaptureFixture) -> None:
    saver = BackgroundSaver(_FakePersist(failing={5}))  # type: ignore[arg-type]
    saver.save(_snapshot(5))
    saver.close()
    assert "checkpoint step 5 was not committed: [Errno 28] No space left on device (step 5)" in (
        caplog.text
    )


def test_at_most_one_save_in_flight() -> None:
    persist = _FakePersist(failing=set())
    saver = BackgroundSaver(persist)  # type: ignore[arg-type]
    try:
        persist.gate.clear()
        saver.save(_snapshot(1))
        second = threading.Thread(target=saver.save, args=(_snapshot(2),))
        second.start()
        second.join(timeout=0.3)
        assert second.is_alive() and persist.persisted == []  # waits for the first to end
        persist.gate.set()
        second.join(timeout=30)
        committed: CommittedCheckpoint | None = saver.wait_for_saving()
        assert committed == "committed 2"  # type: ignore[comparison-overlap]
    finally:
        saver.close()
    assert persist.persisted == [1, 2]


def test_a_signal_handler_raising_while_waiting_for_the_save_in_flight_propagates() -> None:
    """A real signal whose handler raises (SIGINT's KeyboardInterrupt, a handler's sys.exit)
    during the wait must not return as if the save had ended: the next capture would
    overwrite host buffers the save is still reading."""
    import os
    import signal

    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    persist = _FakePersist(failing=set())
    saver = BackgroundSaver(persist)  # type: ignore[arg-type]
    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        persist.gate.clear()
        saver.save(_snapshot(1))
        threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(Interrupted):
            saver.wait_for_saving()
        assert saver.in_flight  # it really was still running
    finally:
        signal.signal(signal.SIGUSR2, previous)
        persist.gate.set()
        saver.close()
    assert persist.persisted == [1]


def test_fake_background_failure_that_is_not_a_write_error_ends_the_run_at_the_next_step(
    tmp_path: Path,
) -> None:
    """A write error (disk full) lets training go on; anything else (a bug, an object that
    cannot be saved, a lost peer) is raised at the next step boundary, as a sync save raises
    it: not a run that trains on without checkpoints."""
    from runner.session.train_session import TrainSession
    from tests.fixtures.train_loop import config, new_state, train_step

    cfg = config(tmp_path, mirror=False, ckpt_every=2, save_mode="async")
    state = new_state()
    session = TrainSession(cfg, state=state)
    try:
        session.restore()
        real = session.writer.write_state

        def write_state(payload: dict[str, Any], *, meta: CheckpointMeta) -> CommittedCheckpoint:
            if meta.step == 2:
                raise RuntimeError("a bug in the payload")
            return real(payload, meta=meta)

        session.writer.write_state = write_state  # type: ignore[method-assign]
        train_step(state)
        session.step_done()
        train_step(state)
        session.step_done()  # step 2's save starts in the background
        session.checkpointer.wait_for_saving()
        train_step(state)
        with pytest.raises(RuntimeError, match="a bug in the payload"):
            session.step_done()
    finally:
        session.close()


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_periodic_saves_persist_at_a_lower_priority_and_the_final_save_does_not() -> None:
    """Real threads, real nice values: a periodic save's thread and the threads it starts
    (the writer's hashing threads) run 10 lower than the loop; a stop's or the run's final
    save runs at the loop's own priority."""
    seen: dict[int, tuple[int, int]] = {}

    def persist(snapshot: Snapshot) -> Any:
        helper: list[int] = []
        started = threading.Thread(target=lambda: helper.append(_nice()))
        started.start()
        started.join()
        seen[snapshot.step] = (_nice(), helper[0])
        return f"committed {snapshot.step}"

    def snapshot(step: int, reason: str) -> Snapshot:
        snap = _snapshot(step)
        snap.meta.extra["reason"] = reason
        return snap

    loop = _nice()
    saver = BackgroundSaver(persist)  # type: ignore[arg-type]
    try:
        for step, reason in [(1, "steps"), (2, "seconds"), (3, "stop"), (4, "final")]:
            saver.save(snapshot(step, reason)).result()
    finally:
        saver.close()
    lower = min(19, loop + BACKGROUND_NICE)
    assert seen == {1: (lower, lower), 2: (lower, lower), 3: (loop, loop), 4: (loop, loop)}
    assert _nice() == loop  # the loop's own thread is untouched
