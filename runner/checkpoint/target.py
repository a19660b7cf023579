"""The local commit target (Orbax's atomic-rename temporary path): a checkpoint is staged in
a temp dir beside its final name, every file hashed as written; `finalize` writes the
manifest last, fsyncs the dir and renames it into place under the existing-step policy
(runner.checkpoint.existing). A store cannot rename: its target's finalize is the
create-only manifest put (runner.mirror.upload.put_manifest).

    checkpoints/.tmp-step_NNNNNN-<pid>-<uuid>/        payload files, hashed + fsynced
    checkpoints/.tmp-step_NNNNNN-.../manifest.json   written last, fsynced, dir fsynced
    rename -> checkpoints/step_NNNNNN/, parent fsynced

The writer and a download commit through it alike.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from runner.atomicity.files import HashingFileWriter, fsync_dir
from runner.atomicity.temp import temp_name
from runner.checkpoint.existing import LocalStep
from runner.checkpoint.layout import MANIFEST_NAME, step_dir_name
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.staging import Staging

# Temp dirs being written by any target in this process: a process-wide fact (two writers in
# one process must not clean up each other's work), emptied as each write ends.
_IN_FLIGHT: set[str] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def in_flight(path: Path) -> bool:
    """Whether this process is writing the temp dir `path` right now."""
    with _IN_FLIGHT_LOCK:
        return str(path.absolute()) in _IN_FLIGHT


class LocalTarget:
    """Commits checkpoints into `ckpt_dir` (a run dir's `checkpoints/`)."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = Path(ckpt_dir)

    @contextmanager
    def staging(self, step: int) -> Iterator[Staging]:
        """A fresh temp dir for `step`, removed unless `finalize` renamed it into place."""
        path = self.ckpt_dir / temp_name(step_dir_name(step))
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(str(path.absolute()))
        try:
            path.mkdir()
            yield Staging(path)
        finally:
            if path.exists():  # not committed: an error or a discarded duplicate
                shutil.rmtree(path, ignore_errors=True)
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(str(path.absolute()))

    def finalize(
        self,
        stage: Staging,
        policy: LocalStep,
        *,
        gate: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> Manifest:
        """Write `policy.incoming` as the manifest, last; fsync; rename into place (inside
        `gate`, e.g. start-up's publishing gate). The manifest now in place."""
        with HashingFileWriter(stage.path / MANIFEST_NAME, parallel_hash=False) as out:
            out.write(policy.incoming.to_json())
            out.commit(sync_dir=False)
        fsync_dir(stage.path)
        final = self.ckpt_dir / step_dir_name(policy.incoming.step)
        with gate():
            return policy.publish(stage.path, final)
