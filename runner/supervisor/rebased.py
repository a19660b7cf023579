"""The mirror's side of a run re-based at a lower step (resumed at more ranks).

Under `runner run` the trainer has no mirror of its own: it re-bases its run dir
(runner/session/rebase.py) but cannot touch the bucket, which still holds the older lineage's
higher-numbered checkpoints. The supervisor finishes the job in the order of
runner/mirror/superseded.py, the one the in-process re-base follows too: the older lineage's
checkpoints from the re-based step up are de-committed except the newest (it holds the state
until the re-based checkpoint is in), the re-based checkpoint (`base`: the trainer's, found in
the run dir) is uploaded before anything newer, and once it is in, the rest of the older
lineage numbered above it goes; only then do newer checkpoints follow. The trainer trains on
meanwhile: a stop before the re-based checkpoint landed uploads it first, within the stop's
deadline, then the final one; if it still is not in the mirror when the attempt ends, the
supervisor exits 1, not 0 or 75 (`unfinished`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from runner.checkpoint.layout import step_dir_name
from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.writer import CommittedCheckpoint, committed_steps
from runner.errors import RunnerError
from runner.mirror.remote_layout import same_checkpoint
from runner.mirror.superseded import after_landing, before_landing, older_lineage, read_held
from runner.storage.base import Storage

log = logging.getLogger("runner.supervisor.supervise")


class RebaseFollower:
    """One re-base under way in the mirror: `base` must land, then the stale steps go."""

    def __init__(self, storage: Storage, *, ckpt_dir: Path) -> None:
        self.storage = storage
        self.ckpt_dir = ckpt_dir
        self.base: CommittedCheckpoint | None = None  # the re-based checkpoint; None: none pending
        self.over: int = 0  # the step recorded before the re-base
        self.submitted = False  # an upload for this re-base is queued or under way
        self.sent: CommittedCheckpoint | None = None  # what that upload is
        self.settled = False  # the older lineage above the base is de-committed

    @property
    def pending(self) -> bool:
        return self.base is not None

    def begin(
        self, ckpt: CommittedCheckpoint, *, over: int, base: CommittedCheckpoint | None = None
    ) -> None:
        """`ckpt`, newer than the checkpoint numbered `over` recorded before it, has a lower
        step: a re-base. `base`: the trainer's re-based checkpoint when the run dir tells it
        (the supervisor may first see a later one), else `ckpt`. A later checkpoint of a
        re-base under way changes nothing: the base still goes first."""
        base = base or ckpt
        if self.base is not None and base.step >= self.base.step:
            return
        log.warning(
            "checkpoint step %d (%d samples) is newer than step %d: the run was re-based "
            "at step %d; it goes to the mirror first, then the mirror's older checkpoints "
            "numbered above it are de-committed",
            ckpt.step,
            ckpt.manifest.samples_seen,
            over,
            base.step,
        )
        self.base, self.over = base, max(over, self.over if self.base is not None else 0)
        self.submitted = self.settled = False
        self.sent = None

    def to_upload(self, newest: CommittedCheckpoint) -> CommittedCheckpoint:
        """What goes up first: the base while the run dir holds it and the mirror does not.
        Once the trainer's retention removed it, the newest checkpoint instead, or the newest
        one whose number no stale checkpoint holds (the one kept until something of the new
        lineage is in: the newest may be numbered like it)."""
        base = self.base
        if base is None or self.settled:
            return newest
        if base.path.is_dir():
            return newest if self.in_mirror(base) else base
        samples = base.manifest.samples_seen
        try:
            held = {h.step for h in older_lineage(self.storage, step=base.step, samples=samples)}
        except RunnerError:
            return newest
        if newest.step not in held:
            return newest
        for step in reversed(committed_steps(self.ckpt_dir)):
            path = self.ckpt_dir / step_dir_name(step)
            if step in held or step <= base.step:
                continue
            try:
                manifest = read_manifest_dir(path)
            except (OSError, RunnerError, ValueError):
                continue
            if manifest.samples_seen > samples:
                return CommittedCheckpoint(step=step, path=path, manifest=manifest)
        return newest

    def prepare(self) -> None:
        """Before an upload of the new lineage: the older lineage from the base up goes, but
        for its newest (runner.mirror.superseded.before_landing). Best effort: what stays
        refuses the upload at its step, or goes once the base is in."""
        base = self.base
        if base is None or self.settled:
            return
        try:
            before_landing(
                self.storage,
                step=base.step,
                samples=base.manifest.samples_seen,
                rebased=base.manifest,
            )
        except RunnerError as exc:
            log.warning("mirror: stale checkpoints from step %d left committed: %s", base.step, exc)

    def settle(self, by: CommittedCheckpoint | None = None) -> bool:
        """Once the base, or `by` (newer), is in the mirror, de-commit the older lineage
        numbered above the base (runner.mirror.superseded.after_landing); the re-base is
        over once that is done and the base is in the mirror (or gone from the run dir).
        Whether the stale steps are gone."""
        base = self.base
        if base is None:
            return True
        if not self.settled:
            samples = base.manifest.samples_seen
            held = (c for c in (base, by) if c is not None and c.manifest.samples_seen >= samples)
            if not any(self.in_mirror(c) for c in held):
                return False
            try:
                after_landing(self.storage, step=base.step, samples=samples)
            except RunnerError as exc:
                log.warning(
                    "mirror: stale checkpoints above step %d left committed: %s", base.step, exc
                )
                return False
            self.settled = True
        if not base.path.is_dir() or self.in_mirror(base):
            self.base = None
        return True

    def unfinished(self) -> str | None:
        """Why the re-base is not over in the mirror, None when it is (or none began)."""
        base = self.base
        if base is None:
            return None
        if not self.settled:
            return (
                f"the re-based checkpoint step {base.step} did not reach {self.storage.uri}, so "
                f"the older checkpoints numbered above it (up to step {self.over}) stay "
                "committed there"
            )
        return (
            f"the re-based checkpoint step {base.step} did not reach {self.storage.uri} (a "
            "newer one did, and the older checkpoints above it were de-committed); "
            f"`runner push {base.path.parent.parent} {self.storage.uri} --step {base.step}` "
            "uploads it"
        )

    def in_mirror(self, ckpt: CommittedCheckpoint) -> bool:
        try:
            there = read_held(self.storage, ckpt.step)
        except RunnerError:
            return False
        return there is not None and same_checkpoint(there.manifest, ckpt.manifest)


def rebased_from(ckpt_dir: Path, resumed: CommittedCheckpoint) -> CommittedCheckpoint | None:
    """The trainer's re-based checkpoint of `resumed`: the lowest-numbered one committed in
    `ckpt_dir` below it with its samples (the same state, renumbered); None when there is
    none (or `resumed` has no counters)."""
    samples = resumed.manifest.samples_seen
    if samples <= 0:
        return None
    for step in committed_steps(ckpt_dir):
        if step >= resumed.step:
            break
        path = ckpt_dir / step_dir_name(step)
        try:
            manifest = read_manifest_dir(path)
        except (OSError, RunnerError, ValueError):
            continue
        if manifest.samples_seen == samples:
            return CommittedCheckpoint(step=step, path=path, manifest=manifest)
    return None
