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
  group instead, once every worker has a handler for it (SigCgt in /proc/PID/status): a
  worker still starting would die of it, and one sent it before the others would act alone.
  The runner's ranks agree on a SIGUSR1 seen by any of them.
- Workers that exit non-zero on their own (every rank exits 75 after a stop one of them saw)
  make torchrun print a ChildFailedError summary, one `exitcode : N (pid: P)` line per failed
  worker, and exit 1. When every failed worker the supervisor saw exited with the same 2, 3 or
  75, that is the attempt's exit code (`Torchrun.exit_code`). After torchrun itself got the
  stop it prints no summary and exits 1 whatever its workers did (`Torchrun.mute_exit`): the
  committed checkpoints and the loss log decide (ending.judge_stop), so ranks stopped while
  still resuming, with nothing trained, end the run with 75 as a lone `runner demo` would.
- One node of several (`--nnodes` > 1, `torchrun_nnodes`; runner/supervisor/multinode.py):
  a stop goes to each worker that handles it, as SIGUSR1 does, so that torchrun lists their
  exit codes and `exit_code` tells 75; to torchrun only while no worker handles it yet.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
from collections.abc import Iterator, Sequence
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
    return _torchrun_args(command) is not None


def _torchrun_args(command: Sequence[str]) -> list[str] | None:
    """What follows torchrun in `command` (its options, then the script's), or None."""
    if not command:
        return None
    if Path(command[0]).name == "torchrun":
        return list(command[1:])
    # `python -m torch.distributed.run`, interpreter options before -m allowed
    args = list(command[1:])
    for i in range(len(args) - 1):
        if args[i] == "-m" and args[i + 1] in _TORCHRUN_MODULES:
            return args[i + 2 :]
    return None


# torchrun's options that take no value (torch 2.x, torch/distributed/run.py); every other
# option of torchrun's takes one.
_TORCHRUN_FLAGS = frozenset(
    {"-h", "--help", "--standalone", "-m", "--module", "--no-python", "--no_python"}
    | {"--run-path", "--run_path", "--virtual-local-rank", "--virtual_local_rank"}
)
# torchrun's long options, for the unique prefixes its argparse accepts (`--nnode 2`)
_TORCHRUN_LONG = (
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend",
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
    "--rdzv_conf", "--max-restarts", "--max_restarts", "--monitor-interval",
    "--monitor_interval", "--start-method", "--start_method", "--event-log-handler",
    "--event_log_handler", "--role", "--log-dir", "--log_dir", "--redirects", "--tee",
    "--local-ranks-filter", "--local_ranks_filter", "--duplicate-stdout-filters",
    "--duplicate_stdout_filters", "--duplicate-stderr-filters", "--duplicate_stderr_filters",
    "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
    "--master_port", "--local-addr", "--local_addr", "--logs-specs", "--logs_specs",
    "--numa-binding", "--numa_binding", "--signals-to-handle", "--signals_to_handle",
    "--shutdown-timeout", "--shutdown_timeout", *sorted(_TORCHRUN_FLAGS - {"-h", "-m"}),
)  # fmt: skip


def torchrun_nnodes(command: Sequence[str]) -> int | None:
    """The number of nodes a torchrun `command` asks for: `--nnodes N`, `--nnodes=N`, the MAX
    of `MIN:MAX`, 1 with `--standalone`; None when `command` is no torchrun, gives neither
    or an `--nnodes` torchrun itself refuses (it then exits with its usage error). Read from
    the command alone: torchrun's PET_NNODES in the environment is not looked at."""
    args = _torchrun_args(command)
    if args is None:
        return None
    nnodes: str | None = None
    standalone = False
    for name, value in _torchrun_options(args):
        if name == "--nnodes":
            nnodes = value
        standalone = standalone or name == "--standalone"
    if standalone:
        return 1
    if nnodes is None:
        return None
    try:
        return max(int(n) for n in nnodes.split(":", 1))
    except ValueError:
        return None


