"""Upload one committed checkpoint: every payload file, each verified, the manifest last."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from runner.checkpoint.aside import CORRUPT, decommit_remote
from runner.checkpoint.existing import CORRUPT_THERE, SAME, UNREADABLE, judge
from runner.checkpoint.layout import checkpoint_key, manifest_key
from runner.checkpoint.listing import read_manifest_bytes, read_manifest_dir
from runner.checkpoint.manifest import FileEntry, Manifest
from runner.checkpoint.verify import verify_checkpoint
from runner.errors import (
    IntegrityError,
    RunnerError,
    StorageConflictError,
    StorageNotFoundError,
    StorageTransientError,
)
from runner.mirror.remote_layout import (
    ATTEMPT_FIELD,
    for_each_file,
    new_attempt_id,
    same_checkpoint,
    to_remote,
)
from runner.storage.base import ProgressCallback, Storage

log = logging.getLogger(__name__)

FILE_WORKERS = 4


def remote_manifest(storage: Storage, step: int) -> Manifest | None:
    """The mirror's manifest of a step, None when the step has none (or an unreadable one)."""
    key = manifest_key(step)
    try:
        raw = read_manifest_bytes(storage, key)
        return Manifest.from_json(raw, source=f"{storage.uri}/{key}")
    except StorageNotFoundError:
        return None
    except IntegrityError:
        return None


def upload_checkpoint(
    storage: Storage,
    step_dir: Path,
    *,
    writer_id: str = "runner",
    progress: ProgressCallback | None = None,
    file_workers: int = FILE_WORKERS,
    verify_existing: bool = False,
) -> Manifest:
    """Upload a committed local checkpoint and return the mirror's manifest.

    Files go to a directory unique to this attempt, each checked against the local manifest's
    size and sha256 (the backend compares its server-side checksum where it has one); the
    manifest is written last and only if the step has none yet. Already there with the same
    content: nothing is sent (with `verify_existing`, only once that copy verifies).
    Another checkpoint at this step that verifies, or one this runner cannot read:
    StorageConflictError, never replaced. One that fails verification is de-committed (set
    aside, runner.checkpoint.aside) and this one uploaded in its place: the heal of a
    corrupt step. On failure this attempt's objects are removed and no manifest exists for
    them."""
    step_dir = Path(step_dir)
    local = read_manifest_dir(step_dir)
    existing = existing_copy(storage, local, verify=verify_existing)
    if existing is not None:
        return existing

    attempt = new_attempt_id(writer_id)
    remote = to_remote(local, attempt=attempt)
    base = checkpoint_key(local.step)
    try:
        _send_files(storage, step_dir, local, remote, progress=progress, file_workers=file_workers)
        # the local manifest's lowest schema again (runner.checkpoint.manifest.Manifest)
        committed, ours = put_manifest(storage, local, remote)
    except BaseException:
        discard_attempt(storage, base=base, attempt=attempt)
        raise
    if not ours:
        return committed  # the same checkpoint from another writer (logged as found)
    log.info(
        "uploaded checkpoint step %d to %s (%d files, %d bytes)",
        local.step,
        storage.uri,
        len(local.files),
        local.total_bytes,
    )
    return remote


def put_manifest(
    storage: Storage,
    local: Manifest,
    remote: Manifest,
    *,
    verify: bool = False,
    same: Callable[[Manifest, Manifest], bool] = same_checkpoint,
) -> tuple[Manifest, bool]:
    """The commit in a store: `remote` (this attempt's manifest) put last, create-only.
    Returns the step's manifest now and whether it is this attempt's.

    When the step is taken (`settle`): by this attempt, the put landed and only its answer
    was lost; by the same checkpoint (`same`, hashed first with `verify`), it counts as
    committed and this attempt's objects go; a corrupt copy is de-committed and the put
    tried once more; another good checkpoint, or one this runner cannot read, raises
    StorageConflictError (never replaced)."""
    key = manifest_key(local.step)
    for _ in range(2):  # a second try only after a corrupt copy was de-committed
        try:
            storage.put_bytes(key, remote.to_json(), if_absent=True)
        except StorageConflictError:
            settled = settle(storage, local, remote, verify=verify, same=same)
            if settled is not None:
                return settled
            continue
        return remote, True
    raise StorageConflictError(f"{storage.uri}: step {local.step} could not be committed")


