"""`runner push RUN_DIR LOCATION` and `runner pull LOCATION DEST`: move committed checkpoints
between a run dir and a mirror (s3:// or file://), verified both ways."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runner.cli.options import STEP, store_timeout
from runner.errors import (
    ConfigError,
    IntegrityError,
    NoVerifiedCheckpointError,
    StorageNotFoundError,
)
from runner.runtime import runlock

if TYPE_CHECKING:
    from runner.checkpoint.manifest import Manifest
    from runner.storage.base import Storage


@click.command()
@store_timeout
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("location")
@click.option("--step", type=STEP, default=None, help="Push only this step (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def push(run_dir: Path, location: str, step: int | None, as_json: bool) -> None:
    """Upload the committed checkpoints of RUN_DIR to LOCATION (manifest last, each file
    verified). Checkpoints already there are verified and skipped, or replaced when the copy
    there is corrupt (set aside first, never one that verifies); corrupt local ones are
    reported, not sent, and make the command exit 3."""
    from runner.checkpoint.layout import checkpoint_key
    from runner.checkpoint.listing import list_checkpoints
    from runner.checkpoint.verify import verify_dir
    from runner.errors import RunnerError
    from runner.storage import open_storage
    from runner.storage.file import FileStorage

    storage = open_storage(location)
    steps = list_checkpoints(FileStorage(run_dir))
    if step is not None:
        if step not in steps:
            raise NoVerifiedCheckpointError(f"{run_dir} has no checkpoint at step {step}")
        steps = [step]
    if not steps:
        raise NoVerifiedCheckpointError(f"{run_dir} has no committed checkpoints to push")
    report: list[dict[str, Any]] = []
    corrupt: list[int] = []
    for s in steps:
        step_dir = run_dir / checkpoint_key(s)
        try:
            manifest = verify_dir(step_dir)
        except RunnerError as exc:
            corrupt.append(s)
            report.append({"step": s, "status": "corrupt", "error": str(exc)})
            if not as_json:
                click.echo(f"step {s}: not pushed, corrupt locally: {exc}", err=True)
            continue
        status = _push_step(storage, s, step_dir=step_dir, size=manifest.total_bytes)
        report.append({"step": s, "status": status, "bytes": manifest.total_bytes})
        if not as_json:
            verb = "already in" if status == "present" else "pushed to"
            click.echo(f"step {s}: {verb} {storage.uri} ({manifest.total_bytes} bytes)")
    if as_json:
        click.echo(json.dumps({"location": storage.uri, "checkpoints": report}, indent=2))
    if corrupt:
        raise IntegrityError(
            f"{len(corrupt)} corrupt local checkpoint(s) not pushed: steps "
            f"{', '.join(map(str, corrupt))}"
        )


def _push_step(storage: Storage, step: int, *, step_dir: Path, size: int) -> str:
    """Upload one verified local checkpoint: "pushed", or "present" when the location
    already had it."""
    from runner.console.progress import transfer_progress
    from runner.mirror import remote_manifest, upload_checkpoint

    status = "present" if remote_manifest(storage, step) is not None else "pushed"
    with transfer_progress(size, desc=f"push step {step}") as progress:
        # the copy already there is verified too: a corrupt one is replaced (a heal)
        upload_checkpoint(
            storage,
            step_dir,
            writer_id="runner-push",
            progress=progress,
            verify_existing=True,
        )
    return status


@click.command()
@store_timeout
@click.argument("location")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--step", type=STEP, default=None, help="Pull this step (default: newest that verifies)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def pull(location: str, dest: Path, step: int | None, as_json: bool) -> None:
    """Download a checkpoint from LOCATION into the run dir DEST, verifying every sha256.
    Without --step: the newest one that verifies; corrupt newer ones are reported and
    skipped. Exit 3 when nothing verifies."""
    from runner.checkpoint.listing import list_checkpoints
    from runner.checkpoint.verify import iter_checked
    from runner.storage import open_existing

    storage = open_existing(location)
    dest.mkdir(parents=True, exist_ok=True)
    # DEST is a run dir: no trainer may be writing it meanwhile (exit 2 naming it)
    with runlock.acquire(dest, command="runner pull"):
        available = list_checkpoints(storage)
        if step is not None:
            if step not in available:
                raise NoVerifiedCheckpointError(f"{storage.uri} has no checkpoint at step {step}")
            candidates = [step]
        else:
            candidates = list(reversed(available))
        if not candidates:
            raise NoVerifiedCheckpointError(f"{storage.uri} has no checkpoints")
        skipped: list[dict[str, Any]] = []

        def skip(s: int, why: str) -> None:
            skipped.append({"step": s, "error": why})
            if not as_json:
                click.echo(f"step {s}: skipped, {why}", err=True)

        # the download is the verification (every file hashed as it arrives): no second pass
        pulls = iter_checked(
            storage,
            lambda st, s: _pull_step(st, s, dest),
            steps=candidates,
            skip=(IntegrityError, StorageNotFoundError),
            on_skip=skip,
        )
        pulled = next((v.value for v in pulls if v.value is not None), None)
        if pulled is None:
            raise NoVerifiedCheckpointError(
                f"no checkpoint at {storage.uri} verified (tried steps "
                f"{', '.join(str(x['step']) for x in skipped)})"
            )
        s, path, total = pulled
        if as_json:
            click.echo(json.dumps({"step": s, "path": str(path), "skipped": skipped}, indent=2))
        else:
            click.echo(f"pulled step {s} from {storage.uri} into {path} ({total} bytes)")


def _pull_step(storage: Storage, step: int, dest: Path) -> tuple[int, Path, int]:
    """Download checkpoint `step` into the run dir `dest` (hashed as it arrives): its step,
    local directory and size. Refuses (ConfigError) to replace a different one there."""
    from runner.checkpoint.listing import read_manifest
    from runner.console.progress import transfer_progress
    from runner.mirror import download_checkpoint

    remote = read_manifest(storage, step)
    _refuse_to_replace_a_different_checkpoint(dest, remote, source=storage.uri)
    total = remote.total_bytes
    with transfer_progress(total, desc=f"pull step {step}") as progress:
        path = download_checkpoint(storage, step, dest, progress=progress)
    return step, path, total


def _refuse_to_replace_a_different_checkpoint(dest: Path, remote: Manifest, *, source: str) -> None:
    """ConfigError when DEST already holds a verified checkpoint of the same step with other
    training state (another seed, a fork): replacing it would silently swap the run's history
    for another run's. A corrupt local copy may be replaced (that is a repair), an identical
    one is left as it is."""
    from runner.checkpoint.layout import checkpoint_key
    from runner.checkpoint.verify import verify_dir

    local_dir = dest / checkpoint_key(remote.step)
    if not local_dir.exists():
        return
    try:
        local = verify_dir(local_dir)
    except IntegrityError:
        return
    except OSError as exc:
        raise ConfigError(
            f"cannot check {local_dir} before pulling over it: {exc.strerror or exc}"
        ) from exc
    same_content = sorted((f.sha256, f.size) for f in local.files) == sorted(
        (f.sha256, f.size) for f in remote.files
    )
    # an empty fingerprint (migrated v1 manifests) proves nothing; the payload hashes do
    if same_content or (local.fingerprint and local.fingerprint == remote.fingerprint):
        return
    raise ConfigError(
        f"{local_dir} already holds a different checkpoint of step {remote.step} that "
        f"verifies (fingerprint {local.fingerprint}; the one at {source} has "
        f"{remote.fingerprint}); pulling would replace this run's training state, so nothing "
        "was changed. Pull into another directory, or delete the local step directory first "
        "to take the remote one"
    )
