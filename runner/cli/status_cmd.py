"""`runner status LOCATION...`: where each location stands, for a person on call.

For each run dir or mirror URI: the newest checkpoint, its step and age, whether it verifies
(every file's size and sha256 against its manifest), and if it does not, the newest one that
does: the checkpoint a restarted run would resume from. Exits 3 when a location holds
checkpoints but none verifies.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import click

from runner.checkpoint.manifest import created_at_unix
from runner.cli.formatting import human_duration, human_size
from runner.cli.options import json_output, store_timeout
from runner.errors import NoVerifiedCheckpointError

if TYPE_CHECKING:
    from runner.checkpoint.manifest import Manifest
    from runner.checkpoint.verify import Verdict


@dataclass(frozen=True, kw_only=True)
class CheckpointSummary:
    step: int
    created_at: str | None
    age_seconds: float | None
    size_bytes: int | None
    writer: str | None
    fingerprint: str | None
    verified: bool | None
    """True: every file matches; False: it does not (see `error`); None: not checked."""
    error: str | None


@dataclass(frozen=True, kw_only=True)
class LocationStatus:
    location: str
    uri: str
    steps: list[int]
    newest: CheckpointSummary | None
    newest_verified: CheckpointSummary | None
    """The resume point: `newest` itself when it verifies (None when nothing verifies or
    verification was skipped)."""
    hint: str | None = None
    """With no checkpoints: why LOCATION may be the wrong level (`misplaced_hint`)."""


def location_status(location: str, *, verify: bool, now: float) -> LocationStatus:
    """Read (and with `verify`, hash) the checkpoints at `location`, newest first, until one
    verifies."""
    from runner.checkpoint.hints import misplaced_hint
    from runner.checkpoint.listing import list_checkpoints
    from runner.checkpoint.verify import iter_verified
    from runner.storage import open_existing

    # a missing local directory is a mistyped path (exit 2, as in ls/verify), while an
    # empty bucket prefix is a run that has not checkpointed yet
    storage = open_existing(location)
    steps = list_checkpoints(storage)
    newest: CheckpointSummary | None = None
    newest_verified: CheckpointSummary | None = None
    for verdict in iter_verified(storage, hashing=verify, steps=reversed(steps)):
        summary = _summary(verdict, verify=verify, now=now)
        newest = newest or summary
        if summary.verified:
            newest_verified = summary
        if summary.verified or not verify:
            break
    return LocationStatus(
        location=location,
        uri=storage.uri,
        steps=steps,
        newest=newest,
        newest_verified=newest_verified,
        hint=None if steps else misplaced_hint(storage, location),
    )


def _summary(verdict: Verdict[Manifest], *, verify: bool, now: float) -> CheckpointSummary:
    """What one checkpoint's manifest says, and with `verify` whether its files match."""
    manifest = verdict.value
    if manifest is None:
        return CheckpointSummary(
            step=verdict.step,
            created_at=None,
            age_seconds=None,
            size_bytes=None,
            writer=None,
            fingerprint=None,
            verified=False,
            error=verdict.error,
        )
    return CheckpointSummary(
        step=verdict.step,
        created_at=manifest.created_at,
        age_seconds=_age_seconds(manifest.created_at, now=now),
        size_bytes=manifest.total_bytes,
        writer=manifest.writer,
        fingerprint=manifest.fingerprint,
        verified=True if verify else None,
        error=None,
    )


@click.command()
@store_timeout
@click.argument("locations", metavar="LOCATION...", nargs=-1, required=True)
@click.option(
    "--no-verify",
    "skip_verify",
    is_flag=True,
    help="Only read manifests; do not hash files (faster for large remote checkpoints).",
)
@json_output
def status(locations: tuple[str, ...], skip_verify: bool, as_json: bool) -> None:
    """Newest checkpoint at each LOCATION (run dir, file:// or s3:// mirror): step, age,
    verified or not, and the checkpoint a restart would resume from."""
    now = time.time()
    results = [location_status(loc, verify=not skip_verify, now=now) for loc in locations]
    if as_json:
        click.echo(json.dumps([asdict(r) for r in results], indent=2, sort_keys=True))
    else:
        for result in results:
            click.echo(_render(result))
    unverifiable = [r.uri for r in results if r.steps and not skip_verify and not r.newest_verified]
    if unverifiable:
        raise NoVerifiedCheckpointError(
            f"no checkpoint verifies at {', '.join(unverifiable)}: a restart there would start "
            "from scratch; run `runner verify LOCATION` for details, or resume from another copy"
        )


def _render(status: LocationStatus) -> str:
    lines = [status.location]
    newest = status.newest
    if newest is None:
        lines.append("  no checkpoints")
        if status.hint:
            lines.append(f"  hint      {status.hint}")
        return "\n".join(lines)
    lines.append(f"  newest    {_describe(newest)}")
    if newest.verified is False:
        lines.append(f"            {newest.error}")
        resume = status.newest_verified
        lines.append(
            f"  resume    {_describe(resume)}"
            if resume
            else "  resume    NONE: no checkpoint verifies"
        )
    lines.append(f"  stored    {len(status.steps)} checkpoint(s): steps {_steps(status.steps)}")
    return "\n".join(lines)


def _describe(summary: CheckpointSummary) -> str:
    state = {True: "verified", False: "CORRUPT", None: "not verified (--no-verify)"}[
        summary.verified
    ]
    details = []
    if summary.age_seconds is not None:
        details.append(f"{human_duration(summary.age_seconds)} old")
    if summary.size_bytes is not None:
        details.append(human_size(summary.size_bytes))
    if summary.writer:
        details.append(f"by {summary.writer}")
    suffix = f" ({', '.join(details)})" if details else ""
    return f"step {summary.step}{suffix}  {state}"


def _steps(steps: list[int]) -> str:
    shown = [str(s) for s in steps[-5:]]
    return ("..., " if len(steps) > 5 else "") + ", ".join(shown)


def _age_seconds(created_at: str, *, now: float) -> float | None:
    created = created_at_unix(created_at)
    return None if created is None else max(0.0, now - created)
