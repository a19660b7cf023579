"""Checkpoints of a supervised trainer: adopt the seed `.bin` files it writes, and find the
one to hand back on resume.

A trainer in any language writes `step_NNNNNN.bin` (seed format, temp name then rename) into
RUNNER_CKPT_DIR. Each file is checked (size = 8 + 12·n, header step = file name step), then
moved into `checkpoints/step_NNNNNN/` with a manifest by the checkpoint writer. A file that
fails the check is renamed `<name>.rejected` beside it: kept for inspection, never adopted,
never handed back.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.checkpoint.layout import (
    CHECKPOINTS_DIR,
    checkpoint_key,
    parse_seed_bin,
    seed_bin_name,
)
from runner.checkpoint.manifest import FORMAT_SEED_BIN, Manifest
from runner.checkpoint.reader import newest_verified, read_manifest_dir
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.errors import IntegrityError
from runner.storage.file import FileStorage

log = logging.getLogger(__name__)

REJECTED_SUFFIX = ".rejected"
# Looks like a seed checkpoint but with a step of fewer than six digits (`step_40.bin`):
# never adopted (the name does not follow the format), but the trainer's author must hear why.
_SHORT_SEED_BIN = re.compile(r"^step_\d{1,5}\.bin$")


@dataclass(frozen=True, kw_only=True)
class Adopted:
    checkpoint: CommittedCheckpoint
    seconds: float
    """Time spent checking, hashing and committing it."""


class SeedAdopter:
    """Scans the checkpoint directory for seed files and commits them, oldest first."""

    def __init__(self, run_dir: Path, *, writer: CheckpointWriter) -> None:
        self.ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
        self.writer = writer
        self.rejected: list[Path] = []
        self._last_seen: dict[str, tuple[int, int]] = {}
        self._misnamed_warned: set[str] = set()

    def pending(self) -> list[Path]:
        """Seed files waiting in the checkpoint directory, in step order."""
        if not self.ckpt_dir.is_dir():
            return []
        found = []
        for entry in self.ckpt_dir.iterdir():
            step = parse_seed_bin(entry.name)
            if step is not None and entry.is_file():
                found.append((step, entry))
            elif _SHORT_SEED_BIN.match(entry.name):
                self._warn_misnamed(entry)
        return [path for _, path in sorted(found)]

    def _warn_misnamed(self, path: Path) -> None:
        if path.name in self._misnamed_warned:
            return
        self._misnamed_warned.add(path.name)
        log.warning(
            "ignoring %s: seed checkpoints must be named step_NNNNNN.bin (six digits or "
            "more, e.g. %s); write it under that name to have it adopted",
            path,
            seed_bin_name(int(path.name[len("step_") : -len(".bin")])),
        )

    def scan(self, *, settled: bool) -> list[Adopted]:
        """Adopt every seed file present. While the trainer runs (`settled=False`) a file is
        only judged once it looks the same (size, mtime) on two scans in a row, so one that a
        non-conforming trainer is still writing in place is not rejected half-written."""
        adopted = []
        for path in self.pending():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            signature = (st.st_size, st.st_mtime_ns)
            if not settled and self._last_seen.get(path.name) != signature:
                self._last_seen[path.name] = signature
                continue
            self._last_seen.pop(path.name, None)
            result = self.adopt(path)
            if result is not None:
                adopted.append(result)
        return adopted

    def adopt(self, path: Path) -> Adopted | None:
        """Check and commit one seed file; None (and the file set aside) when it is bad."""
        from runner.checkpoint import seedbin  # imports torch: only once a trainer saves

        start = time.monotonic()
        try:
            seedbin.read_header(path)
            checkpoint = seedbin.adopt_seed_bin(
                self.writer, path, copy=False, extra={"adopted_by": "runner run"}
            )
        except IntegrityError as exc:
            self._reject(path, str(exc))
            return None
        seconds = time.monotonic() - start
        log.info(
            "adopted trainer checkpoint step %d (%d bytes) in %.2f s",
            checkpoint.step,
            checkpoint.manifest.total_bytes,
            seconds,
        )
        return Adopted(checkpoint=checkpoint, seconds=seconds)

    def _reject(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + REJECTED_SUFFIX)
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            return
        self.rejected.append(aside)
        log.error(
            "rejected trainer checkpoint %s: %s. It was NOT adopted and will not be resumed "
            "from; kept as %s",
            path.name,
            why,
            aside,
        )


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    step: int
    step_dir: Path
    payload: Path
    """What RUNNER_RESUME_FROM names: the seed .bin, the single payload file, or the dir."""
    manifest: Manifest


SkipCallback = Callable[[int, str], None]
ResolveResume = Callable[[Path, SkipCallback | None], Path | None]


def find_resume(
    run_dir: Path, *, resolve: ResolveResume | None = None, on_skip: SkipCallback | None = None
) -> ResumePoint | None:
    """The newest checkpoint that verifies, or None. `resolve(run_dir, on_skip)` may return
    the local step directory to use (e.g. downloaded from the mirror); otherwise the run dir
    is scanned. Each newer checkpoint that fails verification goes to `on_skip(step, why)`."""
    run_dir = Path(run_dir)
    if resolve is not None:
        step_dir = resolve(run_dir, on_skip)
        if step_dir is None:
            return None
        manifest = read_manifest_dir(step_dir)
    else:
        found = newest_verified(FileStorage(run_dir), on_skip=on_skip)
        if found is None:
            return None
        manifest = found
        step_dir = run_dir / checkpoint_key(manifest.step)
    return ResumePoint(
        step=manifest.step,
        step_dir=step_dir,
        payload=payload_path(step_dir, manifest),
        manifest=manifest,
    )


def payload_path(step_dir: Path, manifest: Manifest) -> Path:
    if manifest.format == FORMAT_SEED_BIN:
        bins = [f.path for f in manifest.files if parse_seed_bin(f.path) is not None]
        if len(bins) == 1:
            return step_dir / bins[0]
    if len(manifest.files) == 1:
        return step_dir / manifest.files[0].path
    return step_dir
