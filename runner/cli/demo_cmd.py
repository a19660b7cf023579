"""`runner demo` (the built-in job) and `runner drill` (the resume audit)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from runner.cli import options
from runner.config import SAVE_MODES, RunConfig
from runner.demo.sharding import PARALLEL_MODES
from runner.errors import IntegrityError


@click.command()
@options.run_options
@options.collective_timeout
@click.option("--batch-size", envvar="RUNNER_BATCH_SIZE", type=int, default=16, show_default=True)
@click.option(
    "--device",
    envvar="RUNNER_DEVICE",
    default=RunConfig.default("device"),
    show_default=True,
    help="auto (CUDA when present), cpu or cuda[:N].",
)
@click.option(
    "--threads",
    envvar="RUNNER_THREADS",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch CPU threads; CPU results are bit-exact only at the same count.",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Live progress line (default: when stderr is a terminal).",
)
@click.option(
    "--sample-log",
    envvar="RUNNER_SAMPLE_LOG",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Append each step's sample indices to this file as JSON lines (per rank under "
    "torchrun: FILE.rank<R>), to audit that every sample is consumed once across resumes.",
)
@click.option(
    "--parallel",
    envvar="RUNNER_PARALLEL",
    type=click.Choice(PARALLEL_MODES),
    default="ddp",
    show_default=True,
    help="How several ranks (torchrun) train: ddp, or fsdp (FSDP2 fully_shard: each rank "
    "holds a shard of the model and optimizer state). Ignored for one process.",
)
@click.option(
    "--supervised-attempt",
    "attempt",
    envvar="RUNNER_ATTEMPT",
    default=None,
    hidden=True,
    help="Set by `runner run` for its trainer (RUNNER_ATTEMPT: 1, 2, ...).",
)
def demo(
    batch_size: int,
    progress: bool | None,
    threads: int | None,
    attempt: str | None,
    sample_log: Path | None,
    parallel: str,
    **kwargs: Any,
) -> None:
    """Train a small GPT-style character model; re-running the same command resumes.

    SIGTERM/SIGINT: finish the step, commit the final checkpoint, exit 75.
    SIGUSR1: checkpoint at the end of the current step and keep training."""
    from runner.runtime import runlock
    from runner.runtime.rank import launch_context

    config = options.config_from_options(**kwargs)
    # torchrun's variables, read here with every other setting
    rank = launch_context(os.environ)
    # The run dir's lock before torch is imported (a second demo on it exits 2 in a fraction
    # of a second); TrainSession takes it again, sharing this process's hold. Under torchrun
    # the node's local rank 0 holds it for the job's ranks.
    lock = (
        runlock.acquire(config.run_dir, command="runner demo")
        if rank.acts_as_node_primary
        else contextlib.nullcontext()
    )
    with lock:
        from runner.demo.job import run_demo

        # Under `runner run` the supervisor resolved this run dir first and logged what it
        # refused: not logged a second time. Told by RUNNER_ATTEMPT, never empty there (click
        # takes an empty variable for unset: RUNNER_RESUME_FROM is empty when none stands).
        code = run_demo(
            config,
            batch_size=batch_size,
            progress=progress,
            threads=threads,
            supervised=bool(attempt),
            rank=rank,
            sample_log=sample_log,
            parallel=parallel,
        )
    sys.exit(code)


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--steps", type=int, default=60, show_default=True, help="Steps of each run.")
@click.option("--stop-at", type=int, default=None, help="Step to SIGTERM at (default: random).")
@click.option(
    "--seed",
    type=int,
    default=None,
    help="The demo's seed (default 0); with a CMD, the seed of the drawn stop step (default: "
    "random, printed: give it to replay).",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the runs here (default: a temporary directory).",
)
@click.option(
    "--ranks",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Ranks of each run (torchrun, gloo on CPU); SIGTERM goes to the last rank.",
)
@click.option(
    "--resume-ranks",
    type=click.IntRange(min=1),
    default=None,
    help="Also resume the stopped checkpoint at this many ranks and audit its samples "
    "(default with --ranks > 1: 1).",
)
@click.option(
    "--save-mode",
    envvar="RUNNER_SAVE_MODE",
    type=click.Choice(SAVE_MODES),
    default=RunConfig.default("save_mode"),
    show_default=True,
    help="The save mode of every run of the drill (runner demo --save-mode).",
)
@options.json_output
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def drill(
    command: tuple[str, ...],
    steps: int,
    stop_at: int | None,
    seed: int | None,
    work_dir: str | None,
    ranks: int,
    resume_ranks: int | None,
    save_mode: str,
    as_json: bool,
) -> None:
    """Resume audit: straight run vs SIGTERM + resume in a fresh process, plus what each
    omission (optimizer state, data position, fp32 weights, RNG) would have cost.

    `runner drill [--stop-at N] [--seed S] [--work-dir D] -- CMD ...` audits your own script
    (built on TrainSession or an integration) instead of the demo: CMD straight, then CMD
    with SIGTERM at a random step after its first checkpoint and CMD again, each copy in a
    fresh working directory (a relative run dir lands there) without RUNNER_MIRROR; exit 0
    "exact", or exit 3 with the first step whose loss differs and its likely causes.

    With --ranks N (or --resume-ranks): the runs on N ranks, and the stopped checkpoint
    resumed at M ranks must end at the straight run's samples_seen, every sample consumed
    exactly once. The omission table is single-process: skipped there."""
    from runner.demo.ablations import format_table, run_ablation_study
    from runner.demo.drill import report_json, run_drill

    if command:
        from runner.cli.drill_cmd import drill_script

        drill_script(list(command), stop_at=stop_at, seed=seed, work_dir=work_dir, as_json=as_json)
        return
    seed = 0 if seed is None else seed

    if steps < 2 or (stop_at is not None and not 0 < stop_at < steps):
        raise click.BadParameter("need --steps >= 2 and 0 < --stop-at < --steps")
    # every run of the drill is a `runner demo` child: it reads its save mode from here
    os.environ["RUNNER_SAVE_MODE"] = save_mode
    mode_line = f"save mode: {save_mode}\n"
    if ranks > 1 or resume_ranks not in (None, ranks):
        _ranked_drill(
            work_dir=work_dir,
            steps=steps,
            seed=seed,
            stop_at=stop_at,
            ranks=ranks,
            resume_ranks=resume_ranks,
            save_mode=save_mode,
            as_json=as_json,
        )
        return
    with tempfile.TemporaryDirectory(prefix="runner-drill-") as tmp:
        report = run_drill(work_dir=Path(work_dir or tmp), steps=steps, seed=seed, stop_at=stop_at)
    results = run_ablation_study(steps=steps, stop_at=min(report.stopped_at, steps - 1), seed=seed)
    if as_json:
        click.echo(
            _with_mode(report_json(report, [dataclasses.asdict(r) for r in results]), save_mode)
        )
    else:
        verdict = "IDENTICAL" if report.exact else "DIFFERENT"
        click.echo(
            f"{mode_line}straight {steps} steps vs SIGTERM at step {report.stopped_at} + "
            f"resume in a fresh process: {verdict}\n"
            f"  fingerprint straight {report.straight.fingerprint[:16]}  "
            f"resumed {report.resumed.fingerprint[:16]}\n"
            f"  loss history: {report.loss_verdict()}\n"
        )
        click.echo("What each omission costs (vs the straight run):")
        click.echo(format_table(results))
    if not report.exact:
        raise IntegrityError("the resumed run differs from the straight run: resume is not exact")


def _ranked_drill(
    *,
    work_dir: str | None,
    steps: int,
    seed: int,
    stop_at: int | None,
    ranks: int,
    resume_ranks: int | None,
    save_mode: str,
    as_json: bool,
) -> None:
    """`drill` on several ranks (torchrun), or resumed at another rank count: the runs and
    their sample audit, reported; IntegrityError when the audit fails. No omission table:
    the ablations are single-process."""
    from runner.demo import drill_ranks, drill_ranks_report
    from runner.demo.drill import random_stop_step

    with tempfile.TemporaryDirectory(prefix="runner-drill-") as tmp:
        ranked = drill_ranks.run_ranked_drill(
            work_dir=Path(work_dir or tmp),
            steps=steps,
            seed=seed,
            stop_at=random_stop_step(steps) if stop_at is None else stop_at,
            ranks=ranks,
            resume_ranks=resume_ranks or 1,
        )
    if as_json:
        click.echo(_with_mode(drill_ranks_report.report_json(ranked), save_mode))
    else:
        click.echo(f"save mode: {save_mode}\n" + drill_ranks_report.report_text(ranked))
    if (failure := ranked.failure()) is not None:
        raise IntegrityError(failure)


def _with_mode(report: str, save_mode: str) -> str:
    """A drill's JSON report with the save mode its runs used."""
    import json

    return json.dumps({"save_mode": save_mode, **json.loads(report)}, indent=2)
