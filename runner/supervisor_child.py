"""One run of the supervised trainer: its own process group, its output passed through and
the last lines kept for the error report."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from runner.errors import ConfigError

DEFAULT_TAIL_LINES = 30


class OutputTail:
    """Thread-safe ring of the last complete (or final partial) output lines."""

    def __init__(self, lines: int) -> None:
        self._lines: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)


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
        self.started_at = time.monotonic()
        assert self._proc.stdout is not None and self._proc.stderr is not None  # PIPE above
        self._pumps = [
            threading.Thread(
                target=_pump, args=(self._proc.stdout, stdout, tail), daemon=True, name="out"
            ),
            threading.Thread(
                target=_pump, args=(self._proc.stderr, stderr, tail), daemon=True, name="err"
            ),
        ]
        for pump in self._pumps:
            pump.start()

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

    def finish(self, *, drain_seconds: float = 2.0) -> int:
        """Wait for the trainer to exit and its output to drain. Members of its group that
        outlive it (and would keep the pipes open) are killed after `drain_seconds`."""
        code = self._proc.wait()
        end = time.monotonic() + drain_seconds
        for pump in self._pumps:
            pump.join(max(0.0, end - time.monotonic()))
        if any(p.is_alive() for p in self._pumps):
            self.signal_group(signal.SIGKILL)
            for pump in self._pumps:
                pump.join(drain_seconds)
        return code


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(src: BinaryIO, dst: BinaryIO, tail: OutputTail) -> None:
    """Copy the child's output through as it comes (progress bars included) and remember
    the last lines."""
    pending = b""
    fd = src.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        with contextlib.suppress(OSError, ValueError):
            dst.write(chunk)
            dst.flush()
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            tail.add(line.decode("utf-8", "replace").rstrip("\r"))
        if len(pending) > 65536:  # a line without end: keep its tail only
            pending = pending[-4096:]
    if pending:
        tail.add(pending.decode("utf-8", "replace"))
    src.close()
