"""`runner repair LOCATION [--from SOURCE]`: heal the corrupt checkpoints of a location.

A corrupt checkpoint in a mirror blocks its step: nodes skip it and fall back to an older
one, and an upload of that step meets its manifest. `repair` finds every checkpoint at
LOCATION that fails verification and, for each, puts a verifying copy of that step from
SOURCE in its place; without SOURCE (or when SOURCE has no good copy) it only sets the corrupt
one aside, so that the next save of that step can land. A checkpoint that verifies is never
touched, nor one of a schema this runner cannot read.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runner.cli.options import store_timeout
from runner.errors import IntegrityError, RunnerError, SchemaError

if TYPE_CHECKING:
    from runner.storage.base import Storage


@click.command()
@store_timeout
@click.argument("location")
@click.option(
    "--from",
    "source",
    default=None,
    help="Run dir or mirror URI holding good copies of the corrupt steps.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def repair(location: str, source: str | None, as_json: bool) -> None:
    """Replace every corrupt checkpoint at LOCATION with a verifying copy from --from, or set
    it aside (kept, no longer counted) when no good copy is given. Exit 0 when every corrupt
    step was restored, 3 when some could only be set aside."""
    from runner.checkpoint.verify import iter_checked, verify_checkpoint
    from runner.storage import is_run_dir_path, open_existing

    target = open_existing(location)
    origin = open_existing(source) if source is not None else None
    report: list[dict[str, Any]] = []
    unrestored: list[int] = []
    with contextlib.ExitStack() as stack:
        if is_run_dir_path(location):
            # a run dir: its trainer must not be writing it meanwhile (exit 2 naming it)
            from runner.runtime import runlock

            stack.enter_context(runlock.acquire(Path(location), command="runner repair"))
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="runner-repair-"))
        # every checkpoint, not only down to the newest good one (a run dir or file:// is
        # checked in place); a storage error stops it. Each step is repaired before the next
        # older one is verified
        for verdict in iter_checked(target, verify_checkpoint, skip=IntegrityError):
            step, problem = verdict.step, verdict.error
            if verdict.ok:
                continue
            if isinstance(verdict.exc, SchemaError):
                report.append({"step": step, "status": "unreadable, left alone", "error": problem})
                continue
            status = _repair_step(target, origin, step, tmp=Path(tmp))
            if status != "restored":
                unrestored.append(step)
            report.append({"step": step, "status": status, "error": problem})
    if as_json:
        click.echo(json.dumps({"location": target.uri, "checkpoints": report}, indent=2))
    else:
        for row in report:
            click.echo(f"step {row['step']}: {row['status']} ({row['error']})")
        if not report:
            click.echo(f"{target.uri}: every checkpoint verifies; nothing to repair")
    if unrestored:
        raise _set_aside_error(unrestored, uri=target.uri, source=source)


def _set_aside_error(steps: list[int], *, uri: str, source: str | None) -> IntegrityError:
    """Exit 3: the corrupt steps that could only be set aside, and how to restore them."""
    hint = (
        f"{source} has no verifying copy of them"
        if source is not None
        else "give --from RUN_DIR_OR_MIRROR with good copies to restore them"
    )
    return IntegrityError(
        f"step(s) {', '.join(map(str, steps))} of {uri} were corrupt and are set "
        f"aside (kept under aside/, no longer resumed from); {hint}. The next save of "
        "those steps can now land"
    )


def _repair_step(target: Storage, origin: Storage | None, step: int, *, tmp: Path) -> str:
    """Put a verifying copy of the corrupt `step` from `origin` in its place ("restored"),
    or set the corrupt one aside ("set aside")."""
    from runner.checkpoint.aside import CORRUPT, decommit_remote, protected_keys, set_aside_local
    from runner.checkpoint.layout import checkpoint_key
    from runner.mirror import upload_checkpoint

    local = target.local_path()
    if local is not None and protected_keys(target).under(step):
        # a file:// mirror whose step dir also holds objects an aside record names (an older
        # lineage's payload): moving the dir would take them from under their record, so
        # de-commit and upload as in any mirror
        local = None
    # straight into a run dir (the download sets the corrupt copy aside once the good
    # one has arrived whole and verified); via a temp dir for an upload
    good = _good_copy(origin, step, local or tmp)
    if good is not None and local is not None:
        return "restored"
    if good is not None:
        upload_checkpoint(target, good, writer_id="runner-repair", verify_existing=True)
        return "restored"
    if local is not None:
        set_aside_local(local, local / checkpoint_key(step), reason=CORRUPT)
    else:
        decommit_remote(target, step, reason=CORRUPT)
    return "set aside"


def _good_copy(origin: Storage | None, step: int, run_dir: Path) -> Path | None:
    """A verified copy of `step` from the source location, downloaded into `run_dir` (so a
    mirror's attempt directories are stripped whatever the source's kind), or None."""
    from runner.checkpoint.listing import list_checkpoints
    from runner.mirror import download_checkpoint

    if origin is None or step not in list_checkpoints(origin):
        return None
    try:
        return download_checkpoint(origin, step, run_dir)
    except RunnerError as exc:
        click.echo(f"step {step}: the copy in {origin.uri} is not usable either: {exc}", err=True)
        return None
