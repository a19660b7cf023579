"""How a checkpoint is laid out in a mirror, and why: two writers never mix.

Locally a checkpoint is `checkpoints/step_N/{manifest.json, <payload>}`. In a mirror every
upload attempt puts its payload under its own directory inside the step,
`checkpoints/step_N/<attempt>/<payload>`, and the mirror's `manifest.json` lists those paths
(`<attempt>/state.pt`). So:

- an old pod still uploading its final checkpoint and its replacement uploading the same
  step write disjoint objects; neither can overwrite a file the other's manifest names;
- the manifest is written last and create-only (If-None-Match: *): the first complete
  upload of a step wins, the loser removes its own objects and reports the conflict;
- any reader that follows manifest paths (verify, ls, prune, fork) works unchanged, and a
  download strips the attempt directory again, so a pulled checkpoint is byte-identical to
  the one the writer committed, manifest included.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from runner.checkpoint.layout import ATTEMPT_FIELD, checkpoint_key
from runner.checkpoint.manifest import FileEntry, Manifest
from runner.errors import IntegrityError

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def new_attempt_id(writer_id: str) -> str:
    """A directory name unique to one upload attempt, readable enough to tell writers apart."""
    readable = _UNSAFE.sub("_", writer_id).strip("._-")[:40] or "writer"
    return f"up-{readable}-{uuid.uuid4().hex[:10]}"


def to_remote(local: Manifest, *, attempt: str) -> Manifest:
    """The mirror's manifest: the same checkpoint, payload paths under the attempt dir."""
    files = [dataclasses.replace(f, path=f"{attempt}/{f.path}") for f in local.files]
    extra = {**local.extra, ATTEMPT_FIELD: attempt}
    return dataclasses.replace(local, files=files, extra=extra)


def to_local(remote: Manifest, *, source: str = "manifest.json") -> Manifest:
    """Undo `to_remote`. A manifest without an attempt (a plain run dir used as a location)
    is already local."""
    attempt = remote.extra.get(ATTEMPT_FIELD)
    if attempt is None:
        return remote
    prefix = f"{attempt}/"
    files: list[FileEntry] = []
    for entry in remote.files:
        if not entry.path.startswith(prefix):
            raise IntegrityError(
                f"{source}: {entry.path!r} is outside upload attempt {attempt!r}; the manifest "
                "mixes two uploads and is not trusted"
            )
        files.append(dataclasses.replace(entry, path=entry.path[len(prefix) :]))
    extra = {k: v for k, v in remote.extra.items() if k != ATTEMPT_FIELD}
    local = dataclasses.replace(remote, files=files, extra=extra)
    local.validate(source=source)
    return local


def same_checkpoint(a: Manifest, b: Manifest) -> bool:
    """Same step, state and payload bytes (wherever each copy lives)."""
    la, lb = to_local(a), to_local(b)
    return (la.step, la.fingerprint, la.files) == (lb.step, lb.fingerprint, lb.files)


def for_each_file(
    local: Manifest,
    remote: Manifest,
    work: Callable[[FileEntry, str], None],
    *,
    file_workers: int,
    name: str,
) -> None:
    """`work(local entry, its remote key)` for every file of a checkpoint, several at once
    (upload and download alike); the first failure is raised once all have ended."""
    base = checkpoint_key(local.step)
    with ThreadPoolExecutor(
        max_workers=max(1, min(file_workers, len(local.files))),
        thread_name_prefix=f"{name}-{local.step}",
    ) as pool:
        jobs = [
            pool.submit(work, entry, f"{base}/{remote_entry.path}")
            for entry, remote_entry in zip(local.files, remote.files, strict=True)
        ]
        for job in jobs:
            job.result()
