"""After a resume that rescaled the step down (more ranks: step x N / M with M > N), the
checkpoints numbered from the new step up to the one resumed from are older than the state
now loaded, yet their numbers say newer: the next saves would collide with them ("already
exists and holds another state") and a later resume would pick the stale one.

So the run is re-based before it trains, in an order that keeps the newest state findable at
every instant (a crash anywhere resumes from the same state again), the order of
runner/mirror/superseded.py that `runner run` follows too:

1. the checkpoints numbered [new step, resumed step), older than the resumed one, are set
   aside locally (`aside/`, kept) and de-committed in the mirror (manifest copied aside);
2. the loaded state is committed at the new step (every rank: a normal save) and uploaded;
3. once it is in the mirror, the resumed step (and any other older one numbered above the
   new step) is de-committed there and set aside locally: its state now lives at the new
   step. If that fails the run exits 1 before training: the resumed step, still in the run
   dir, is resumed and re-based again.

Never deleted: set aside and de-committed checkpoints stay recoverable by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runner.checkpoint.aside import set_aside_local
from runner.checkpoint.layout import step_dir_name
from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.writer import CommittedCheckpoint, committed_steps
from runner.errors import RunnerError, StorageTransientError
from runner.mirror.superseded import SUPERSEDED, after_landing, before_landing, read_held

if TYPE_CHECKING:
    from runner.mirror import Mirror

log = logging.getLogger(__name__)


class RebaseIncomplete(StorageTransientError):
    """The re-based checkpoint did not reach the mirror: exit 1 before training (retry)."""


def rebase(
    *,
    new_step: int,
    resumed_step: int,
    run_dir: Path,
    ckpt_dir: Path,
    primary: bool,
    save: Callable[[], CommittedCheckpoint],
    mirror: Mirror | None,
    only_copy: bool = False,
) -> CommittedCheckpoint:
    """Steps 1-3 above; `save` commits the live state (collective: every rank calls rebase).
    Only the primary (`primary`) touches the run dir and the mirror. `only_copy`: the
    mirror holds the only copy (several nodes): its de-commits must succeed."""
    log_it = log.warning if primary else log.debug
    log_it(
        "the step was rescaled down (%d -> %d): checkpoints numbered %d..%d are older than "
        "this state; re-basing the run at step %d before training",
        resumed_step,
        new_step,
        new_step,
        resumed_step,
        new_step,
    )
    older = range(new_step, resumed_step)
    if primary:
        for step in committed_steps(ckpt_dir):
            if step in older:
                set_aside_local(run_dir, ckpt_dir / step_dir_name(step), reason=SUPERSEDED)
        if mirror is not None:
            _before_landing(mirror, new_step, resumed_step, ckpt_dir, strict=only_copy)
    committed = save()
    if primary:
        if mirror is not None and not mirror.upload_now(committed):
            # Training on would leave the mirror's stale step the newest there (and the local
            # one, set aside only below, would collide with this run's save of that step):
            # stop before training instead; a restart re-bases again (the save above is then
            # a duplicate of this one, discarded).
            raise RebaseIncomplete(
                f"the re-based checkpoint step {committed.step} could not be uploaded, so the "
                f"mirror's step {resumed_step} (an older state) would stay its newest: not "
                "training on; the next attempt re-bases again, nothing was lost"
            )
        if mirror is not None:
            _after_landing(mirror, committed)
        resumed = ckpt_dir / step_dir_name(resumed_step)
        if resumed.is_dir():
            set_aside_local(run_dir, resumed, reason=SUPERSEDED)
    return committed


def _before_landing(
    mirror: Mirror, new_step: int, resumed_step: int, ckpt_dir: Path, *, strict: bool
) -> None:
    """Step 1 in the mirror: its older checkpoints from `new_step` up, but for the newest
    (the resumed state, until the re-based one is in). Best effort: one left committed is
    de-committed in step 3 (or, at the new step itself, refuses the upload: exit 1).
    `strict` (the mirror is the only copy: several nodes, whose save commits in the mirror
    itself): a failure is RebaseIncomplete, before training."""
    try:
        samples = _samples_of(mirror, resumed_step, ckpt_dir)
        if samples is not None:
            before_landing(mirror.storage, step=new_step, samples=samples)
    except RunnerError as exc:
        if strict:
            raise RebaseIncomplete(
                f"the mirror's stale checkpoints from step {new_step} up could not be "
                f"de-committed ({exc}): not training on; the next attempt re-bases again, "
                "nothing was lost"
            ) from exc
        log.warning("mirror: stale checkpoints from step %d left committed: %s", new_step, exc)


def _after_landing(mirror: Mirror, committed: CommittedCheckpoint) -> None:
    """Step 3 in the mirror; a failure is RebaseIncomplete (exit 1 before training): a stale
    step left above the re-based one would be the mirror's newest by number."""
    try:
        after_landing(mirror.storage, step=committed.step, samples=committed.manifest.samples_seen)
    except RunnerError as exc:
        raise RebaseIncomplete(
            f"the re-based checkpoint step {committed.step} is in the mirror, but the older "
            f"checkpoints numbered above it could not be de-committed ({exc}): not training "
            "on; the next attempt re-bases again, nothing was lost"
        ) from exc


def _samples_of(mirror: Mirror, step: int, ckpt_dir: Path) -> int | None:
    """samples_seen of the checkpoint resumed from: the run dir's copy, else the mirror's
    (several nodes resume from the mirror alone)."""
    try:
        return read_manifest_dir(ckpt_dir / step_dir_name(step)).samples_seen
    except (OSError, RunnerError, ValueError):
        pass
    held = read_held(mirror.storage, step)
    if held is None:
        log.warning("mirror: step %d resumed from has no readable manifest anywhere", step)
        return None
    return held.manifest.samples_seen
