"""What the supervised trainer has committed so far: its seed files adopted as they appear
(metrics, mirror, retention), its step followed in loss.jsonl, the newest checkpoint, and the
newest step there was when a stop was forwarded (what a final checkpoint must be newer than).
"Newest" is by progress (runner/checkpoint/newest.py): a run re-based at a lower step (resumed
at more ranks) is followed, and its mirror's stale higher steps de-committed
(runner/supervisor/rebased.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runner.checkpoint.layout import parse_seed_bin
from runner.checkpoint.loss_log import LossFollower
from runner.checkpoint.newest import Progress, newer, newest_of
from runner.checkpoint.retention import prune
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED
from runner.storage.file import FileStorage
from runner.storage.retry import store_deadline
from runner.supervisor.adopt import Adopted, NotAdopted, SeedAdopter
from runner.supervisor.adopt_files import FilesAdopter
from runner.supervisor.ending import StopJudgement, judge_stop, last_logged_step, newest_committed
from runner.supervisor.hooks import MetricsHook, MirrorHook
from runner.supervisor.rebased import RebaseFollower, rebased_from

log = logging.getLogger("runner.supervisor.supervise")


class CommitTracker:
    def __init__(
        self,
        run_dir: Path,
        *,
        writer: CheckpointWriter,
        keep: int,
        mirror: MirrorHook | None,
        metrics: MetricsHook | None,
        files: FilesAdopter | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.ckpt_dir = writer.ckpt_dir
        self.keep = keep
        self.mirror = mirror
        self.metrics = metrics
        self.adopter = SeedAdopter(run_dir, writer=writer)
        self.files = files  # --adopt: the trainer's own checkpoints (adopt_files.py)
        self.last_checkpoint: CommittedCheckpoint | None = None
        # the newest step committed or waiting to be adopted when the stop was forwarded
        self.step_at_stop: int | None = None
        self.samples_at_stop = 0  # and its samples_seen (0: unknown, ordered by step)
        self.rebase = (
            RebaseFollower(mirror.storage, ckpt_dir=self.ckpt_dir) if mirror is not None else None
        )
        self._loss = LossFollower(run_dir)
        self._step_from_loss = False
        # steps adopted by this process: retention need not re-hash them
        self._known_good: set[int] = set()

    def seen(self, ckpt: CommittedCheckpoint) -> None:
        """`ckpt` (resumed from, or committed by a runner child itself) counts as the newest
        when it is newer (by progress) than every one seen so far."""
        self._take(ckpt)

    def _take(self, ckpt: CommittedCheckpoint) -> bool:
        """Record `ckpt` as the newest when it is; a lower step than the one recorded
        before is a re-base, followed in the mirror."""
        previous = self.last_checkpoint
        if not newer(ckpt, previous):
            return False
        self.last_checkpoint = ckpt
        if self.rebase is not None and previous is not None:
            over = self.rebase.over if self.rebase.pending else previous.step
            # the trainer's re-based checkpoint, even when this scan first sees a later one
            base = rebased_from(self.ckpt_dir, previous)
            if ckpt.step < over or base is not None:  # a re-base, or a checkpoint after one
                self.rebase.begin(ckpt, over=max(over, previous.step), base=base)
        return True

    def adopt(self, *, settled: bool, stopping: bool) -> list[Adopted]:
        """Adopt the trainer's seed files and, with --adopt, its own checkpoints (`settled`:
        it has exited, none is still being written); each is counted, pruned around and,
        unless `stopping`, mirrored."""
        adopted = self.adopter.scan(settled=settled)
        if self.files is not None:
            adopted += self.files.scan(settled=settled)
        for item in adopted:
            ckpt = item.checkpoint
            self.last_checkpoint = ckpt
            if self.metrics is not None and not self._step_from_loss:
                self.metrics.train_step(ckpt.step)  # the best we know without a loss log
            if self.metrics is not None:
                self.metrics.checkpoint_saved(
                    step=ckpt.step, duration_s=item.seconds, size_bytes=ckpt.manifest.total_bytes
                )
            if self.mirror is not None and not stopping:
                self.mirror.submit(ckpt)  # the final one is uploaded when the stop ends
        if adopted:
            prune(
                FileStorage(self.run_dir),
                keep=self.keep,
                newest_ok=adopted[-1].checkpoint.step,
                known_good=self._known_good,
            )
        if self.adopter.rejected and self.metrics is not None:
            for _ in self.adopter.rejected:
                self.metrics.checkpoint_failed("verify")
            self.adopter.rejected.clear()
        return adopted

    def follow_committed(self, *, stopping: bool) -> None:
        """A checkpoint dir the trainer committed itself (a runner child such as `runner
        demo`, or its ranks under torchrun: every rank's files under rank 0's manifest) counts
        as the newest once its manifest is in place and, unless `stopping`, is mirrored."""
        self._follow_rebase(stopping=stopping)
        newest = newest_committed(self.ckpt_dir)
        if newest is None or not self._take(newest):
            return
        if self.mirror is not None and not stopping:
            self._submit(newest)  # the final one is uploaded when the stop ends

    def _submit(self, ckpt: CommittedCheckpoint) -> None:
        """Mirror `ckpt`; during a re-base, its base first (runner/supervisor/rebased.py:
        until it landed, a newer one may collide with a stale step and must wait)."""
        assert self.mirror is not None
        rebase = self.rebase
        if rebase is None or not rebase.pending:
            self.mirror.submit(ckpt)
        elif not rebase.submitted:
            rebase.prepare()
            rebase.sent = rebase.to_upload(ckpt)
            self.mirror.submit(rebase.sent)
            rebase.submitted = True

    def _follow_rebase(self, *, stopping: bool) -> None:
        """While the mirror is idle: once the base landed the stale steps go and the newest
        checkpoint follows; a base that did not land is submitted again with the next."""
        rebase = self.rebase
        if rebase is None or not rebase.pending or not rebase.submitted or self.mirror is None:
            return
        if not self.mirror.wait_idle(0):
            return
        base, sent = rebase.base, rebase.sent
        if rebase.settle(by=sent) and not rebase.pending:
            newest = self.last_checkpoint
            landed = sent.step if sent is not None else None
            if newest is not None and newest.step != landed and not stopping:  # newer ones
                self.mirror.submit(newest)
            return
        step = base.step if base is not None else None
        log.warning(
            "mirror: re-based step %s did not reach the mirror; retried with the next", step
        )
        rebase.submitted = False

    @contextmanager
    def final_upload(
        self, ckpt: CommittedCheckpoint | None, *, deadline: float | None
    ) -> Iterator[None]:
        """Around the final upload of `ckpt` (runner.supervisor.ending): during a re-base its
        base goes first, within the stop's deadline (`ckpt` may collide with a stale step
        otherwise, and the stale steps above the base may go only once it is in), then
        `ckpt`, and once either is in, the stale steps. What is left undone makes the
        attempt exit 1 (`unless_rebase_unfinished`)."""
        rebase = self.rebase
        if rebase is None or self.mirror is None or ckpt is None or not rebase.pending:
            yield
            return
        self.mirror.wait_idle(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with store_deadline(deadline):
            rebase.settle(by=rebase.sent)  # it may have landed in the background
            if rebase.pending:
                rebase.prepare()  # also clears a stale step at `ckpt`'s own number
                first = rebase.to_upload(ckpt)
                if first.step != ckpt.step and self.mirror.upload_now(first, deadline=deadline):
                    rebase.settle(by=first)
        yield
        if rebase.pending:
            with store_deadline(deadline):
                rebase.settle(by=ckpt)

    def unless_rebase_unfinished(self, code: int) -> int:
        """`code`, or 1 instead of done (0) or safely stopped (75) while a re-base is
        unfinished in the mirror (runner/supervisor/rebased.py, `unfinished`)."""
        rebase = self.rebase
        why = rebase.unfinished() if rebase is not None else None
        if why is None or code not in (EXIT_OK, EXIT_PREEMPTED):
            return code
        log.error("exiting 1, not %d: %s", code, why)
        return EXIT_FAILURE

    def report_step(self) -> None:
        """The trainer's step, from its loss.jsonl when it keeps one."""
        step = self._loss.poll()
        if step is not None:
            self._step_from_loss = True
            if self.metrics is not None:
                self.metrics.train_step(step)

    def record_step_at_stop(self) -> None:
        # Recorded before the signal: a checkpoint newer than this was committed during
        # the stop. A seed file renamed into place but not adopted yet was written before it.
        committed = newest_committed(self.ckpt_dir)
        steps = [parse_seed_bin(p.name) for p in self.adopter.pending()]
        if self.files is not None:  # its matches not judged yet were written before it too
            steps += self.files.pending_steps()
        known = [Progress(step=s, samples=0) for s in steps if s is not None]
        known += [Progress.of(c) for c in (committed, self.last_checkpoint) if c is not None]
        newest = newest_of(known)
        self.step_at_stop = newest.step if newest is not None else None
        self.samples_at_stop = newest.samples if newest is not None else 0

    def judge_stop(self, *, code: int, killed: bool, mute_exit: bool = False) -> StopJudgement:
        """What stands now that the stopped trainer exited (runner.supervisor.ending), a
        checkpoint it committed itself (a runner child) included; `mute_exit`: its exit code
        says nothing of how it stopped (torchrun's, ending.judge_stop)."""
        newest = newest_committed(self.ckpt_dir)
        if newest is not None:
            self.seen(newest)
        return judge_stop(
            self.last_checkpoint,
            step_at_stop=self.step_at_stop,
            samples_at_stop=self.samples_at_stop,
            code=code,
            killed=killed,
            logged=last_logged_step(self.run_dir),
            unadopted_steps=[item.step for item in self._not_adopted()],
            mute_exit=mute_exit,
            # a trainer's own checkpoints (--adopt): its exit code says nothing of them
            exit_says_saved=self.files is None,
        )

    def raise_if_lost(self) -> None:
        """CheckpointNotAdoptedError when the trainer's newest checkpoint was rejected (or
        left open for writing) and nothing later was committed."""
        newest = self.last_checkpoint.step if self.last_checkpoint is not None else None
        self.adopter.raise_if_lost(newest)
        if self.files is not None:
            self.files.raise_if_lost(newest)

    def _not_adopted(self) -> list[NotAdopted]:
        items = list(self.adopter.not_adopted.values())
        return items + (list(self.files.not_adopted.values()) if self.files is not None else [])

    def nothing_stands(self) -> str:
        """What to say beside "no checkpoint stands": the trainer's own files that were not
        adopted, or how to have them adopted."""
        if self.files is None:
            return (
                "the next start begins from scratch, unless the trainer keeps checkpoints of "
                "its own (`runner run --adopt PATTERN` verifies and mirrors those)"
            )
        left = self.files.unadopted()
        if not left:
            return (
                f"nothing matched --adopt {' '.join(self.files.patterns)} in {self.files.root}: "
                "the next start begins from scratch"
            )
        return (
            f"the trainer's own {', '.join(left)} in {self.files.root} were not adopted "
            "(not verified, not mirrored); the trainer may still resume from them"
        )
