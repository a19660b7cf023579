"""Checkpoint commands that write: convert, fork, prune (those that read: checkpoint_cmds.py).

`fork` and `prune` take a run dir, `file:///path` or `s3://bucket/prefix` and go through the
storage protocol; `convert` works on local paths. Commands raise typed errors; cli/main.py
turns them into exit codes.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import click

from runner.checkpoint.orphans import ORPHAN_MIN_AGE_S
from runner.cli.formatting import echo_json, human_size
from runner.cli.options import STEP, json_output, store_timeout


@click.command()
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "--samples-seen",
    type=click.IntRange(min=0),
    default=0,
    help="Recorded when SRC is a seed .bin.",
)
@json_output
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
        echo_json(info)
    else:
        click.echo(f"wrote {info['dst']} (step {info['step']})")


@click.command()
@store_timeout
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=STEP, default=None, help="Fork from this step (default: newest).")
@json_output
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
        echo_json(info)
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
@json_output
def prune(location: str, keep: int, orphan_age_hours: float, as_json: bool) -> None:
    """Keep the newest K usable checkpoints and delete older ones (a corrupt one is never
    counted among the K, one of a newer schema never deleted, nor any object a checkpoint set
    aside still names); a run dir is locked meanwhile, so a trainer writing it makes this exit
    2."""
    from runner.checkpoint.aside import protected_keys
    from runner.checkpoint.orphans import sweep_orphans
    from runner.checkpoint.retention import prune as prune_storage
    from runner.runtime import runlock
    from runner.storage import is_run_dir_path, open_existing

    storage = open_existing(location)
    with contextlib.ExitStack() as stack:
        if is_run_dir_path(location):
            # a live trainer's in-flight checkpoints are protected only inside its process
            stack.enter_context(runlock.acquire(Path(location), command="runner prune"))
        aside = protected_keys(storage)  # once for both: what aside records name is kept
        deleted = prune_storage(storage, keep=keep, aside=aside)
        sweep = sweep_orphans(storage, older_than_s=orphan_age_hours * 3600, aside=aside)
    kept_bytes = sum(aside.kept.values())
    if as_json:
        echo_json(
            {
                "deleted": deleted,
                "orphans_deleted": [info.key for info in sweep.deleted],
                "orphan_bytes": sweep.bytes,
                "aside_kept": sorted(aside.kept),
                "aside_kept_bytes": kept_bytes,
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
    if aside.kept:
        click.echo(
            f"kept {len(aside.kept)} object{'s' if len(aside.kept) != 1 else ''} "
            f"({human_size(kept_bytes)}) under checkpoints/ that aside records name: checkpoints "
            "set aside are never deleted (see aside/)"
        )
