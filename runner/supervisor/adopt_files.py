"""`runner run --adopt PATTERN`: a trainer's own checkpoints (HF's `checkpoint-500/`,
Lightning's `step=500.ckpt`, `ckpt-500.pt`) committed as `files` checkpoints
(runner/checkpoint/formats/files.py), and the newest one put back before the trainer starts.

Trainers write their directories in place, file after file, so a match is judged finished
when no process holds any of its files open for writing and, while the trainer runs, it
either arrived by a rename (inotify on the pattern's directory, when that part is literal) or
nothing in it changed for `quiet_seconds`; once the trainer exited, at once. It is copied
(the trainer's files are never moved, changed or deleted), and committed only when the tree
is the same after the copy as before: one that changed is tried again once quiet, one that
vanished (the trainer's own `save_total_limit`) is dropped.
"""

from __future__ import annotations

import glob
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runner.checkpoint.formats.files import (
    NotAdoptableError,
    Restored,
    TreeFile,
    list_tree,
    restore,
    signature,
    step_in_name,
)
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.tree import TreeChangedError, commit_tree
from runner.checkpoint.writer import CheckpointWriter, committed_steps
from runner.errors import CheckpointConflictError, IntegrityError
from runner.supervisor.adopt import Adopted, CheckpointNotAdoptedError, NotAdopted
from runner.supervisor.writer_detection import DirWatch, open_for_writing

log = logging.getLogger("runner.supervisor.adopt")

_MAGIC = ("*", "?", "[")


@dataclass(frozen=True, kw_only=True)
class Match:
    rel: str
    """Relative to the trainer's working directory, as the glob found it."""
    path: Path
    step: int
    pattern: str


