"""One run of the supervised trainer: its own process group, its output passed through and
the last lines kept for the error report, and every process it left behind swept away."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO

from runner.errors import ConfigError
from runner.supervisor.reap import SWEEP_GRACE_SECONDS, Descendants

DEFAULT_TAIL_LINES = 30
DRAIN_SECONDS = 2.0
"""How long the trainer's output may keep flowing after it exited, before what holds its
pipes open is swept."""
_LAST_DRAIN_SECONDS = 0.2  # after the sweep's SIGKILL, past a deadline


class OutputTail:
    """Thread-safe ring of the last complete (or final partial) output lines; `observer`
    sees every line (torchrun's failure summary may be longer than the ring)."""

    def __init__(self, lines: int, observer: Callable[[str], None] | None = None) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()
        self._observer = observer

    def add(self, line: str) -> None:
        if self._observer is not None:
            self._observer(line)
        with self._lock:
            self._lines.append(line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)


class AttemptOutput:
    """The last output lines of one trainer attempt and how it ended, for the report shown
    when the supervisor gives up or refuses to restart."""

    def __init__(
        self, attempt: int, lines: int, observer: Callable[[str], None] | None = None
    ) -> None:
        self.attempt = attempt
        self.tail = OutputTail(lines, observer)
        self.pid: int | None = None
        self.ended: str | None = None

    def render(self) -> list[str]:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        ended = f": {self.ended}" if self.ended else ""
        body = [f"    {line}" for line in self.tail.lines()] or ["    (no output)"]
        return [f"  --- attempt {self.attempt}{pid}{ended} ---", *body]


class ChildProcess:
    """The trainer, started in a new session (its own process group, no controlling tty).

    Signals go to the whole group, so a trainer started through a shell script or a launcher
    that spawns workers receives them too.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: BinaryIO,
        stderr: BinaryIO,
        tail: OutputTail,
        pass_fds: Sequence[int] = (),
    ) -> None:
        """`pass_fds`: descriptors the trainer inherits (the run dir's lock, so that the lock
        outlives a supervisor killed while its trainer still runs)."""
        # taken before the start: what is our child now is not this trainer's
        self.descendants = Descendants()
        self.swept: list[int] = []
        """Every pid `sweep` has signalled, over this attempt."""
        try:
            self._proc = subprocess.Popen(
                list(command),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=tuple(pass_fds),
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise ConfigError(f"cannot start the trainer {command[0]!r}: {exc}") from exc
        self.pid = self._proc.pid
        self.descendants.set_group(self.pid)  # its own session: group id = its pid
        self.started_at = time.monotonic()
        assert self._proc.stdout is not None and self._proc.stderr is not None  # PIPE above
        # One thread reads both pipes: the tail gets stdout and stderr lines in the order
        # they were read (two threads would append in whatever order they were scheduled).
        self._pump = threading.Thread(
            target=_pump,
            args=((self._proc.stdout, stdout), (self._proc.stderr, stderr)),
            kwargs={"tail": tail},
            daemon=True,
            name="trainer-output",
        )
        self._pump.start()

    def poll(self) -> int | None:
        return self._proc.poll()

    def signal_group(self, sig: int) -> bool:
        """Send `sig` to the trainer's process group; False if it is already gone."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def terminate(self, *, grace_seconds: float) -> int:
        """SIGTERM the group, SIGKILL it if still running after `grace_seconds`."""
        self.signal_group(signal.SIGTERM)
        try:
            self._proc.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
        return self.finish()

    def reap_orphans(self) -> None:
        """Collect the exited processes of this attempt that were re-parented to us, while
        the trainer runs (never the trainer: subprocess owns its exit status)."""
        self.descendants.reap(keep=self.pid if self._proc.returncode is None else None)

    def finish(self, *, drain_seconds: float = DRAIN_SECONDS, deadline: float | None = None) -> int:
        """Wait for the trainer to exit, then for its output to drain. Processes it left
        running that keep the pipes open are swept after `drain_seconds` (see `sweep`).

        `deadline` (monotonic, a stop's): the drain never waits past it, and once it has
        passed those processes get SIGKILL at once: a supervisor that outlives its grace
        period is SIGKILLed itself (exit 137) and reports nothing."""
        code = self._proc.wait()
        self._pump.join(_until(deadline, drain_seconds))
        if self._pump.is_alive():
            grace = _until(deadline, SWEEP_GRACE_SECONDS)
            self.sweep(grace_seconds=grace)
            # after SIGKILL the pipes close at once; past the deadline, wait only briefly
            self._pump.join(max(_until(deadline, drain_seconds), _LAST_DRAIN_SECONDS))
        return code

    def sweep(self, *, grace_seconds: float | None = None) -> list[int]:
        """SIGTERM, then SIGKILL, every process this trainer left behind (its group, its
        detached helpers: runner/supervisor/reap.py); the pids signalled."""
        grace = grace_seconds if grace_seconds is not None else SWEEP_GRACE_SECONDS
        keep = self.pid if self._proc.returncode is None else None
        swept = self.descendants.sweep(grace_seconds=grace, keep=keep)
        self.swept.extend(pid for pid in swept if pid not in self.swept)
        return swept


def _until(deadline: float | None, seconds: float) -> float:
    """`seconds`, or less when `deadline` (monotonic) comes first; 0 once it has passed."""
    if deadline is None:
        return seconds
    return max(0.0, min(seconds, deadline - time.monotonic()))


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(*streams: tuple[BinaryIO, BinaryIO], tail: OutputTail) -> None:
    """Copy the child's output through as it comes (progress bars included) and remember
    the last lines, each stream's lines in the order they were read."""
    selector = selectors.DefaultSelector()
    pending: dict[int, bytes] = {}
    for src, dst in streams:
        selector.register(src.fileno(), selectors.EVENT_READ, (src, dst))
        pending[src.fileno()] = b""
    while selector.get_map():
        for key, _ in selector.select():
            src, dst = key.data
            fd = key.fd
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                selector.unregister(fd)
                if pending[fd]:
                    tail.add(pending[fd].decode("utf-8", "replace"))
                src.close()
                continue
            with contextlib.suppress(OSError, ValueError):
                dst.write(chunk)
                dst.flush()
            data = pending[fd] + chunk
            *complete, rest = data.split(b"\n")
            for line in complete:
                tail.add(line.decode("utf-8", "replace").rstrip("\r"))
            if len(rest) > 65536:  # a line without end: keep its tail only
                rest = rest[-4096:]
            pending[fd] = rest
    selector.close()
