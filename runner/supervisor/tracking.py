"""What the supervised trainer has committed so far: its seed files adopted as they appear
(metrics, mirror, retention), its step followed in loss.jsonl, the newest checkpoint, and the
newest step there was when a stop was forwarded (what a final checkpoint must be newer than)."""

from __future__ import annotations

from pathlib import Path

from runner.checkpoint.layout import parse_seed_bin
from runner.checkpoint.retention import prune
from runner.checkpoint.sidecars import LossFollower
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.storage.file import FileStorage
from runner.supervisor.adopt import Adopted, SeedAdopter
from runner.supervisor.ending import StopJudgement, judge_stop, last_logged_step, newest_committed
from runner.supervisor.hooks import MetricsHook, MirrorHook


class CommitTracker:
    def __init__(
        self,
        run_dir: Path,
        *,
        writer: CheckpointWriter,
        keep: int,
        mirror: MirrorHook | None,
        metrics: MetricsHook | None,
    ) -> None:
        self.run_dir = run_dir
        self.ckpt_dir = writer.ckpt_dir
        self.keep = keep
        self.mirror = mirror
        self.metrics = metrics
        self.adopter = SeedAdopter(run_dir, writer=writer)
        self.last_checkpoint: CommittedCheckpoint | None = None
        # the newest step committed or waiting to be adopted when the stop was forwarded
        self.step_at_stop: int | None = None
        self._loss = LossFollower(run_dir)
        self._step_from_loss = False
        # steps adopted by this process: retention need not re-hash them
        self._known_good: set[int] = set()

    def seen(self, ckpt: CommittedCheckpoint) -> None:
        """`ckpt` (resumed from, or committed by a runner child itself) counts as the newest
        when it is newer than every one seen so far."""
        if self.last_checkpoint is None or ckpt.step > self.last_checkpoint.step:
            self.last_checkpoint = ckpt

    def adopt(self, *, settled: bool, stopping: bool) -> list[Adopted]:
        """Adopt the trainer's seed files (`settled`: it has exited, none is still being
        written); each is counted, pruned around and, unless `stopping`, mirrored."""
        adopted = self.adopter.scan(settled=settled)
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
        newest = newest_committed(self.ckpt_dir)
        if newest is None:
            return
        if self.last_checkpoint is not None and newest.step <= self.last_checkpoint.step:
            return
        self.last_checkpoint = newest
        if self.mirror is not None and not stopping:
            self.mirror.submit(newest)  # the final one is uploaded when the stop ends

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
        known = [s for s in steps if s is not None]
        if committed is not None:
            known.append(committed.step)
        if self.last_checkpoint is not None:
            known.append(self.last_checkpoint.step)
        self.step_at_stop = max(known, default=None)

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
            code=code,
            killed=killed,
            logged=last_logged_step(self.run_dir),
            unadopted_steps=[item.step for item in self.adopter.not_adopted.values()],
            mute_exit=mute_exit,
        )

    def raise_if_lost(self) -> None:
        """CheckpointNotAdoptedError when the trainer's newest checkpoint was rejected (or
        left open for writing) and nothing later was committed."""
        newest = self.last_checkpoint.step if self.last_checkpoint is not None else None
        self.adopter.raise_if_lost(newest)
