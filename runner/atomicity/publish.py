"""Publishing a staged directory: the one rename that makes it visible under its final name.

Two ways to make a multi-file write atomic, and where each is used:

- local disk: write everything under a temp name (runner.atomicity.temp) beside the final
  one, fsync it, then rename it into place and fsync the parent (this module). A crash
  before the rename leaves only the temp; after it, the whole new directory.
- object stores have no rename: the commit marker (the manifest) is written last, and until
  it exists the other objects do not count (runner.mirror.upload, runner.checkpoint.aside).

`rename` never replaces a non-empty directory, so a good checkpoint under the final name is
never overwritten here. What to do when one is there is the caller's decision (keep it, move
it aside, refuse): the checkpoint layer knows what "the same checkpoint" means, this does not.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from pathlib import Path

from runner.atomicity.files import fsync_dir
from runner.errors import RunnerError

# A concurrent writer of the same name may win the race again after the policy made room.
ATTEMPTS = 3


class Existing(enum.Enum):
    """What a publish policy did about the directory already under the final name."""

    KEEP = "keep"
    """It stays and the staged one is not published (the caller removes it)."""
    MOVED = "moved"
    """It was moved out of the way (or was gone already): try the rename again."""


OnExisting = Callable[[Path], Existing]
"""Called with the final path when the rename found something there; may also raise."""


def publish_dir(staged: Path, final: Path, *, on_existing: OnExisting | None = None) -> bool:
    """Rename the staged (already fsynced) directory to `final`, then fsync final's parent.

    True when the staged directory now has the final name; False when `on_existing` kept
    what was there. Without `on_existing` the rename's own error is raised when the name is
    taken. RunnerError when the name keeps getting taken after the policy made room."""
    for _ in range(ATTEMPTS):
        try:
            os.rename(staged, final)
        except OSError:
            if on_existing is None or not final.exists():
                raise
        else:
            fsync_dir(final.parent)
            return True
        if on_existing(final) is Existing.KEEP:
            return False
    raise RunnerError(f"could not commit {final}: another writer keeps replacing it")
