"""`runner run [OPTIONS] -- CMD [ARGS...]`: supervise any trainer (DESIGN.md, Supervisor)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Any

import click

from runner.cli import options
from runner.config import RunConfig

log = logging.getLogger(__name__)


@click.command(context_settings={"ignore_unknown_options": False})
@options.run_options
@options.adopt
@options.adopt_quiet_seconds
@options.max_restarts
@options.restart_backoff
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...], **params: Any) -> None:
    """Supervise a trainer written in any language.

    The trainer gets RUNNER_RUN_DIR, RUNNER_CKPT_DIR, RUNNER_RESUME_FROM (the newest
    verified checkpoint's payload, empty when none), RUNNER_RESUME_FORMAT (its format:
    seed-bin, torch-state, torch-chunked or files; a trainer refuses one it cannot read),
    RUNNER_RESUME_STEP, RUNNER_ATTEMPT and RUNNER_RUN_LOCK_TOKEN (README: "Supervise any
    trainer"). Seed-format step_NNNNNN.bin files it writes into RUNNER_CKPT_DIR (temp name,
    then rename) are checked, committed with a manifest, mirrored and handed back on resume.
    SIGTERM/SIGINT/SIGUSR1 are forwarded to its process group; under torchrun (`runner run
    -- torchrun ...`) SIGUSR1 goes to each worker instead (torchrun would die of it), and
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT defaults to the grace period. One node of several
    (`torchrun --nnodes N`, N > 1) needs --mirror: the ranks commit there themselves (they
    get RUNNER_MIRROR), a stop goes to each worker and their exit code is passed on (75 when
    every rank exited 75). An exit other than 0, 2, 3
    and 75, or a death by a signal we did not send, is restarted with exponential backoff up
    to --max-restarts. Every process the trainer leaves behind is terminated before the next
    attempt or the exit, whatever its process group or session.

    Only finished files are adopted: renamed into place, or any once the trainer exited;
    never one still open for writing.

    --adopt PATTERN (README: "Your trainer's own checkpoints"): the checkpoints the trainer
    writes itself (HF's out/checkpoint-N, Lightning's ckpts/step=N.ckpt), matched by a glob
    relative to its working directory, the step being the last integer of the name, are
    copied into the run dir as `files` checkpoints once finished (no file open for writing,
    nothing changed for --adopt-quiet-seconds, or renamed in, or the trainer exited),
    mirrored, and the newest is put back at its path before the trainer starts (also on an
    empty node, from the mirror): RUNNER_RESUME_FROM names it.

    Exit codes: 0 the trainer finished; 75 stopped by a signal or a preemption notice with a
    final checkpoint committed (also when torchrun exits 1 for workers that exited 75); 1
    stopped without one (e.g. killed at the end of the grace
    period), or it kept crashing; 2 / 3 the trainer exited 2 / 3 (not restarted); 3 also
    when its newest checkpoint was rejected (kept as .rejected) and no later one was
    committed. With --mirror, a trainer that finished without its newest checkpoint in the
    mirror, or without any, ends in 1; with --adopt, a stop ends in 75 only when a
    checkpoint was adopted during it.
    """
    config = options.config_from_options(**params)
    # A supervisor is no rank: torchrun's variables are not read here (a stray contradictory
    # RANK/WORLD_SIZE must not stop it); its trainer inherits them with the environment.
    sys.exit(supervise(list(command), config=config))


# Not the demo's runs/demo: after `runner demo`, a trainer supervised with the default run dir
# would be handed the demo's torch checkpoint to resume from.
RUN_DEFAULT_DIR = "runs/run"
for _param in run.params:
    if _param.name == "run_dir":
        _param.default = RUN_DEFAULT_DIR


def supervise(command: list[str], *, config: RunConfig) -> int:
    """Entry point body: signal handlers, notices, metrics and mirror around a Supervisor."""
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController
    from runner.runtime.rank import SINGLE_PROCESS
    from runner.runtime.services import run_services
    from runner.supervisor.multinode import multi_node_mode
    from runner.supervisor.reap import become_subreaper
    from runner.supervisor.supervise import Supervisor

    # one node of several: refused without --mirror before anything starts, and the mirror
    # is its ranks' (runner/supervisor/multinode.py), not a service of this process
    nodes = multi_node_mode(command, config)
    services_config = config if nodes is None else dataclasses.replace(config, mirror=None)
    controller = StopController()
    restore = install_signal_handlers(controller, grace_seconds=config.grace_seconds)
    # Orphans of the trainer's tree (a `setsid` helper, a double-forked daemon) re-parent to
    # us, so the supervisor's sweep finds and stops them (runner/supervisor/reap.py).
    become_subreaper()
    with contextlib.ExitStack() as stack:
        stack.callback(restore)
        stack.callback(controller.close)
        # the supervisor does the run's single-writer work, whatever rank its trainer is
        services = stack.enter_context(
            run_services(services_config, controller, rank=SINGLE_PROCESS)
        )
        code = Supervisor(
            command,
            config=config,
            controller=controller,
            mirror=services.mirror,
            metrics=services.metrics,
            restart_backoff=config.restart_backoff,
        ).run()
    return code