class FilesAdopter:
    """Finds the trainer's checkpoints by `patterns` under `root` and commits each finished
    one whose step is not committed yet and newer than every committed step."""

    def __init__(
        self,
        patterns: Sequence[str],
        *,
        root: Path,
        writer: CheckpointWriter,
        quiet_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.patterns = list(patterns)
        self.root = root
        self.writer = writer
        self.quiet_seconds = quiet_seconds
        self._clock = clock
        self.rejected: list[Path] = []  # never filled: the trainer's files are not moved
        self.not_adopted: dict[str, NotAdopted] = {}
        self._quiet: dict[str, tuple[tuple[object, ...], float]] = {}  # rel -> (sig, since)
        self._done: set[str] = set()  # judged for good while it keeps its name
        self._told: set[str] = set()
        self._watches: dict[Path, DirWatch] = {}

    # -- what is there ---------------------------------------------------------------------
    def matches(self) -> list[Match]:
        """Every match of every pattern, oldest step first (a name without a step is
        refused once, with how to fix it)."""
        found: dict[str, Match] = {}
        for pattern in self.patterns:
            for rel in sorted(glob.glob(pattern, root_dir=self.root)):
                path = self.root / rel
                if self._in_run_dir(path):
                    self._tell_once(rel, f"not adopting {rel}: it is inside the run dir")
                    continue
                step = step_in_name(path.name)
                if step is None:
                    self._tell_once(
                        rel,
                        f"not adopting {rel}: its name has no step in it. Put the step into "
                        "the checkpoint's name (the last integer in it is taken: "
                        "checkpoint-500, step=500.ckpt, ckpt-000500.pt)",
                    )
                    continue
                found.setdefault(rel, Match(rel=rel, path=path, step=step, pattern=pattern))
        return sorted(found.values(), key=lambda m: (m.step, m.rel))

    def _in_run_dir(self, path: Path) -> bool:
        run_dir = self.writer.ckpt_dir.parent.resolve()
        return path.resolve().is_relative_to(run_dir)

    def pending_steps(self) -> list[int]:
        """Steps of matches not yet judged (what the trainer wrote before a stop)."""
        return [m.step for m in self.matches() if m.rel not in self._done]

    # -- adopting ----------------------------------------------------------------------------
    def scan(self, *, settled: bool) -> list[Adopted]:
        """Adopt every finished match (`settled`: the trainer has exited)."""
        self._watch_parents()
        matches = self.matches()
        present = {m.rel for m in matches}
        self._done &= present  # a name that went and came back is judged again
        adopted: list[Adopted] = []
        for match in matches:
            files = self._judge(match, settled=settled)
            if files is not None and (result := self._adopt(match, files)) is not None:
                adopted.append(result)
        return adopted

    def _judge(self, match: Match, *, settled: bool) -> list[TreeFile] | None:
        """The files of `match` when it is to be adopted now; None when it waits (not
        finished, still written) or is judged for good (committed already, or refused)."""
        if match.rel in self._done:
            return None
        committed = committed_steps(self.writer.ckpt_dir)
        if match.step in committed or (committed and match.step < committed[-1]):
            self._done.add(match.rel)  # a copy of it, or a newer one, is committed
            return None
        try:
            files = list_tree(match.path)
        except FileNotFoundError:
            return None
        except NotAdoptableError as exc:
            self._refuse(match, str(exc))
            return None
        if not settled and not self._finished(match, files):
            return None
        writers = open_for_writing([f.path for f in files]) or {}
        if writers:
            if settled:
                pid = next(iter(writers.values()))
                why = f"still open for writing by pid {pid} after the trainer exited"
                self._refuse(match, f"{why}; left in place unjudged")
            return None
        return files

    def _finished(self, match: Match, files: list[TreeFile]) -> bool:
        watch = self._watches.get(match.path.parent)
        if watch is not None and watch.origin(match.path.name) == "renamed":
            return True
        sig = signature(files)
        now = self._clock()
        seen = self._quiet.get(match.rel)
        if seen is None or seen[0] != sig:
            self._quiet[match.rel] = (sig, now)
            return self.quiet_seconds == 0
        return now - seen[1] >= self.quiet_seconds

    def _adopt(self, match: Match, files: list[TreeFile]) -> Adopted | None:
        start = time.monotonic()
        try:
            checkpoint = commit_tree(
                self.writer,
                match.path,
                step=match.step,
                source=match.rel,
                files=files,
                extra={"adopted_by": "runner run --adopt", "pattern": match.pattern},
            )
        except (TreeChangedError, FileNotFoundError, NotAdoptableError):
            self._quiet.pop(match.rel, None)
            if match.path.exists():
                log.info("%s changed while it was copied: tried again once it is quiet", match.rel)
            else:
                log.info(
                    "%s vanished while it was copied (deleted by the trainer?): not committed",
                    match.rel,
                )
            return None
        except (CheckpointConflictError, IntegrityError) as exc:
            self._refuse(match, str(exc))
            return None
        self._done.add(match.rel)
        self.not_adopted.pop(match.rel, None)
        seconds = time.monotonic() - start
        log.info(
            "adopted trainer checkpoint %s as step %d (%d files, %d bytes) in %.2f s",
            match.rel,
            checkpoint.step,
            len(files),
            checkpoint.manifest.total_bytes,
            seconds,
        )
        return Adopted(checkpoint=checkpoint, seconds=seconds)

    def _refuse(self, match: Match, why: str) -> None:
        self._done.add(match.rel)
        self.not_adopted[match.rel] = NotAdopted(
            name=match.rel, step=match.step, path=match.path, why=why
        )
        log.error("did not adopt trainer checkpoint %s: %s", match.rel, why)

    def _tell_once(self, rel: str, text: str) -> None:
        if rel not in self._told:
            self._told.add(rel)
            log.warning("%s", text)

    def _watch_parents(self) -> None:
        """A rename watch on each pattern's directory, when that part of it is literal.
        Created (empty) when missing, so that the watch is in place before the trainer's
        first save: an empty output directory is what a trainer makes itself."""
        for pattern in self.patterns:
            parent = (self.root / pattern).parent
            if any(c in str(parent) for c in _MAGIC) or parent in self._watches:
                continue
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._tell_once(str(parent), f"cannot create {parent} to watch it: {exc}")
                continue
            self._watches[parent] = DirWatch(parent)

    # -- resume --------------------------------------------------------------------------------
    def restore(self, step_dir: Path, manifest: Manifest) -> Restored:
        """Put the checkpoint resumed from back where the trainer wrote it."""
        restored = restore(step_dir, manifest, root=self.root)
        log.info(
            "%s %s from checkpoint step %d",
            "restored" if restored.copied else "verified in place:",
            restored.path,
            manifest.step,
        )
        return restored

    def raise_if_lost(self, newest_step: int | None) -> None:
        """CheckpointNotAdoptedError (exit 3) when a match newer than the newest committed
        checkpoint was refused (or still written after the trainer exited)."""
        lost = [n for n in self.not_adopted.values() if newest_step is None or n.step > newest_step]
        if not lost:
            return
        listed = "; ".join(f"{item.name} ({item.why})" for item in lost)
        newest = f"step {newest_step}" if newest_step is not None else "none"
        raise CheckpointNotAdoptedError(
            f"the trainer's newest checkpoint was not adopted: {listed}. The newest usable "
            f"checkpoint is {newest}. The trainer's own files are where it wrote them"
        )

    def unadopted(self) -> list[str]:
        """The trainer's matches that are not committed (for the report when none stands)."""
        committed = set(committed_steps(self.writer.ckpt_dir))
        return [m.rel for m in self.matches() if m.step not in committed]

    def close(self) -> None:
        for watch in self._watches.values():
            watch.close()
