"""What a session does around each of its saves, and what it keeps about them.

The checkpointer (runner.session.checkpointer) calls these, in this order, once a save is
committed: `committed` (the newest checkpoint, metrics, the log line), `prune_local`
(retention, never fails a run), `hand_off` (the mirror); and before the commit, on a failure,
`failed` (counted; an OSError becomes the error that says what stands) and, on a full disk,
`make_room`. With a background saver they run on the saver's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.checkpoint.layout import CHECKPOINTS_DIR
from runner.checkpoint.room import Room, make_room
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.config import RunConfig
from runner.errors import RunnerError
from runner.metrics.registry import RunnerMetrics
from runner.runtime.rank import RankContext
from runner.session.attempts import SessionAttempt
from runner.session.capture import Snapshot
from runner.session.checkpointer import Checkpointer
from runner.session.placement import Placement
from runner.session.reporting import write_error
from runner.storage.file import FileStorage

if TYPE_CHECKING:
    from runner.mirror import Mirror

# the session's lines keep one logger name (tests/e2e/test_readme_example.py pins it)
log = logging.getLogger("runner.session.train_session")


class Saves:
    """The session's record of its checkpoints and the callbacks around each save."""

    def __init__(
        self,
        config: RunConfig,
        *,
        rank: RankContext,
        placement: Placement,
        metrics: RunnerMetrics | None,
        mirror: Mirror | None,
        attempt: SessionAttempt | None = None,
    ) -> None:
        self.config = config
        self.attempt = attempt
        self.rank = rank
        self.placement = placement
        self.metrics = metrics
        self.mirror = mirror
        self.run_dir = Path(config.run_dir)
        self.background = config.save_mode == "async"
        self.last: CommittedCheckpoint | None = None  # the newest committed by this process
        self.resumed_from: int | None = None  # the step this process resumed from
        # steps committed or resumed from by this process: retention need not re-hash them
        self.known_good: set[int] = set()

    def checkpointer(
        self, writer: CheckpointWriter, *, before_capture: Callable[[], None]
    ) -> Checkpointer:
        """The session's checkpointer, calling these around each save; a background saver
        with host buffers (runner.state.host_copy) in async mode."""
        saving: dict[str, Any] = {}
        if self.background:
            from runner.session.background import BackgroundSaver
            from runner.state.host_copy import HostBuffers

            saving = {"saver": BackgroundSaver, "snapshot_to": HostBuffers()}
        return Checkpointer(
            writer,
            on_commit=self.committed,
            retention=self.prune_local,
            hand_off=self.hand_off,
            before_capture=before_capture,
            on_failure=self.failed,
            make_room=self.make_room,
            placement=self.placement,
            **saving,
        )

    def loss_log_failed(self) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_failed("loss_log")

    def resumed(self, step: int) -> None:
        self.resumed_from = step
        self.known_good.add(step)

    def failed(self, exc: Exception, step: int) -> Exception:
        """A save of step `step` that failed before its commit: counted; an OSError becomes
        the CheckpointWriteError that says what stands and what to do (a RunnerError stays)."""
        if self.metrics is not None:
            self.metrics.checkpoint_failed("save")
        if not isinstance(exc, OSError):
            return exc
        previous = self.last.step if self.last else self.resumed_from
        ckpt_dir = self.run_dir / CHECKPOINTS_DIR
        return write_error(exc, step=step, ckpt_dir=ckpt_dir, previous=previous)

    def committed(self, committed: CommittedCheckpoint, snapshot: Snapshot) -> None:
        """Bookkeeping once a save is committed, before retention and the mirror see it."""
        duration = time.monotonic() - snapshot.captured_at
        self.last = committed
        self.known_good.add(committed.step)
        if self.metrics is not None:
            self.metrics.checkpoint_saved(
                step=snapshot.step, duration_s=duration, size_bytes=committed.manifest.total_bytes
            )
        if self.attempt is not None:
            self.attempt.committed(
                step=snapshot.step,
                samples=committed.manifest.samples_seen,
                reason=snapshot.reason,
                seconds=duration,
                background_seconds=duration if self.background else None,
            )
        if self.rank.acts_as_primary:
            log.info(
                "checkpoint step %d committed in %.2fs (%s, %.1f MB%s, %s)",
                snapshot.step,
                duration,
                snapshot.reason,
                committed.manifest.total_bytes / 1e6,
                f", {committed.manifest.world_size} ranks" if self.placement.several_ranks else "",
                f"async, copied in {snapshot.copy_seconds * 1e3:.0f} ms"
                if self.background
                else "sync",
            )

    def hand_off(self, committed: CommittedCheckpoint, snapshot: Snapshot) -> None:
        # the final and stop checkpoints go up in finish(), within the deadline
        if self.mirror is not None and snapshot.reason not in ("final", "stop"):
            self.mirror.submit(committed)

    def prune_local(self) -> None:
        from runner.checkpoint.retention import prune

        if not self.rank.acts_as_primary:
            return  # one pruner: the primary, once the ranks' commit of every part is done
        try:
            prune(
                FileStorage(self.run_dir),
                keep=self.config.keep,
                protect=self._in_flight(),
                known_good=self.known_good,
            )
        except (OSError, RunnerError) as exc:  # retention must never fail a run
            log.warning("local retention skipped: %s", exc)

    def make_room(self) -> Room | None:
        """A save found the disk full: delete the oldest usable checkpoint older than the
        newest verified one, so that the retry fits (on the saver's thread, like retention).
        Asked only where the placement makes room (one process: the ranks of a multi-rank
        commit would all have to agree)."""
        if not self.rank.acts_as_primary:
            return None
        storage = FileStorage(self.run_dir)
        return make_room(storage, protect=self._in_flight(), known_good=self.known_good)

    def _in_flight(self) -> set[int]:
        return self.mirror.in_flight_steps() if self.mirror is not None else set()
