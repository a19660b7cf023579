"""`runner goodput LOCATION [--json] [--plot FILE]`: what the run's wall time turned into,
from its attempt records alone (run dir or mirror: DESIGN.md, 'Goodput')."""

from __future__ import annotations

from pathlib import Path

import click

from runner.cli.formatting import echo_json, human_duration
from runner.cli.options import json_output, store_timeout
from runner.errors import ConfigError


@click.command()
@store_timeout
@click.argument("location")
@json_output
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw the timeline (attempts, checkpoints, ends) into this .svg file.",
)
def goodput(location: str, as_json: bool, plot: Path | None) -> None:
    """Split the run's wall time at LOCATION (run dir, file:// or s3:// mirror) into goodput
    and badput (startup, restore, checkpoint_stall, wasted_progress, between_attempts, other),
    with one row per attempt."""
    from runner.goodput.account import account
    from runner.goodput.history import records_at
    from runner.storage import open_existing

    if plot is not None and plot.suffix.lower() != ".svg":
        raise ConfigError(f"--plot {plot}: give a .svg file (the timeline is drawn as SVG)")
    records = records_at(open_existing(location))
    if not records:
        raise ConfigError(
            f"{location}: no attempt records (attempts/*.jsonl); runs started by this version "
            "of the runner write them; give the run dir or the mirror of such a run"
        )
    result = account(records)
    if plot is not None:
        from runner.goodput.plot import timeline_svg

        plot.write_text(timeline_svg(result, records))
    if as_json:
        echo_json(result.to_json())
        return
    _render(result)
    if plot is not None:
        click.echo(f"timeline written to {plot}")


def _render(result: object) -> None:
    from runner.goodput.account import Goodput

    assert isinstance(result, Goodput)
    wall = result.wall_seconds or 1.0
    click.echo(
        f"wall {human_duration(result.wall_seconds)} ({result.wall_seconds:.1f} s): "
        f"goodput {result.goodput_ratio:.1%} ({result.goodput_seconds:.1f} s)"
    )
    for kind, seconds in result.badput_seconds.items():
        click.echo(f"  {kind:<17} {seconds:10.1f} s  {seconds / wall:6.1%}")
    click.echo(
        f"preemptions with notice {result.preemptions_with_notice}, failures without notice "
        f"{result.failures_without_notice}, resumes {result.resumes}, steps redone "
        f"{result.steps_redone}"
    )
    click.echo(f"{'attempt':<40} {'end':<9} {'exit':>4} {'steps':>13} {'seconds':>9}")
    for a in result.attempts:
        steps = f"{a.first_step}-{a.last_step}"
        code = "-" if a.exit_code is None else str(a.exit_code)
        click.echo(
            f"{a.attempt:<40} {a.end:<9} {code:>4} {steps:>13} {a.ended_at - a.started_at:9.1f}"
        )