def _torchrun_options(args: Sequence[str]) -> Iterator[tuple[str, str]]:
    """torchrun's own options in `args` (what follows torchrun) as (full name, value), read
    as its argparse does: the value is after `=` or, for an option that takes one, the next
    argument ("" when there is none). Stops at the training script, whose arguments are its
    own."""
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--" or not token.startswith("-"):
            return  # the training script: what follows is its own
        name, eq, value = token.partition("=")
        name = _long_option(name)
        takes_value = name not in _TORCHRUN_FLAGS and not eq
        if takes_value and not name.startswith("--") and len(name) > 2:
            takes_value = False  # `-r3`: a short option with its value attached
        if takes_value:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        yield name, value
        i += 1


def _long_option(name: str) -> str:
    """`name` as torchrun's argparse reads it: a unique prefix of a long option is it."""
    if not name.startswith("--") or name in _TORCHRUN_LONG:
        return name
    matches = {option for option in _TORCHRUN_LONG if option.startswith(name)}
    return matches.pop() if len(matches) == 1 else name


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

    def stop(self, child: ChildProcess, sig: signal.Signals) -> str:
        """Deliver the stop signal `sig`; to whom, for the log line."""
        child.signal_group(sig)
        return "the trainer"

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

    def __init__(self, *, stop_workers: bool = False) -> None:
        self.stop_workers = stop_workers
        """A stop goes to the workers, not to torchrun (one node of several)."""
        self.workers: set[int] = set()
        """Every worker pid seen while torchrun ran."""
        self.failed: dict[int, int] = {}
        """Worker pid -> exit code, from torchrun's failure summary."""

    def environment(self, env: dict[str, str], *, grace_seconds: float) -> None:
        if SHUTDOWN_TIMEOUT_ENV not in env:  # one the user set is theirs
            env[SHUTDOWN_TIMEOUT_ENV] = str(math.ceil(grace_seconds))

    def watch(self, child: ChildProcess) -> None:
        self.workers.update(children_of(child.pid))

    def _catching(self, child: ChildProcess, sig: signal.Signals) -> tuple[list[int], list[int]]:
        """This attempt's workers now (remembered for `exit_code`) and those with a handler
        for `sig`."""
        workers = children_of(child.pid)
        self.workers.update(workers)
        return workers, [pid for pid in workers if catches(pid, sig)]

    def checkpoint(self, child: ChildProcess) -> bool:
        workers, ready = self._catching(child, signal.SIGUSR1)
        if not ready or len(ready) < len(workers):
            # in rendezvous, or some still starting: never to torchrun itself, and to all
            # at once (one that got it early would checkpoint alone: a trainer of its own
            # that does not agree with its peers is never asked again)
            return False
        for pid in ready:
            _signal_worker(pid, signal.SIGUSR1)
        log.info(
            "forwarding SIGUSR1 to %d torchrun worker(s) (pids %s): every rank checkpoints "
            "and continues",
            len(ready),
            " ".join(map(str, ready)),
        )
        return True

    def stop(self, child: ChildProcess, sig: signal.Signals) -> str:
        """To torchrun; with `stop_workers`, to each worker that catches `sig` instead (torchrun
        then lists their exit codes), to torchrun while none does yet (still starting)."""
        if not self.stop_workers:
            return super().stop(child, sig)
        _, ready = self._catching(child, sig)
        if not ready:
            child.signal_group(sig)
            return f"torchrun (no worker handles {sig.name} yet)"
        for pid in ready:
            _signal_worker(pid, sig)
        return f"{len(ready)} torchrun worker(s) (pids {' '.join(map(str, ready))})"

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


def launcher_for(command: Sequence[str], *, stop_workers: bool = False) -> PlainTrainer:
    """A fresh launcher for one attempt of `command`; `stop_workers`: torchrun's stops go to
    its workers (one node of several, runner/supervisor/multinode.py)."""
    return Torchrun(stop_workers=stop_workers) if is_torchrun(command) else PlainTrainer()


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
