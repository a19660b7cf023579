"""One trainer process: started in its own group, watched (stop and checkpoint requests
forwarded to the group, a kill at the end of the grace period, its checkpoints scanned for,
exited orphans reaped), and what it left running swept once it exited."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from runner.preemption.stop import StopController
from runner.supervisor.child import AttemptOutput, ChildProcess
from runner.supervisor.hooks import MetricsHook
from runner.supervisor.reap import SWEEP_GRACE_SECONDS
from runner.supervisor.torchrun import PlainTrainer

# the supervisor's lines keep the one logger name they have always had
log = logging.getLogger("runner.supervisor.supervise")

# How often exited orphans of a running trainer are reaped (each time a scan of /proc).
REAP_INTERVAL_SECONDS = 1.0


def start_trainer(
    command: Sequence[str],
    *,
    env: dict[str, str],
    output: AttemptOutput,
    stdout: BinaryIO,
    stderr: BinaryIO,
    lock_fd: int | None,
    resume_from: str,
) -> ChildProcess:
    """The trainer of attempt `output.attempt`, its last lines kept in `output`; `lock_fd`
    (the run dir lock) stays open in it."""
    child = ChildProcess(
        command,
        env=env,
        stdout=stdout,
        stderr=stderr,
        tail=output.tail,
        # an orphaned trainer (supervisor SIGKILLed) keeps the run dir locked: no second
        # supervisor starts a second writer beside it
        pass_fds=() if lock_fd is None else (lock_fd,),
    )
    output.pid = child.pid
    log.info(
        "started trainer pid %d (attempt %d), resume from %s",
        child.pid,
        output.attempt,
        resume_from,
    )
    return child


@dataclass(frozen=True)
class Watched:
    """How the watch ended: when the stop was forwarded (monotonic, None if the trainer
    ended on its own) and whether it was killed at the end of the grace period."""

    stop_sent_at: float | None
    killed: bool


def watch(
    child: ChildProcess,
    controller: StopController,
    *,
    scan_interval: float,
    scan: Callable[[], None],
    before_stop: Callable[[], None],
    metrics: MetricsHook | None,
    launcher: PlainTrainer | None = None,
) -> Watched:
    """Until the trainer exits: forward signals, call `scan()` (adopt its checkpoints, report
    its step) every `scan_interval`; `before_stop()` runs just before the stop is forwarded.
    `launcher` says how SIGUSR1 and the kill reach it (runner/supervisor/torchrun.py)."""
    launcher = launcher or PlainTrainer()
    stop_sent_at: float | None = None
    killed = False
    checkpoint_pending = False  # a SIGUSR1 nothing could take yet (torchrun's workers)
    next_reap = time.monotonic() + REAP_INTERVAL_SECONDS
    while child.poll() is None:
        if controller.stop_requested and stop_sent_at is None:
            before_stop()
            stop_sent_at = forward_stop(child, controller, metrics, launcher)
        if controller.take_checkpoint_request() is not None:
            checkpoint_pending = True
        if checkpoint_pending and stop_sent_at is None:
            checkpoint_pending = not launcher.checkpoint(child)
        time_left = controller.time_left()
        if stop_sent_at is not None and not killed and time_left is not None and time_left <= 0:
            log.error(
                "grace period over and the trainer is still running: killing its group; "
                "the last checkpoint it committed is the one that counts"
            )
            launcher.kill(child)
            killed = True
        scan()
        if time.monotonic() >= next_reap:
            # exited orphans re-parented to us (a trainer running `cmd &`) are not left
            # as zombies until the pod's pid limit
            child.reap_orphans()
            launcher.watch(child)
            next_reap = time.monotonic() + REAP_INTERVAL_SECONDS
        wait = scan_interval
        if time_left is not None and not killed:
            wait = max(0.0, min(wait, time_left))
        controller.wait_any(wait)
    return Watched(stop_sent_at=stop_sent_at, killed=killed)


def forward_stop(
    child: ChildProcess,
    controller: StopController,
    metrics: MetricsHook | None,
    launcher: PlainTrainer | None = None,
) -> float:
    """SIGINT for a SIGINT, else SIGTERM, to the trainer's group (or where `launcher` says:
    runner/supervisor/torchrun.py); returns when (monotonic)."""
    reason = controller.reason or "stop"
    sig = signal.SIGINT if reason == "SIGINT" else signal.SIGTERM
    to = (launcher or PlainTrainer()).stop(child, sig)
    if reason in ("SIGTERM", "SIGINT") and metrics is not None:
        metrics.preemption_notice("sigterm")
    left = controller.time_left()
    log.warning(
        "%s: forwarded %s to %s; %s",
        reason,
        sig.name,
        to,
        f"{left:.1f} s of grace left" if left is not None else "no deadline",
    )
    return time.monotonic()


def sweep_grace(controller: StopController) -> float:
    """SIGTERM to SIGKILL for leftovers: short, shorter still near a stop deadline, and
    none (SIGKILL at once) once it has passed."""
    left = controller.time_left()
    if left is None:
        return SWEEP_GRACE_SECONDS
    return min(SWEEP_GRACE_SECONDS, max(0.0, left))


def sweep(child: ChildProcess, controller: StopController) -> None:
    """Every process the exited trainer left behind, terminated (and logged)."""
    child.sweep(grace_seconds=sweep_grace(controller))
    swept = child.swept  # including those swept while the output drained
    if swept:
        log.warning(
            "the trainer (pid %d) left %d process(es) running after it exited: terminated pids %s",
            child.pid,
            len(swept),
            " ".join(str(pid) for pid in swept),
        )
