"""`runner pivot RUN_DIR`: archive and reset the policy sidecars, keep the loss history."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runner.checkpoint.pivot import pivot as pivot_sidecars
from runner.cli.options import json_output
from runner.errors import ConfigError


@click.command()
@click.argument("run_dir")
@json_output
def pivot(run_dir: str, as_json: bool) -> None:
    """Archive samples.json and state.json with a timestamp and reset them.

    Use it between "checkpoint and stop" and "restart with the new policy"; loss.jsonl,
    the run's audit trail, is never touched.
    """
    from runner.runtime import runlock

    local = _local_run_dir(run_dir)
    # between "checkpoint and stop" and the restart: a trainer still writing it exits this (2)
    with runlock.acquire(local, command="runner pivot"):
        archived = pivot_sidecars(local)
    if as_json:
        click.echo(json.dumps({"archived": [str(p) for p in archived]}))
    elif archived:
        for path in archived:
            click.echo(f"archived {path}")
    else:
        click.echo(f"{run_dir}: no samples.json or state.json to archive")


def _local_run_dir(text: str) -> Path:
    """RUN_DIR as a local directory; messages quote it as typed (a `Path` would print
    `file:///x` as `file:/x`)."""
    from urllib.parse import urlparse

    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{text}: file:// URIs need an absolute path (file:///abs/path)")
        path = Path(parsed.path)
    elif "://" in text:
        raise ConfigError(
            f"{text}: pivot works on the local run directory, where samples.json and "
            "state.json live; a mirror holds only checkpoints"
        )
    else:
        path = Path(text)
    if not path.is_dir():
        raise ConfigError(f"{text}: no such run directory")
    return path
