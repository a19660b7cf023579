"""`runner run [OPTIONS] -- CMD [ARGS...]`: supervise any trainer (DESIGN.md, Supervisor)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from runner.cli import options
from runner.config import RunConfig

log = logging.getLogger(__name__)


@click.command(context_settings={"ignore_unknown_options": False})
@options.run_options
@options.max_restarts
@options.restart_backoff
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    command: tuple[str, ...],
    run_dir: str,
    mirror: str | None,
    steps: int | None,
    ckpt_every: int,
    ckpt_every_seconds: float | None,
    keep: int,
    grace_seconds: float,
    metrics_port: int,
    notices: str,
    notice_poll_seconds: float,
    notice_endpoint: str | None,
    seed: int,
    max_restarts: int,
    restart_backoff: float,
) -> None:
    """Supervise a trainer written in any language.

    The trainer gets RUNNER_RUN_DIR, RUNNER_CKPT_DIR and RUNNER_RESUME_FROM (the newest
    verified checkpoint's payload, empty when none). Seed-format step_NNNNNN.bin files it
    writes into RUNNER_CKPT_DIR (temp name, then rename) are checked, committed with a
    manifest, mirrored and handed back on resume. SIGTERM/SIGINT/SIGUSR1 are forwarded to its
    process group; crashes are restarted with exponential backoff up to --max-restarts.

    Exit codes: 0 the trainer finished, 75 stopped by a signal or a preemption notice.
    """
    config = RunConfig(
        run_dir=Path(run_dir),
        mirror=mirror,
        steps=steps,
        ckpt_every=ckpt_every,
        ckpt_every_seconds=ckpt_every_seconds,
        keep=keep,
        grace_seconds=grace_seconds,
        metrics_port=metrics_port,
        notices=notices,
        notice_poll_seconds=notice_poll_seconds,
        notice_endpoint=notice_endpoint,
        max_restarts=max_restarts,
        seed=seed,
    )
    if restart_backoff < 0:
        from runner.errors import ConfigError

        raise ConfigError(f"--restart-backoff must be >= 0 (got {restart_backoff})")
    sys.exit(supervise(list(command), config=config, restart_backoff=restart_backoff))


def supervise(command: list[str], *, config: RunConfig, restart_backoff: float = 1.0) -> int:
    """Entry point body: signal handlers, notices, metrics and mirror around a Supervisor."""
    from runner.preemption.notices import start_notice_poller
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController
    from runner.supervisor import Supervisor

    controller = StopController()
    restore = install_signal_handlers(controller, grace_seconds=config.grace_seconds)
    with contextlib.ExitStack() as stack:
        stack.callback(restore)
        stack.callback(controller.close)
        metrics = _start_metrics(config, stack)
        poller = start_notice_poller(config, controller, metrics)
        if poller is not None:
            stack.callback(poller.close)
        mirror, resolve = _mirror_hooks(config, metrics, stack)
        code = Supervisor(
            command,
            config=config,
            controller=controller,
            mirror=mirror,
            metrics=metrics,
            resolve_resume=resolve,
            restart_backoff=restart_backoff,
        ).run()
    return code


def _start_metrics(config: RunConfig, stack: contextlib.ExitStack) -> Any:
    if config.metrics_port == 0:
        return None
    from runner.metrics import RunnerMetrics
    from runner.metrics_server import serve_metrics

    metrics = RunnerMetrics()
    server = serve_metrics(metrics, host=config.metrics_host, port=config.metrics_port)
    stack.callback(server.close)
    log.info("metrics on %s", server.url)
    return metrics


def _mirror_hooks(config: RunConfig, metrics: Any, stack: contextlib.ExitStack) -> tuple[Any, Any]:
    """(mirror, resolve_resume) for --mirror; (None, None) without one."""
    if config.mirror is None:
        return None, None
    from runner.mirror.resume import resolve_resume
    from runner.storage import open_storage

    storage = open_storage(config.mirror)

    def resolve(run_dir: Path, on_skip: Callable[[int, str], None] | None) -> Path | None:
        return resolve_resume(run_dir, storage, on_skip=on_skip)

    mirror = _make_mirror(storage, config=config, metrics=metrics)
    if mirror is not None:
        stack.callback(mirror.close)
    return mirror, resolve


def _make_mirror(storage: Any, *, config: RunConfig, metrics: Any) -> Any:
    from runner.mirror import Mirror

    return Mirror(storage, keep=config.keep, writer_id=config.writer_id, metrics=metrics)
