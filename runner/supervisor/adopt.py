"""Checkpoints of a supervised trainer: adopt the seed `.bin` files it writes, and name the
payload to hand back on resume.

A trainer in any language writes `step_NNNNNN.bin` (seed format, temp name then rename) into
RUNNER_CKPT_DIR. Each file is checked (size = 8 + 12·n, header step = file name step), then
moved into `checkpoints/step_NNNNNN/` with a manifest by the checkpoint writer. A file that
fails the check is renamed `<name>.rejected` beside it: kept for inspection, never adopted,
never handed back. Only finished files are judged (SeedAdopter.scan): one renamed into place
while the trainer runs, any once it has exited, never one a process still has open for writing.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from runner.checkpoint.formats.files import source_of
from runner.checkpoint.layout import (
    CHECKPOINTS_DIR,
    parse_seed_bin,
    seed_bin_name,
)
from runner.checkpoint.manifest import FORMAT_FILES, FORMAT_SEED_BIN, Manifest
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.errors import CheckpointConflictError, IntegrityError
from runner.supervisor.writer_detection import DirWatch, open_for_writing

log = logging.getLogger(__name__)

REJECTED_SUFFIX = ".rejected"
# Looks like a seed checkpoint but with a step of fewer than six digits (`step_40.bin`):
# never adopted (the name does not follow the format), but the trainer's author must hear why.
_SHORT_SEED_BIN = re.compile(r"^step_\d{1,5}\.bin$")


class CheckpointNotAdoptedError(IntegrityError):
    """The supervised trainer wrote a checkpoint that could not be adopted (rejected, or still
    open for writing) and none of a later step was committed: exit 3, not success."""


@dataclass(frozen=True, kw_only=True)
class Adopted:
    checkpoint: CommittedCheckpoint
    seconds: float
    """Time spent checking, hashing and committing it."""


@dataclass(frozen=True, kw_only=True)
class NotAdopted:
    """A seed file the trainer wrote that did not become a checkpoint."""

    name: str
    step: int
    """The step its name claims."""
    path: Path
    """Where its bytes are now (`<name>.rejected`, or still under its name)."""
    why: str


class SeedAdopter:
    """Scans the checkpoint directory for seed files and commits them, oldest first.

    While the trainer runs, a file is judged only when it is finished (see `scan`); once the
    trainer has exited, every file is. Files that did not become checkpoints are remembered in
    `not_adopted` so that the supervisor can refuse to report success when the trainer's last
    checkpoint was lost (`raise_if_lost`)."""

    def __init__(self, run_dir: Path, *, writer: CheckpointWriter) -> None:
        self.ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
        self.writer = writer
        self.rejected: list[Path] = []
        """Set aside since the caller last cleared it (the supervisor counts and clears)."""
        self.not_adopted: dict[str, NotAdopted] = {}
        self._last_seen: dict[str, tuple[int, int]] = {}
        self._misnamed_warned: set[str] = set()
        self._deferred_logged: set[str] = set()
        self._watch: DirWatch | None = None

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
        """Adopt every finished seed file present; `settled` says the trainer has exited.

        A file is never judged while some process holds it open for writing: its bytes may
        still change (a preallocated file has the right size with zeros inside). While the
        trainer runs (`settled=False`) a file must also have appeared under its name by a
        rename: one created in place may be written in several goes, with the file closed in
        between, and judging it early would adopt zeros or reject a file that was about to be
        complete. Such a file waits until the trainer exits. Without inotify (or after its
        queue overflowed) the old rule stands in for the rename: unchanged (size, mtime) on two
        scans in a row."""
        if self._watch is None and self.ckpt_dir.is_dir():
            # Started before the first (settled) scan, so every file that arrives after it is
            # seen arriving. Kept for the supervisor's life, across trainer restarts.
            self._watch = DirWatch(self.ckpt_dir)
        candidates = []
        for path in self.pending():  # listed before the events are read: see _finished
            if settled or self._finished(path):
                candidates.append(path)
        writers = open_for_writing(candidates) if candidates else {}
        adopted = []
        for path in candidates:
            pid = (writers or {}).get(path)
            if pid is not None:
                self._still_written(path, pid, settled=settled)
                continue
            self._last_seen.pop(path.name, None)
            result = self.adopt(
                path,
                judged="after the trainer exited"
                if settled
                else "while the trainer ran: it was renamed into place and no process writes it",
            )
            if result is not None:
                adopted.append(result)
                self.not_adopted.pop(path.name, None)
        return adopted

    def _finished(self, path: Path) -> bool:
        """While the trainer runs: did `path` arrive by a rename (or, with no reliable watch,
        look the same as on the previous scan)?"""
        origin = self._watch.origin(path.name) if self._watch is not None else None
        if origin == "renamed":
            return True
        if origin == "created" or (self._watch is not None and self._watch.reliable):
            # created in place, or (no event at all from a reliable watch) there before the
            # watch started yet not taken by the settled scan: still being written back then
            if path.name not in self._deferred_logged:
                self._deferred_logged.add(path.name)
                log.info(
                    "%s was written in place (not renamed into place): it will be checked "
                    "once the trainer exits. To have checkpoints adopted and mirrored while it "
                    "runs, write each under a temp name in RUNNER_CKPT_DIR, then rename it",
                    path.name,
                )
            return False
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        signature = (st.st_size, st.st_mtime_ns)
        if self._last_seen.get(path.name) != signature:
            self._last_seen[path.name] = signature
            return False
        return True

    def _still_written(self, path: Path, pid: int, *, settled: bool) -> None:
        if not settled:
            log.debug("%s is still open for writing by pid %d: waiting", path.name, pid)
            return
        # The trainer exited but some process (one it started, or an older trainer whose
        # supervisor died) still writes to it: leave it where it is, unjudged.
        why = (
            f"still open for writing by pid {pid} after the trainer exited; left in place "
            "unjudged (the next `runner run` on this run dir checks it once it is closed)"
        )
        self.not_adopted[path.name] = NotAdopted(
            name=path.name, step=parse_seed_bin(path.name) or 0, path=path, why=why
        )
        log.error("did not adopt trainer checkpoint %s: %s", path.name, why)

    def raise_if_lost(self, newest_step: int | None) -> None:
        """IntegrityError (exit 3) when a seed file the trainer wrote was not adopted and no
        checkpoint of a later step was committed (one of the same step is an older one, not
        what the trainer meant to leave): the run must not report success."""
        lost = [
            item
            for item in self.not_adopted.values()
            if newest_step is None or item.step >= newest_step
        ]
        if not lost:
            return
        listed = "; ".join(
            f"{item.name} ({item.why}; its bytes are in {item.path})" for item in lost
        )
        newest = f"step {newest_step}" if newest_step is not None else "none"
        raise CheckpointNotAdoptedError(
            f"the trainer's newest checkpoint was not adopted: {listed}. The newest usable "
            f"checkpoint is {newest}. A trainer must write each step_NNNNNN.bin complete "
            "(8 + 12*n bytes, header step = the step in its name) under a temp name in "
            "RUNNER_CKPT_DIR, close it, then rename it to its final name"
        )

    def adopt(self, path: Path, *, judged: str = "") -> Adopted | None:
        """Check and commit one seed file; None (and the file set aside) when it is bad.
        `judged` says when it was checked, for the log."""
        from runner.checkpoint import convert  # imports torch: only once a trainer saves
        from runner.checkpoint.formats import seedbin

        start = time.monotonic()
        try:
            seedbin.read_header(path)
            checkpoint = convert.adopt_seed_bin(
                self.writer, path, copy=False, extra={"adopted_by": "runner run"}
            )
        except IntegrityError as exc:
            self._reject(path, f"{exc} (checked {judged})" if judged else str(exc))
            return None
        except CheckpointConflictError as exc:
            # a good checkpoint of that step exists with other contents: it stays, and the
            # trainer's file was set aside by the writer (its bytes kept there)
            self._not_adopted(path, kept=exc.kept or path, why=str(exc))
            log.error("trainer checkpoint %s NOT adopted: %s", path.name, exc)
            return None
        seconds = time.monotonic() - start
        log.info(
            "adopted trainer checkpoint step %d (%d bytes) in %.2f s",
            checkpoint.step,
            checkpoint.manifest.total_bytes,
            seconds,
        )
        return Adopted(checkpoint=checkpoint, seconds=seconds)

    def _not_adopted(self, path: Path, *, kept: Path, why: str) -> None:
        """Record a trainer file that was not adopted: its bytes are at `kept`."""
        self.rejected.append(kept)
        self.not_adopted[path.name] = NotAdopted(
            name=path.name, step=parse_seed_bin(path.name) or 0, path=kept, why=why
        )

    def _reject(self, path: Path, why: str) -> None:
        # never over an earlier rejected file of the same name: it is kept too
        aside = path.with_name(path.name + REJECTED_SUFFIX)
        n = 0
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}{REJECTED_SUFFIX}.{n}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        self._not_adopted(path, kept=aside, why=why)
        log.error(
            "rejected trainer checkpoint %s: %s. It was NOT adopted and will not be resumed "
            "from; kept as %s",
            path.name,
            why,
            aside,
        )


def payload_path(step_dir: Path, manifest: Manifest) -> Path:
    """What RUNNER_RESUME_FROM names for a checkpoint resumed from (found by
    runner.runtime.lifecycle.find_resume): the seed .bin, the single payload file, the
    trainer's own file or directory (`files`), or the dir."""
    if manifest.format == FORMAT_FILES:
        return step_dir / PurePosixPath(source_of(manifest)).name
    if manifest.format == FORMAT_SEED_BIN:
        bins = [f.path for f in manifest.files if parse_seed_bin(f.path) is not None]
        if len(bins) == 1:
            return step_dir / bins[0]
    if len(manifest.files) == 1:
        return step_dir / manifest.files[0].path
    return step_dir
