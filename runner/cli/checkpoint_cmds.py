"""Checkpoint commands: ls, verify, inspect, convert, fork, prune.

LOCATION is a run dir, `file:///path` or `s3://bucket/prefix`: everything but `convert` goes
through the storage protocol. Commands raise typed errors; cli/main.py turns them into exit
codes (3 for integrity failures).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import click

from runner.checkpoint.manifest import created_at_unix
from runner.checkpoint.orphans import ORPHAN_MIN_AGE_S
from runner.cli.formatting import human_duration, human_size
from runner.cli.options import STEP, store_timeout
from runner.errors import ConfigError, IntegrityError, NoVerifiedCheckpointError

_json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _age(created_at: str, *, now: float) -> float | None:
    created = created_at_unix(created_at)
    return None if created is None else now - created


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


@click.command()
@store_timeout
@click.argument("location")
@click.option("--verify", "deep", is_flag=True, help="Also hash every file (slower).")
@_json_option
def ls(location: str, deep: bool, as_json: bool) -> None:
    """List the checkpoints at LOCATION: step, size, age, format, verified."""
    from runner.checkpoint.hints import misplaced_hint
    from runner.checkpoint.listing import list_checkpoints, read_manifest
    from runner.checkpoint.verify import verify_checkpoint
    from runner.errors import RunnerError
    from runner.storage import open_existing

    storage = open_existing(location)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for step in reversed(list_checkpoints(storage)):
        row: dict[str, Any] = {"step": step, "verified": None, "error": None}
        manifest = None
        try:
            manifest = verify_checkpoint(storage, step) if deep else read_manifest(storage, step)
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
            )
        rows.append(row)
    hint = None if rows else misplaced_hint(storage, location)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        click.echo(f"no checkpoints at {storage.uri}")
        return
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
@_json_option
def verify(location: str, step: int | None, as_json: bool) -> None:
    """Hash every file of every checkpoint at LOCATION and name each corrupt one.

    Exits 3 when the newest checkpoint (or --step) is corrupt, or when there is none."""
    from runner.checkpoint.hints import misplaced_hint
    from runner.checkpoint.layout import checkpoint_key
    from runner.checkpoint.listing import list_checkpoints
    from runner.checkpoint.verify import CheckpointStatus, scan, verify_checkpoint
    from runner.errors import RunnerError
    from runner.storage import open_existing

    storage = open_existing(location)
    if step is not None:
        if not any(True for _ in storage.list(f"{checkpoint_key(step)}/")):
            steps = list_checkpoints(storage)
            present = ", ".join(str(s) for s in steps[-5:]) or "none"
            hint = None if steps else misplaced_hint(storage, location)
            raise NoVerifiedCheckpointError(
                f"{storage.uri} has no checkpoint at step {step} (newest steps: {present})"
                + (f"\nhint: {hint}" if hint else "")
            )
        try:
            statuses = [CheckpointStatus(step, True, None, verify_checkpoint(storage, step))]
        except RunnerError as exc:
            statuses = [CheckpointStatus(step, False, str(exc), None)]
    else:
        statuses = scan(storage)
    if as_json:
        _echo_json(
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


@click.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@_json_option
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
    if as_json:
        _echo_json(info)
        return
    for key, value in info.items():
        if key == "files":
            click.echo("files:")
            for f in value:
                click.echo(f"  {f['path']}  {f['size']} bytes  sha256 {f['sha256']}")
        else:
            click.echo(f"{key}: {value}")


@click.command()
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "--samples-seen",
    type=click.IntRange(min=0),
    default=0,
    help="Recorded when SRC is a seed .bin.",
)
@_json_option
def convert(src: Path, dst: Path, samples_seen: int, as_json: bool) -> None:
    """Seed .bin <-> checkpoint directory.

    `convert step_000123.bin RUN_DIR` adds RUN_DIR/checkpoints/step_000123/;
    `convert RUN_DIR[/checkpoints/step_N] OUT.bin` writes the seed file (from the newest
    checkpoint that verifies when given a run dir). Never overwrites anything."""
    from runner.checkpoint.convert import bin_to_run_dir, checkpoint_to_bin

    if src.is_file():
        result = bin_to_run_dir(
            src, dst, samples_seen=samples_seen, writer_id=f"convert-{uuid.uuid4().hex[:8]}"
        )
        info = {"src": str(src), "dst": str(result.path), "step": result.step}
    else:
        step, size = checkpoint_to_bin(src, dst)
        info = {"src": str(src), "dst": str(dst), "step": step, "size": size}
    if as_json:
        _echo_json(info)
    else:
        click.echo(f"wrote {info['dst']} (step {info['step']})")


@click.command()
@store_timeout
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=STEP, default=None, help="Fork from this step (default: newest).")
@_json_option
def fork(src: str, dst: Path, step: int | None, as_json: bool) -> None:
    """Start a new run dir DST from one checkpoint of SRC (audit fork: own run_id, loss
    history up to that step)."""
    from runner.mirror.fork import fork_run
    from runner.storage import open_existing

    result = fork_run(open_existing(src), dst, step=step, writer_id=f"fork-{uuid.uuid4().hex[:8]}")
    info = {
        "dst": str(dst),
        "run_id": result.run_id,
        "step": result.checkpoint.step,
        "fingerprint": result.checkpoint.manifest.fingerprint,
        "loss_steps": result.loss_steps,
        "skipped": [{"step": s, "error": e} for s, e in result.skipped],
    }
    if as_json:
        _echo_json(info)
        return
    for s, e in result.skipped:
        click.echo(f"skipped step {s}: {e}", err=True)
    click.echo(
        f"forked step {info['step']} into {dst} as run {info['run_id']} "
        f"({info['loss_steps']} loss lines)"
    )


@click.command()
@store_timeout
@click.argument("location")
@click.option("--keep", type=int, required=True, help="Checkpoints to keep (>= 2).")
@click.option(
    "--orphan-age-hours",
    type=click.FloatRange(min=0),
    default=ORPHAN_MIN_AGE_S / 3600,
    show_default=True,
    help="Also delete objects no manifest names (uploads killed with their node, lost "
    "manifest races) once they are this old. A step without a manifest counts only below "
    "the newest committed one.",
)
@_json_option
def prune(location: str, keep: int, orphan_age_hours: float, as_json: bool) -> None:
    """Keep the newest K usable checkpoints and delete older ones (a corrupt one is never
    counted among the K, one of a newer schema never deleted); a run dir is locked meanwhile,
    so a trainer writing it makes this exit 2."""
    from runner.checkpoint.orphans import sweep_orphans
    from runner.checkpoint.retention import prune as prune_storage
    from runner.runtime import runlock
    from runner.storage import is_run_dir_path, open_existing

    storage = open_existing(location)
    with contextlib.ExitStack() as stack:
        if is_run_dir_path(location):
            # a live trainer's in-flight checkpoints are protected only inside its process
            stack.enter_context(runlock.acquire(Path(location), command="runner prune"))
        deleted = prune_storage(storage, keep=keep)
        sweep = sweep_orphans(storage, older_than_s=orphan_age_hours * 3600)
    if as_json:
        _echo_json(
            {
                "deleted": deleted,
                "orphans_deleted": [info.key for info in sweep.deleted],
                "orphan_bytes": sweep.bytes,
            }
        )
        return
    if deleted:
        click.echo(f"deleted steps {', '.join(map(str, deleted))}")
    if sweep.deleted:
        click.echo(
            f"deleted {len(sweep.deleted)} orphan object{'s' if len(sweep.deleted) != 1 else ''} "
            f"({human_size(sweep.bytes)}) that no manifest names"
        )
    if not deleted and not sweep.deleted:
        click.echo("nothing to prune")
