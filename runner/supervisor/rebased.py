"""The mirror's side of a run re-based at a lower step (resumed at more ranks).

Under `runner run` the trainer has no mirror of its own: it re-bases its run dir
(runner/session/rebase.py) but cannot touch the bucket, which still holds the older lineage's
higher-numbered checkpoints. The supervisor finishes the job once the first checkpoint of the
new lineage (the candidate) is durable there: it de-commits the bucket's checkpoints numbered
above it whose samples_seen is <= its own (older states with higher numbers). Never one with
more samples; never before the candidate landed, so a failed upload leaves the bucket as it
was (the next attempt re-bases again). A stale checkpoint at the candidate's own step is
de-committed before its upload only when another checkpoint in the bucket holds at least its
state (nothing the bucket can resume from goes back).
"""

from __future__ import annotations

import logging

from runner.checkpoint.aside import decommit_remote
from runner.checkpoint.layout import manifest_key
from runner.checkpoint.listing import list_checkpoints, read_manifest_bytes
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import RunnerError, StorageNotFoundError
from runner.mirror.remote_layout import same_checkpoint
from runner.storage.base import Storage

log = logging.getLogger("runner.supervisor.supervise")

SUPERSEDED = "superseded-by-rescale"  # the reason runner.session.rebase gives its own


class RebaseFollower:
    """One re-base under way: `candidate` must land before the stale steps go."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.candidate: CommittedCheckpoint | None = None
        self.over: int = 0  # the step recorded before the re-base
        self.submitted = False

    @property
    def pending(self) -> bool:
        return self.candidate is not None

    def begin(self, ckpt: CommittedCheckpoint, *, over: int) -> None:
        if self.candidate is None:
            log.warning(
                "checkpoint step %d (%d samples) is newer than step %d: the run was re-based "
                "at a lower step; the mirror's older checkpoints numbered above it are "
                "de-committed once it is there",
                ckpt.step,
                ckpt.manifest.samples_seen,
                over,
            )
            self.over = over
        self.candidate = ckpt
        self.submitted = False

    def landed(self) -> bool:
        ckpt = self.candidate
        if ckpt is None:
            return False
        there = self._manifest(ckpt.step)
        return there is not None and same_checkpoint(there[0], ckpt.manifest)

    def settle(self) -> bool:
        """Once the candidate is in the mirror, de-commit the stale steps above it; whether
        the re-base is done."""
        ckpt = self.candidate
        if ckpt is None or not self.landed():
            return ckpt is None
        samples = ckpt.manifest.samples_seen
        try:
            for step in list_checkpoints(self.storage):
                there = self._manifest(step) if step > ckpt.step else None
                if there is None or not 0 < there[0].samples_seen <= samples:
                    continue
                log.warning(
                    "mirror: de-committing step %d (%d samples): older than the re-based "
                    "step %d (%d samples) now in %s",
                    step,
                    there[0].samples_seen,
                    ckpt.step,
                    samples,
                    self.storage.uri,
                )
                decommit_remote(self.storage, step, reason=SUPERSEDED, expected=there[1])
        except RunnerError as exc:
            log.warning(
                "mirror: stale checkpoints above step %d left committed: %s", ckpt.step, exc
            )
            return False
        self.candidate = None
        return True

    def clear_step(self, ckpt: CommittedCheckpoint) -> None:
        """Before `ckpt` is uploaded: a stale checkpoint at its step (fewer samples) would
        refuse it; de-committed when another checkpoint in the bucket holds at least its state."""
        try:
            there = self._manifest(ckpt.step)
            if there is None or same_checkpoint(there[0], ckpt.manifest):
                return
            stale = there[0].samples_seen
            if not 0 < stale < ckpt.manifest.samples_seen:
                return  # not older by progress: the upload's conflict says so
            others = [self._manifest(s) for s in list_checkpoints(self.storage) if s != ckpt.step]
            if not any(o is not None and o[0].samples_seen >= stale for o in others):
                return
            log.warning(
                "mirror: de-committing step %d (%d samples) to make room for the re-based "
                "step %d (%d samples)",
                ckpt.step,
                stale,
                ckpt.step,
                ckpt.manifest.samples_seen,
            )
            decommit_remote(self.storage, ckpt.step, reason=SUPERSEDED, expected=there[1])
        except RunnerError as exc:
            log.warning("mirror: step %d there left committed: %s", ckpt.step, exc)

    def _manifest(self, step: int) -> tuple[Manifest, bytes] | None:
        key = manifest_key(step)
        try:
            raw = read_manifest_bytes(self.storage, key)
            return Manifest.from_json(raw, source=f"{self.storage.uri}/{key}"), raw
        except StorageNotFoundError:
            return None
        except (RunnerError, ValueError):
            return None
