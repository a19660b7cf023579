"""One writer per run dir: an exclusive `flock` on `RUN_DIR/.runner.lock`.

`runner demo`, `runner run` and `TrainSession` take it before they write anything to the run
dir and hold it for their life. The kernel drops it when the holder's last descriptor closes,
so a holder killed with SIGKILL never blocks the next start and there is nothing stale to clean
up. A second process on the same run dir fails at once with `RunDirLockedError` (exit 2),
which names the holder from what it wrote into the lock file after locking: pid, host, command
and start time.

The lock file sits at the top of the run dir, outside `checkpoints/`, and starts with a dot:
no command that lists, verifies, prunes, forks, pushes or sweeps checkpoints looks at it. It
is never deleted: deleting it while held would let a second process lock a new file of the
same name.

A supervised trainer that is itself a runner (`runner run -- runner demo`) must not wait on
its own supervisor's lock. The supervisor puts the random token it wrote into the lock file in
the child's environment (`RUNNER_RUN_LOCK_TOKEN`, built in `Supervisor._child_env`). A child
whose lock attempt fails skips the lock when the lock file carries that same token and its
writer (same host) is alive: the holder is then the supervisor that started it, holding the
lock for the whole job. The token reaches the child through any launcher in between (a shell,
torchrun), where an inherited descriptor would not. A holder that died leaves its token in the
file, but then the lock is free and the child simply takes it; the liveness check covers the
instant between a new holder's flock and its write.

Scope: processes on one host, and hosts sharing a filesystem whose locks work across clients
(NFSv4 with lock support). Some FUSE / object-store mounts accept flock without locking
anything; two run dirs on two nodes are not protected at all (the mirror's create-only
manifest is the cross-node guard). See docs/preemption.md, 'One writer per run dir'.

Long (about 310 lines): the flock, the holder record written into the locked file and the
message that names a holder are one protocol on one file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from runner.errors import ConfigError, RunDirLockedError
from runner.system.pids import pid_alive

log = logging.getLogger(__name__)

LOCK_FILE = ".runner.lock"
# Part of the supervisor -> child protocol (like RUNNER_RUN_DIR), not a user setting.
ENV_LOCK_TOKEN = "RUNNER_RUN_LOCK_TOKEN"
# A process that has just locked writes its details right after; a reader waits this long
# for them before reporting an unknown holder.
_HOLDER_WAIT_S = 0.3
# flock errors that mean "this filesystem does not do locks", not "someone holds it".
_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


@dataclass(frozen=True, slots=True)
class Holder:
    """What the lock's holder wrote into the lock file."""

    pid: int | None
    host: str | None
    started_at: str | None
    command: str | None
    token: str | None

    def describe(self) -> str:
        if self.pid is None:
            return "a process that has not recorded itself in the lock file"
        parts = f"pid {self.pid} on host {self.host or '?'}"
        extra = ", ".join(
            x for x in (self.command, f"started {self.started_at}" if self.started_at else "") if x
        )
        return f"{parts} ({extra})" if extra else parts


@dataclass(slots=True)
class _Entry:
    fd: int | None  # None: not locked by this process (inherited from a supervisor, or no locks)
    token: str
    how: str  # "locked" | "inherited" | "unsupported"
    count: int = 0


# Locks held by this process, by the lock file's (st_dev, st_ino). A second acquire in the
# same process (the CLI takes the lock before importing torch, then TrainSession again) shares
# the first: flock conflicts between two descriptors of one process as well.
_held: dict[tuple[int, int], _Entry] = {}
_held_mutex = threading.Lock()


