"""Where to resume from: the newest checkpoint that verifies, local or in the mirror."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from runner.checkpoint.layout import checkpoint_key
from runner.checkpoint.reader import list_checkpoints, newest_verified
from runner.errors import IntegrityError, StorageNotFoundError
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
    when the mirror has a newer one, downloaded (and verified) from it. A mirror checkpoint
    that fails verification is reported through `on_skip(step, why)` and the next older one is
    tried. None when nothing verifies anywhere.

    A mirror that cannot be reached raises (after retries) rather than falling back: starting
    from scratch because the bucket was briefly unreachable would silently throw work away."""
    run_dir = Path(run_dir)
    local = newest_verified(FileStorage(run_dir), on_skip=_tagged(on_skip, "local"))
    local_step = local.step if local is not None else -1
    if mirror is not None:
        for step in reversed(list_checkpoints(mirror)):
            if step <= local_step:
                break
            try:
                path = download_checkpoint(mirror, step, run_dir, progress=progress)
            except (IntegrityError, StorageNotFoundError) as exc:  # corrupt or incomplete
                why = f"{mirror.uri}: {exc}"
                log.warning("not resuming from mirror checkpoint step %d: %s", step, why)
                if on_skip is not None:
                    on_skip(step, why)
                continue
            log.info("resuming from step %d, downloaded from %s", step, mirror.uri)
            return path
    if local is None:
        return None
    log.info("resuming from local checkpoint step %d", local.step)
    return run_dir / checkpoint_key(local.step)


def _tagged(on_skip: SkipCallback | None, where: str) -> SkipCallback | None:
    if on_skip is None:
        return None

    def report(step: int, why: str) -> None:
        on_skip(step, f"{where}: {why}")

    return report
