"""What a commit does when its step is already there: one policy for every commit path (a
save, a download, a resume from the mirror, an upload, a multi-node commit).

    the same state                    keep what is there, drop the duplicate
    fails verification                set it aside (never deleted), then commit
    another state that verifies,      a conflict: never replaced
    or one this runner cannot read

`judge` decides, given how to verify what is there; `LocalStep` applies the decision to a
step directory of a run dir (the rename's `on_existing`); the mirror applies it to a step in
a store (runner.mirror.upload.existing_copy). The wording of a conflict is the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from runner.atomicity.publish import Existing, publish_dir
from runner.checkpoint.aside import CORRUPT, set_aside_local
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import verify_dir
from runner.errors import IntegrityError, SchemaError

log = logging.getLogger(__name__)

SAME = "same"
CORRUPT_THERE = "corrupt"
UNREADABLE = "unreadable"
OTHER = "other"

Same = Callable[[Manifest, Manifest], bool]
"""`same(there, incoming)`: whether what is there holds what is being committed."""


@dataclass(frozen=True, kw_only=True)
class Found:
    """What a commit found under its step's name, judged against what it commits."""

    kind: str
    """SAME, CORRUPT_THERE, UNREADABLE (a schema this runner cannot read) or OTHER."""
    manifest: Manifest | None = None
    """What verified there (SAME, OTHER)."""
    error: IntegrityError | None = None
    """Why it did not (CORRUPT_THERE, UNREADABLE)."""


def same_state(there: Manifest, incoming: Manifest) -> bool:
    """The same training state (equal, non-empty fingerprints): two saves of one state may
    differ in bytes (a DCP index, a timestamp) and still be one checkpoint. Without a
    fingerprint (a trainer's own files, `files`) only the same bytes are the same state."""
    if not incoming.fingerprint:
        return same_payload(there, incoming)
    return there.fingerprint == incoming.fingerprint


def same_payload(there: Manifest, incoming: Manifest) -> bool:
    """The same state and the same payload files, byte for byte (a copy of one checkpoint)."""
    return there.fingerprint == incoming.fingerprint and there.files == incoming.files


def judge(check: Callable[[], Manifest], incoming: Manifest, *, same: Same) -> Found:
    """`check()` verifies what is there and returns its manifest (raising IntegrityError,
    SchemaError for a schema this runner cannot read); the other errors it raises (nothing
    there, a store that cannot be reached) pass through."""
    try:
        there = check()
    except SchemaError as exc:
        return Found(kind=UNREADABLE, error=exc)
    except IntegrityError as exc:
        return Found(kind=CORRUPT_THERE, error=exc)
    return Found(kind=SAME if same(there, incoming) else OTHER, manifest=there)


Refuse = Callable[[Path, Found], NoReturn]
"""Raises the caller's conflict for `final` (UNREADABLE or OTHER)."""


class LocalStep:
    """The policy applied to `RUN_DIR/checkpoints/step_N` when a staged directory is renamed
    into place (one object per commit). `kept`: the manifest of the same state found there;
    `replaced`: why a corrupt one was set aside, and where."""

    def __init__(
        self,
        incoming: Manifest,
        *,
        refuse: Refuse,
        same: Same = same_state,
        refused: tuple[Path, str] | None = None,
    ) -> None:
        self.incoming = incoming
        self._refuse = refuse
        self._same = same
        self._refused = refused
        self.kept: Manifest | None = None
        self.replaced: tuple[IntegrityError, Path] | None = None

    def publish(self, staged: Path, final: Path) -> Manifest:
        """Rename `staged` (fsynced, manifest inside) to `final` under the policy; the
        manifest now in place (the incoming one, or the same state's that was kept).

        `refused`: a path the caller already judged unusable (the resume walk refused that
        step locally and commits the mirror's copy instead) and the aside reason: it is set
        aside first, whatever it holds, without hashing it again."""
        if self._refused is not None:
            old, reason = self._refused
            if old.exists() or old.is_symlink():
                set_aside_local(final.parent.parent, old, reason=reason)
        if publish_dir(staged, final, on_existing=self):
            return self.incoming
        assert self.kept is not None  # publish_dir keeps only when the policy said KEEP
        return self.kept

    def __call__(self, final: Path) -> Existing:
        found = judge(lambda: verify_dir(final), self.incoming, same=self._same)
        if found.kind == SAME:
            log.info("%s already holds this state; discarding the duplicate", final)
            self.kept = found.manifest
            return Existing.KEEP
        if found.kind == CORRUPT_THERE:
            assert found.error is not None
            with suppress(FileNotFoundError):  # gone meanwhile: the rename is tried again
                aside = set_aside_local(final.parent.parent, final, reason=CORRUPT)
                self.replaced = (found.error, aside)
            return Existing.MOVED
        self._refuse(final, found)
