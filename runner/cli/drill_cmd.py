"""`runner drill -- CMD ...`: the resume audit of the user's own script (runner.audit.script)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

from runner.errors import IntegrityError


class NotExactError(IntegrityError):
    """The resumed copy differs from the straight one (exit 3)."""


def drill_script(
    command: list[str],
    *,
    stop_at: int | None,
    seed: int | None,
    work_dir: str | None,
    as_json: bool,
) -> None:
    from runner.audit.script import report_json, report_text, run_script_drill

    if stop_at is not None and stop_at < 1:
        raise click.BadParameter("--stop-at must be >= 1")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    with tempfile.TemporaryDirectory(prefix="runner-drill-") as tmp:
        where = Path(work_dir) if work_dir else Path(tmp)
        if not as_json:
            click.echo(f"drill of {' '.join(command)} in {where} (seed {seed})", err=True)
        report = run_script_drill(command, work_dir=where, seed=seed, stop_at=stop_at)
    click.echo(json.dumps(report_json(report), indent=2) if as_json else report_text(report))
    if not report.exact:
        first = report.differing[0] if report.differing else None
        where_first = f" from step {first}" if first is not None else ""
        raise NotExactError(f"the resumed run differs from the straight one{where_first}")