class RunDirLock:
    """A held run-dir lock; `release()` (or leaving the `with`) gives it back."""

    def __init__(self, path: Path, key: tuple[int, int], entry: _Entry) -> None:
        self.path = path
        self._key = key
        self._entry: _Entry | None = entry

    @property
    def token(self) -> str:
        assert self._entry is not None, "released"
        return self._entry.token

    @property
    def how(self) -> str:
        """`locked` (this process holds the flock), `inherited` (the supervisor that started
        this process holds it) or `unsupported` (the filesystem refused locks)."""
        assert self._entry is not None, "released"
        return self._entry.how

    @property
    def fd(self) -> int | None:
        """The locked descriptor (None when not locked through one). A child that inherits
        it keeps the lock held while it lives, even after this process is gone."""
        assert self._entry is not None, "released"
        return self._entry.fd

    def child_env(self) -> dict[str, str]:
        """Environment that lets a runner child work in this run dir under this lock."""
        return {ENV_LOCK_TOKEN: self.token}

    def release(self) -> None:
        with _held_mutex:
            entry, self._entry = self._entry, None
            if entry is None:
                return
            entry.count -= 1
            if entry.count > 0:
                return
            _held.pop(self._key, None)
            if entry.fd is not None:
                os.close(entry.fd)  # the kernel drops the flock with the last descriptor

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def acquire(run_dir: Path, *, command: str, supervisor_token: str | None = None) -> RunDirLock:
    """Lock `run_dir` (created if missing) for this process, or raise RunDirLockedError.

    `supervisor_token` defaults to `RUNNER_RUN_LOCK_TOKEN` from the environment: set by a
    `runner run` supervisor for its trainer (module docstring)."""
    if supervisor_token is None:
        supervisor_token = os.environ.get(ENV_LOCK_TOKEN) or None
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--run-dir {run_dir}: exists and is not a directory") from None
    path = run_dir / LOCK_FILE
    with _held_mutex:
        while True:
            fd = _open(path)
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                entry = _held.get(key)
                if entry is not None:  # this process holds it already
                    os.close(fd)
                    entry.count += 1
                    return RunDirLock(path, key, entry)
                entry = _lock(fd, path, key, command=command, supervisor_token=supervisor_token)
            except BaseException:
                os.close(fd)
                raise
            if entry is None or entry.fd != fd:
                os.close(fd)  # not locked through it (or not at all)
            if entry is not None:
                entry.count = 1
                _held[key] = entry
                return RunDirLock(path, key, entry)
            # the lock file was replaced between open and flock: lock the new one


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"cannot open the run dir lock {path}: {exc.strerror or exc}. Make the run dir "
            "writable, or use another --run-dir"
        ) from exc


def _lock(
    fd: int, path: Path, key: tuple[int, int], *, command: str, supervisor_token: str | None
) -> _Entry | None:
    """The entry for a lock taken (or legitimately skipped) on `fd`; None when the file was
    replaced meanwhile. Never closes `fd`: the caller does, unless the entry keeps it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder_waiting(fd)
        if supervisor_token is not None and _is_our_supervisor(holder, supervisor_token):
            log.debug("run dir lock %s is held for us by supervisor pid %s", path, holder.pid)
            return _Entry(fd=None, token=supervisor_token, how="inherited")
        raise RunDirLockedError(_locked_message(path, holder)) from None
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise ConfigError(
                f"cannot lock the run dir {path.parent}: {exc.strerror or exc}. Use a run dir "
                "on a local disk"
            ) from exc
        log.warning(
            "the filesystem of %s does not support file locks (%s): nothing stops a second "
            "process from writing to this run dir at the same time; make sure only one does",
            path.parent,
            exc.strerror or exc,
        )
        return _Entry(fd=None, token=secrets.token_hex(16), how="unsupported")
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != key:
        return None
    token = secrets.token_hex(16)
    _write_holder(fd, path, command=command, token=token)
    return _Entry(fd=fd, token=token, how="locked")


def _write_holder(fd: int, path: Path, *, command: str, token: str) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "token": token,
    }
    data = (json.dumps(record) + "\n").encode()
    try:
        # Overwrite, then cut: on a full disk the old record's block is reused, never freed
        # first and then needed again.
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError as exc:  # the lock is held all the same; only the message loses detail
        log.warning("run dir lock %s: could not record the holder: %s", path, exc)


def _read_holder(fd: int) -> Holder:
    try:
        raw = os.pread(fd, 4096, 0)
        record: Any = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        record = None
    if not isinstance(record, dict):
        return Holder(None, None, None, None, None)

    def text(name: str) -> str | None:
        value = record.get(name)
        return value if isinstance(value, str) else None

    pid = record.get("pid")
    return Holder(
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        host=text("host"),
        started_at=text("started_at"),
        command=text("command"),
        token=text("token"),
    )


def _read_holder_waiting(fd: int) -> Holder:
    """The holder's record; a holder that locked an instant ago may not have written it yet."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        holder = _read_holder(fd)
        if holder.pid is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _is_our_supervisor(holder: Holder, token: str) -> bool:
    if holder.token is None or not secrets.compare_digest(holder.token, token):
        return False
    return holder.host == socket.gethostname() and holder.pid is not None and pid_alive(holder.pid)


def _locked_message(path: Path, holder: Holder) -> str:
    run_dir = path.parent
    here = socket.gethostname()
    hint = ""
    if holder.pid is not None and holder.host == here and not pid_alive(holder.pid):
        hint = (
            f" pid {holder.pid} is no longer running, so a process it started still holds "
            f"the lock (`fuser -v {path}` names it)."
        )
    elif holder.host is not None and holder.host != here:
        hint = f" It runs on another machine that shares this filesystem ({holder.host})."
    stop = f"`kill -TERM {holder.pid}`" if holder.pid is not None else "it"
    return (
        f"run dir {run_dir} is in use by {holder.describe()}.{hint} Two processes writing one "
        "run dir would replace each other's checkpoints and interleave loss.jsonl, so this one "
        f"does not start. Wait for that run to end, stop it ({stop}: it commits a final "
        "checkpoint, then this command resumes from it), or use another --run-dir"
    )