def settle(
    storage: Storage,
    local: Manifest,
    remote: Manifest,
    *,
    verify: bool,
    same: Callable[[Manifest, Manifest], bool],
) -> tuple[Manifest, bool] | None:
    """After a create-only manifest put found the step taken: (remote, True) when the
    manifest there names this attempt (an earlier try landed; a retry got 412); (theirs,
    False) when it holds this checkpoint (`existing_copy`), this attempt's objects then
    removed; None when the copy there was corrupt and is de-committed now (put again).
    StorageConflictError otherwise (the caller removes this attempt's objects)."""
    attempt = remote.extra[ATTEMPT_FIELD]
    there = remote_manifest(storage, local.step)
    if there is not None and there.extra.get(ATTEMPT_FIELD) == attempt:
        return remote, True
    existing = existing_copy(storage, local, verify=verify, same=same)
    if existing is None:
        return None
    discard_attempt(storage, base=checkpoint_key(local.step), attempt=attempt)
    return existing, False


def _send_files(
    storage: Storage,
    step_dir: Path,
    local: Manifest,
    remote: Manifest,
    *,
    progress: ProgressCallback | None,
    file_workers: int,
) -> None:
    """Every file of `step_dir` to its key in this attempt's directory, several at once,
    each checked against the local manifest's size and sha256."""

    def send(entry: FileEntry, key: str) -> None:
        upload_file(
            storage,
            key=key,
            src=step_dir / entry.path,
            size=entry.size,
            sha256=entry.sha256,
            progress=progress,
        )

    for_each_file(local, remote, send, file_workers=file_workers, name="upload")


def upload_file(
    storage: Storage,
    *,
    key: str,
    src: Path,
    size: int,
    sha256: str,
    progress: ProgressCallback | None = None,
) -> None:
    """One file to `key`, its sha256 checked by the backend where it can, its stored size
    checked after."""
    storage.put_file(key, src, sha256=sha256, progress=progress)
    stored = storage.head(key).size
    if stored != size:
        raise StorageTransientError(f"{storage.uri}/{key}: stored {stored} bytes, sent {size}")


def existing_copy(
    storage: Storage,
    local: Manifest,
    *,
    verify: bool,
    same: Callable[[Manifest, Manifest], bool] = same_checkpoint,
) -> Manifest | None:
    """The mirror's copy of this checkpoint when it already holds it (`same(there, local)`:
    by default the same step, state and payload bytes); None when the step is free (nothing
    there, or a corrupt checkpoint that was just de-committed). Raises StorageConflictError
    when the step holds another good checkpoint or one this runner does not read: the
    existing-step policy (runner.checkpoint.existing) applied to a step in a store."""
    step = local.step
    where = f"{storage.uri}/{manifest_key(step)}"
    raw: bytes | None = None
    trusted: list[Manifest] = []  # the same manifest, taken without hashing (not `verify`)

    def check() -> Manifest:
        nonlocal raw
        raw = read_manifest_bytes(storage, manifest_key(step))  # too large: IntegrityError
        existing = Manifest.from_json(raw, source=where)
        if same(existing, local) and not verify:
            trusted.append(existing)
            return existing
        return verify_checkpoint(storage, step)

    try:
        found = judge(check, local, same=same)
    except StorageNotFoundError:
        return None
    if found.kind == UNREADABLE:
        raise StorageConflictError(
            f"{storage.uri} holds a checkpoint at step {step} that this runner cannot read "
            f"({found.error}); it is never replaced. Upgrade spot-runner, or start a new run "
            "elsewhere"
        ) from found.error
    if found.kind == CORRUPT_THERE:
        log.warning(
            "checkpoint step %d in %s fails verification (%s): replacing it with step %d from %s",
            step,
            storage.uri,
            found.error,
            step,
            local.writer,
        )
        decommit_remote(storage, step, reason=CORRUPT, expected=raw)
        return None
    verified = found.manifest
    assert verified is not None
    if found.kind == SAME:
        log.info(
            "checkpoint step %d is already in %s%s",
            step,
            storage.uri,
            "" if trusted else " (verified)",
        )
        return verified
    raise StorageConflictError(
        f"{storage.uri} already holds a different checkpoint at step {step} that verifies "
        f"(written by {verified.writer}, fingerprint {verified.fingerprint[:12]}); not "
        "replacing it"
    )


def discard_attempt(storage: Storage, *, base: str, attempt: str) -> None:
    """Remove what this attempt uploaded (best effort: objects without a manifest are
    invisible to readers anyway)."""
    try:
        for info in list(storage.list(f"{base}/{attempt}/")):
            storage.delete(info.key)
    except RunnerError as exc:
        log.warning("could not remove partial upload %s/%s: %s", base, attempt, exc)
