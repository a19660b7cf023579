"""`runner pivot RUN_DIR`: archive and reset the policy sidecars, keep the loss history."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runner.cli.options import json_output
from runner.sidecars import pivot as pivot_sidecars


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@json_output
def pivot(run_dir: Path, as_json: bool) -> None:
    """Archive samples.json and state.json with a timestamp and reset them.

    Use it between "checkpoint and stop" and "restart with the new policy"; loss.jsonl,
    the run's audit trail, is never touched.
    """
    archived = pivot_sidecars(run_dir)
    if as_json:
        click.echo(json.dumps({"archived": [str(p) for p in archived]}))
    elif archived:
        for path in archived:
            click.echo(f"archived {path}")
    else:
        click.echo(f"{run_dir}: no samples.json or state.json to archive")
