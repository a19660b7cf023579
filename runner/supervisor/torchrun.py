"""How signals reach a trainer and what its exit code means: plainly, or through torchrun.

A plain trainer gets every signal in its process group and its exit code is the attempt's.
torchrun (`runner run -- torchrun ...`, also `python -m torch.distributed.run ...`) differs;
what the installed torch (2.x: torch/distributed/elastic) does:

- Each worker is started in a session of its own (`start_new_session`): the trainer's group is
  torchrun alone, and a signal sent to it reaches no worker.
- SIGTERM and SIGINT (also SIGHUP, SIGQUIT): torchrun's handler shuts the workers down with
  the same signal, SIGKILLs those still running TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later
  (30 by default) and exits 1. The supervisor forwards them to torchrun as to any trainer and
  sets that timeout to the grace period (`Torchrun.environment`), so torchrun's SIGKILL never
  comes before the supervisor's own at the deadline (`Torchrun.kill`, workers first).
- SIGUSR1 is not handled: it kills torchrun and orphans the workers. It goes to each worker's
  group instead, once that worker has a handler for it (SigCgt in /proc/PID/status): a
  worker still starting would die of it. The ranks agree on a SIGUSR1 seen by any of them.
- Workers that exit non-zero on their own (every rank exits 75 after a stop one of them saw)
  make torchrun print a ChildFailedError summary, one `exitcode : N (pid: P)` line per failed
  worker, and exit 1. When every failed worker the supervisor saw exited with the same 2, 3 or
  75, that is the attempt's exit code (`Torchrun.exit_code`). After torchrun itself got the
  stop it prints no summary and exits 1 whatever its workers did (`Torchrun.mute_exit`): the
  committed checkpoints and the loss log decide (ending.judge_stop), so ranks stopped while
  still resuming, with nothing trained, end the run with 75 as a lone `runner demo` would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
from collections.abc import Sequence
from pathlib import Path

from runner.errors import EXIT_FAILURE, EXIT_INTEGRITY, EXIT_PREEMPTED, EXIT_USAGE
from runner.supervisor.child import ChildProcess
from runner.supervisor.reap import children_of

# the supervisor's lines keep the one logger name they have always had
log = logging.getLogger("runner.supervisor.supervise")

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
# One line per failed worker in torchrun's ChildFailedError summary (errors/__init__.py).
_EXIT_LINE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s+\(pid:\s*(\d+)\)")
# Worker exit codes that stand for the whole attempt when every failed worker agrees.
_PASSED_ON = frozenset({EXIT_PREEMPTED, EXIT_USAGE, EXIT_INTEGRITY})


def is_torchrun(command: Sequence[str]) -> bool:
    """`torchrun ...` or `python -m torch.distributed.run ...` (or the older `.launch`). Only
    the command itself is looked at: torchrun behind a shell script or `uv run` is a plain
    trainer, and a SIGUSR1 to its group would kill torchrun."""
    if not command:
        return False
    if Path(command[0]).name == "torchrun":
        return True
    # `python -m torch.distributed.run`, interpreter options before -m allowed
    args = list(command[1:])
    return any(args[i] == "-m" and args[i + 1] in _TORCHRUN_MODULES for i in range(len(args) - 1))


class PlainTrainer:
    """Any trainer: signals to its process group, its exit code as it is."""

    name = "the trainer"

    def environment(self, env: dict[str, str], *, grace_seconds: float) -> None:
        """Add what this launcher needs to the trainer's environment (nothing)."""

    def checkpoint(self, child: ChildProcess) -> bool:
        """Deliver SIGUSR1; False when nothing could take it yet (ask again later)."""
        log.info("forwarding SIGUSR1: the trainer checkpoints and continues")
        child.signal_group(signal.SIGUSR1)
        return True

    def kill(self, child: ChildProcess) -> None:
        child.signal_group(signal.SIGKILL)

    def watch(self, child: ChildProcess) -> None:
        """Called now and then while the trainer runs (nothing to follow)."""

    def observe(self, line: str) -> None:
        """Each line of the trainer's output (nothing to look for)."""

    def exit_code(self, code: int) -> int:
        return code

    def mute_exit(self, code: int) -> bool:
        """Whether exit `code` says nothing of how the trainer's own processes ended."""
        return False


class Torchrun(PlainTrainer):
    """torchrun and its workers (see the module docstring); one instance per attempt."""

    name = "torchrun"

    def __init__(self) -> None:
        self.workers: set[int] = set()
        """Every worker pid seen while torchrun ran."""
        self.failed: dict[int, int] = {}
        """Worker pid -> exit code, from torchrun's failure summary."""

    def environment(self, env: dict[str, str], *, grace_seconds: float) -> None:
        if SHUTDOWN_TIMEOUT_ENV not in env:  # one the user set is theirs
            env[SHUTDOWN_TIMEOUT_ENV] = str(math.ceil(grace_seconds))

    def watch(self, child: ChildProcess) -> None:
        self.workers.update(children_of(child.pid))

    def checkpoint(self, child: ChildProcess) -> bool:
        workers = children_of(child.pid)
        self.workers.update(workers)
        ready = [pid for pid in workers if catches(pid, signal.SIGUSR1)]
        if not ready:
            return False  # in rendezvous, or still starting: never to torchrun itself
        for pid in ready:
            _signal_worker(pid, signal.SIGUSR1)
        log.info(
            "forwarding SIGUSR1 to %d torchrun worker(s) (pids %s): every rank checkpoints "
            "and continues",
            len(ready),
            " ".join(map(str, ready)),
        )
        return True

    def kill(self, child: ChildProcess) -> None:
        for pid in children_of(child.pid):
            _signal_worker(pid, signal.SIGKILL)
        child.signal_group(signal.SIGKILL)

    def observe(self, line: str) -> None:
        if match := _EXIT_LINE.match(line):
            self.failed[int(match.group(2))] = int(match.group(1))

    def exit_code(self, code: int) -> int:
        """torchrun's 1 as its workers' 2, 3 or 75 when every failed worker it listed (and
        the supervisor saw) exited with that one code; else `code`."""
        codes = {c for pid, c in self.failed.items() if pid in self.workers}
        if code != EXIT_FAILURE or len(codes) != 1 or not codes <= _PASSED_ON:
            return code
        (worker_code,) = codes
        log.info(
            "torchrun exited 1 because its workers exited %d (pids %s): taken as exit %d",
            worker_code,
            " ".join(str(p) for p in sorted(self.failed) if p in self.workers),
            worker_code,
        )
        return worker_code

    def mute_exit(self, code: int) -> bool:
        """torchrun's 1 with no failure summary: it got the stop itself (SignalException)."""
        return code == EXIT_FAILURE and not self.failed


def launcher_for(command: Sequence[str]) -> PlainTrainer:
    """A fresh launcher for one attempt of `command`."""
    return Torchrun() if is_torchrun(command) else PlainTrainer()


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether `pid` has a handler installed for `sig` (Linux: SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _signal_worker(pid: int, sig: signal.Signals) -> None:
    """`sig` to the worker's own group when it leads one (torchrun's workers do), else to it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
