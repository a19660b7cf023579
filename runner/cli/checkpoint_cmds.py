"""Checkpoint commands that read: ls, verify, inspect (those that write: transform_cmds.py).

LOCATION is a run dir, `file:///path` or `s3://bucket/prefix`: everything but `convert` goes
through the storage protocol. Commands raise typed errors; cli/main.py turns them into exit
codes (3 for integrity failures).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runner.checkpoint.manifest import FORMAT_DCP, created_at_unix
from runner.cli.formatting import echo_json, human_duration, human_size
from runner.cli.options import STEP, json_output, store_timeout
from runner.errors import ConfigError, IntegrityError, NoVerifiedCheckpointError

if TYPE_CHECKING:
    from runner.checkpoint.verify import CheckpointStatus
    from runner.storage.base import Storage


def _age(created_at: str, *, now: float) -> float | None:
    created = created_at_unix(created_at)
    return None if created is None else now - created


@click.command()
@store_timeout
@click.argument("location")
@click.option("--verify", "deep", is_flag=True, help="Also hash every file (slower).")
@json_output
def ls(location: str, deep: bool, as_json: bool) -> None:
    """List the checkpoints at LOCATION: step, size, age, format, verified."""
    from runner.checkpoint.hints import misplaced_hint
    from runner.storage import open_existing

    storage = open_existing(location)
    rows = _ls_rows(storage, deep=deep, now=time.time())
    hint = None if rows else misplaced_hint(storage, location)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo(f"no checkpoints at {storage.uri}")
        return
    _echo_ls_table(rows, deep=deep)


def _ls_rows(storage: Storage, *, deep: bool, now: float) -> list[dict[str, Any]]:
    """One row per checkpoint, newest first: what its manifest claims, and with `deep`
    whether its files verify."""
    from runner.checkpoint.listing import list_checkpoints, read_manifest
    from runner.checkpoint.newest import newest_first, read_manifests
    from runner.checkpoint.verify import verify_checkpoint
    from runner.errors import RunnerError

    unread: dict[int, RunnerError] = {}  # each row says why its manifest was not read
    claimed = read_manifests(storage, list_checkpoints(storage), unread=unread)
    rows: list[dict[str, Any]] = []
    for step in newest_first(claimed):  # newest by progress, as resume picks
        row: dict[str, Any] = {"step": step, "verified": None, "error": None}
        manifest = None
        try:
            if step in unread:  # with --verify too: it cannot verify without its manifest
                raise unread[step]
            manifest = verify_checkpoint(storage, step) if deep else claimed[step]
        except RunnerError as exc:
            row.update(verified=False if deep else None, error=str(exc), verdict=_verdict(exc))
            if deep:
                # a payload that fails may still have a readable manifest: show what it claims
                with contextlib.suppress(RunnerError):
                    manifest = read_manifest(storage, step)
        else:
            row.update(verified=True if deep else None)
        if manifest is not None:
            row.update(
                size=manifest.total_bytes,
                age_seconds=_age(manifest.created_at, now=now),
                format=manifest.format,
                fingerprint=manifest.fingerprint,
                world_size=manifest.world_size,
            )
        rows.append(row)
    return rows


def _echo_ls_table(rows: list[dict[str, Any]], *, deep: bool) -> None:
    click.echo(f"{'STEP':>10}  {'SIZE':>9}  {'AGE':>7}  {'FORMAT':<14} VERIFIED")
    for row in rows:
        verified = {True: "yes", False: "NO", None: "-"}[row["verified"]]
        if row["error"]:
            verified = f"{row['verdict']}: {row['error']}" if deep else "NO (manifest)"
        size = human_size(row["size"]) if "size" in row else "?"
        click.echo(
            f"{row['step']:>10}  {size:>9}  {human_duration(row.get('age_seconds')):>7}  "
            f"{row.get('format', '?'):<14} {verified}"
        )
        if row["error"] and not deep:
            click.echo(f"{'':>12}{row['error']}")
        if row.get("world_size", 1) > 1:  # a line of its own: the columns stay as they were
            click.echo(f"{'':>12}world size {row['world_size']}")


def _verdict(exc: Exception) -> str:
    """`corrupt` for an integrity failure, `unreadable` for a schema or payload this runner
    cannot read (possibly good for another version), `error` when the store failed."""
    from runner.errors import SchemaError

    if isinstance(exc, SchemaError):
        return "unreadable"
    return "corrupt" if isinstance(exc, IntegrityError) else "error"


@click.command()
@store_timeout
@click.argument("location")
@click.option("--step", type=STEP, default=None, help="Verify only this step.")
@json_output
def verify(location: str, step: int | None, as_json: bool) -> None:
    """Hash every file of every checkpoint at LOCATION and name each corrupt one.

    Exits 3 when the newest checkpoint (or --step) is corrupt, or when there is none."""
    from runner.checkpoint.hints import misplaced_hint
    from runner.checkpoint.verify import scan
    from runner.storage import open_existing

    storage = open_existing(location)
    statuses = scan(storage) if step is None else [_verify_step(storage, step, location)]
    if as_json:
        echo_json(
            [
                {
                    "step": s.step,
                    "ok": s.ok,
                    "error": s.error,
                    "fingerprint": s.manifest.fingerprint if s.manifest else None,
                }
                for s in statuses
            ]
        )
    else:
        for s in statuses:
            click.echo(f"step {s.step:>8}  {'ok' if s.ok else 'CORRUPT: ' + str(s.error)}")
    if not statuses:
        hint = misplaced_hint(storage, location)
        raise NoVerifiedCheckpointError(
            f"{storage.uri}: no checkpoints to verify" + (f"\nhint: {hint}" if hint else "")
        )
    newest = statuses[0]
    if not newest.ok:
        older_ok = [s.step for s in statuses if s.ok]
        fallback = f"; newest that verifies: step {older_ok[0]}" if older_ok else ""
        raise IntegrityError(f"step {newest.step} at {storage.uri} is corrupt{fallback}")


def _verify_step(storage: Storage, step: int, location: str) -> CheckpointStatus:
    """The verdict on one step; NoVerifiedCheckpointError when nothing of it is there."""
    from runner.checkpoint.hints import misplaced_hint
    from runner.checkpoint.layout import checkpoint_key
    from runner.checkpoint.listing import list_checkpoints
    from runner.checkpoint.verify import CheckpointStatus, verify_checkpoint
    from runner.errors import RunnerError

    if not any(True for _ in storage.list(f"{checkpoint_key(step)}/")):
        steps = list_checkpoints(storage)
        present = ", ".join(str(s) for s in steps[-5:]) or "none"
        hint = None if steps else misplaced_hint(storage, location)
        raise NoVerifiedCheckpointError(
            f"{storage.uri} has no checkpoint at step {step} (newest steps: {present})"
            + (f"\nhint: {hint}" if hint else "")
        )
    try:
        return CheckpointStatus(step, True, None, verify_checkpoint(storage, step))
    except RunnerError as exc:
        return CheckpointStatus(step, False, str(exc), None)


@click.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@json_output
def inspect(path: Path, as_json: bool) -> None:
    """Show a manifest, a checkpoint directory's manifest, or a seed .bin header."""
    from runner.checkpoint.layout import MANIFEST_NAME
    from runner.checkpoint.manifest import Manifest

    if path.is_file() and path.suffix == ".bin":
        from runner.checkpoint.formats.seedbin import expected_size, read_header

        header = read_header(path)
        info: dict[str, Any] = {
            "kind": "seed-bin",
            "path": str(path),
            "step": header.step,
            "n_params": header.n_params,
            "size": header.size,
            "expected_size": expected_size(header.n_params),
        }
    else:
        manifest_path = path / MANIFEST_NAME if path.is_dir() else path
        if not manifest_path.is_file() or manifest_path.suffix != ".json":
            raise ConfigError(
                f"{path}: not a seed .bin, a manifest.json, or a checkpoint directory holding "
                "one; pass the checkpoint directory (e.g. RUN_DIR/checkpoints/step_000100)"
            )
        from runner.checkpoint.manifest import MAX_MANIFEST_BYTES

        # read bounded, as every reader does (from_json refuses what is over the bound);
        # shown even when it disagrees with its directory: `verify` judges, inspect shows
        with open(manifest_path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        manifest = Manifest.from_json(raw, source=str(manifest_path))
        info = {"kind": "manifest", "path": str(manifest_path), **json.loads(manifest.to_json())}
        if manifest.format == FORMAT_DCP:
            from runner.checkpoint.formats.dcp import rank_totals

            info["ranks"] = [
                {"rank": rank, "files": count, "bytes": size}
                for rank, count, size in rank_totals(manifest.files)
            ]
    if as_json:
        echo_json(info)
        return
    for key, value in info.items():
        if key == "files":
            click.echo("files:")
            for f in value:
                click.echo(f"  {f['path']}  {f['size']} bytes  sha256 {f['sha256']}")
        elif key == "ranks":
            click.echo(f"ranks:\n  {'RANK':>6}  {'FILES':>6}  {'BYTES':>14}")
            for r in value:
                rank = "-" if r["rank"] is None else r["rank"]
                click.echo(f"  {rank:>6}  {r['files']:>6}  {r['bytes']:>14}")
        else:
            click.echo(f"{key}: {value}")
