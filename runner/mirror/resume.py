"""Where to resume from: the newest checkpoint that verifies, local or in the mirror."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from runner.checkpoint.layout import checkpoint_key
from runner.checkpoint.reader import list_checkpoints, verify_dir
from runner.errors import IntegrityError, RunnerError, StorageNotFoundError
from runner.mirror.download import download_checkpoint
from runner.storage.base import ProgressCallback, Storage
from runner.storage.file import FileStorage

log = logging.getLogger(__name__)

SkipCallback = Callable[[int, str], None]


def resolve_resume(
    run_dir: Path,
    mirror: Storage | None,
    *,
    on_skip: SkipCallback | None = None,
    progress: ProgressCallback | None = None,
) -> Path | None:
    """The local directory of the newest checkpoint that verifies, taken from the run dir or,
    when the mirror has a newer one, downloaded (and verified as it arrives) from it. A
    checkpoint that fails verification, local or remote, is reported through
    `on_skip(step, why)` and the next older one is tried. None when nothing verifies anywhere.
    The directory returned was hashed moments ago: `load_state(..., verified=True)` may skip
    the second pass.

    A mirror that cannot be reached raises (after retries) rather than falling back: starting
    from scratch because the bucket was briefly unreachable would silently throw work away."""
    run_dir = Path(run_dir)
    local_steps = set(list_checkpoints(FileStorage(run_dir)))
    remote_steps = set(list_checkpoints(mirror)) if mirror is not None else set()
    # Newest first over both places; each candidate is hashed once (a local one in place, a
    # remote one as it downloads), and nothing older than the chosen one is touched.
    for step in sorted(local_steps | remote_steps, reverse=True):
        if step in local_steps:
            try:
                # the local-directory check: symlinks resolved, files hashed in parallel
                verify_dir(run_dir / checkpoint_key(step))
            except RunnerError as exc:
                _skip(on_skip, step, f"local: {exc}")
            else:
                log.info("resuming from local checkpoint step %d", step)
                return run_dir / checkpoint_key(step)
        if mirror is not None and step in remote_steps:
            try:
                path = download_checkpoint(mirror, step, run_dir, progress=progress)
            except (IntegrityError, StorageNotFoundError) as exc:  # corrupt or incomplete
                _skip(on_skip, step, f"{mirror.uri}: {exc}")
                continue
            log.info("resuming from step %d, downloaded from %s", step, mirror.uri)
            return path
    return None


def _skip(on_skip: SkipCallback | None, step: int, why: str) -> None:
    log.warning("not resuming from checkpoint step %d: %s", step, why)
    if on_skip is not None:
        on_skip(step, why)
