"""After a resume that rescaled the step down (more ranks: step x N / M with M > N), the
checkpoints numbered from the new step up to the one resumed from are older than the state
now loaded, yet their numbers say newer: the next saves would collide with them ("already
exists and holds another state") and a later resume would pick the stale one.

So the run is re-based before it trains, in an order that keeps the newest state findable at
every instant (a crash anywhere resumes from the same state again):

1. the checkpoints numbered [new step, resumed step), older than the resumed one, are set
   aside locally (`aside/`, kept) and de-committed in the mirror (manifest copied aside);
2. the loaded state is committed at the new step (every rank: a normal save) and uploaded;
3. once it is in the mirror, the resumed step is de-committed there and set aside locally:
   its state now lives at the new step.

Never deleted: set aside and de-committed checkpoints stay recoverable by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runner.checkpoint.aside import decommit_remote, set_aside_local
from runner.checkpoint.layout import step_dir_name
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.writer import CommittedCheckpoint, committed_steps
from runner.errors import RunnerError, StorageError, StorageTransientError

if TYPE_CHECKING:
    from runner.mirror import Mirror

log = logging.getLogger(__name__)

SUPERSEDED = "superseded-by-rescale"


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
    """Steps 1-4 above; `save` commits the live state (collective: every rank calls rebase).
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
            _decommit_remote(mirror, older, strict=only_copy)
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
            _decommit_remote(mirror, range(resumed_step, resumed_step + 1), strict=only_copy)
        resumed = ckpt_dir / step_dir_name(resumed_step)
        if resumed.is_dir():
            set_aside_local(run_dir, resumed, reason=SUPERSEDED)
    return committed


def _decommit_remote(mirror: Mirror, steps: range, *, strict: bool = False) -> None:
    """De-commit the mirror's checkpoints numbered in `steps` (best effort: one left
    committed is older than the state that follows and is re-based by a later attempt).
    `strict` (the mirror is the only copy: several nodes): a failure is RebaseIncomplete,
    before training, since a stale step left newest there would be resumed and re-based
    again over the newer work."""
    try:
        for step in list_checkpoints(mirror.storage):
            if step in steps:
                decommit_remote(mirror.storage, step, reason=SUPERSEDED)
    except (StorageError, RunnerError) as exc:
        if strict:
            raise RebaseIncomplete(
                f"the mirror's stale checkpoints {steps.start}..{steps.stop - 1} could not be "
                f"de-committed ({exc}): not training on; the next attempt re-bases again, "
                "nothing was lost"
            ) from exc
        log.warning("mirror: stale checkpoints %s left committed: %s", steps, exc)
