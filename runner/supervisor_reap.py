"""Every process a supervised trainer started is gone before `runner run` goes on.

A trainer may leave processes behind that its process group does not reach: a helper started
with `setsid`, a daemon that double-forked, a worker that ignores SIGTERM. Two Linux facts
find them all, whatever they did with groups and sessions:

- `become_subreaper` (prctl PR_SET_CHILD_SUBREAPER): an orphaned descendant is re-parented to
  this process instead of init, so it stays in our tree of parent links.
- `Descendants.sweep` walks that tree (the ppid field of /proc/PID/stat), sends SIGTERM, then
  SIGKILL to what is left after a short grace, and reaps the ones that are our children.

Never by name and never a process that was already our child before the trainer started (a
test harness embedding the supervisor has its own). Not a cgroup: creating one needs a
delegated cgroup v2 subtree (root, or systemd delegation), which an unprivileged container or
a Kubernetes pod does not have; the subreaper works without privileges.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
SWEEP_GRACE_SECONDS = 2.0
"""How long a leftover process gets between SIGTERM and SIGKILL."""
_KILL_WAIT_SECONDS = 5.0  # SIGKILL is not instant for a process in uninterruptible sleep


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux >= 3.4). False, with a
    warning, where that is not possible: then a descendant that left the trainer's process
    group and outlived its parent escapes the sweep."""
    if not sys.platform.startswith("linux"):
        log.warning("not Linux: processes a trainer detaches are not cleaned up")
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        result = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.warning("cannot become a child subreaper (%s): detached processes may remain", exc)
        return False
    if result != 0:
        err = ctypes.get_errno()
        log.warning(
            "cannot become a child subreaper (%s): detached processes may remain",
            os.strerror(err),
        )
        return False
    return True


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, process group) of `pid`, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the
    # last ')'
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[1]), fields[0].decode(), int(fields[2])
    except (IndexError, ValueError):
        return None


def _process_table() -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """parent -> children, and process group -> members, of every visible process."""
    parents: dict[int, list[int]] = {}
    groups: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parents, groups
    for entry in entries:
        if not entry.isdigit():
            continue
        info = _stat(int(entry))
        if info is not None:
            parents.setdefault(info[0], []).append(int(entry))
            groups.setdefault(info[2], []).append(int(entry))
    return parents, groups


def _alive(pid: int) -> bool:
    info = _stat(pid)
    return info is not None and info[1] not in ("Z", "X")


class Descendants:
    """The processes that belong to one trainer attempt: every descendant of this process
    except those already our children when the attempt began (and what runs below them),
    plus every member of the trainer's process group (`group`, once known) and what runs
    below them: an orphan of that group is re-parented to init when this process is not a
    subreaper (the supervisor embedded in another program), yet keeps its group."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.foreign = frozenset(_process_table()[0].get(self.me, []))
        self.group: int | None = None

    def pids(self) -> list[int]:
        """Processes of this attempt, zombies included, parents before their children."""
        children, groups = _process_table()
        found: list[int] = []
        todo = [pid for pid in children.get(self.me, []) if pid not in self.foreign]
        if self.group is not None:
            todo += [pid for pid in groups.get(self.group, []) if pid not in self.foreign]
        while todo:
            pid = todo.pop(0)
            if pid in found:
                continue
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    def sweep(
        self, *, grace_seconds: float = SWEEP_GRACE_SECONDS, keep: int | None = None
    ) -> list[int]:
        """SIGTERM every live descendant, SIGKILL those alive after `grace_seconds`, reap the
        ones that are our children. `keep`: a pid this process must not reap (the trainer,
        while subprocess still owns its exit status). Returns the pids that were signalled."""
        live = self._live(keep)
        signalled = list(live)
        if live:
            self._signal(live, signal.SIGTERM)
            self._wait_gone(live, grace_seconds, keep=keep)
        for _ in range(5):  # more than one round: a process may fork while being killed
            live = self._live(keep)
            if not live:
                break
            signalled.extend(pid for pid in live if pid not in signalled)
            self._signal(live, signal.SIGKILL)
            self._wait_gone(live, _KILL_WAIT_SECONDS, keep=keep)
        self.reap(keep=keep)
        still = self._live(keep)
        if still:
            log.error("processes %s survived SIGKILL (uninterruptible I/O?)", still)
        return signalled

    def _live(self, keep: int | None) -> list[int]:
        return [pid for pid in self.pids() if pid != keep and _alive(pid)]

    @staticmethod
    def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def reap(self, *, keep: int | None = None) -> None:
        """Collect the exit status of every dead process of this attempt that is our child
        (orphans re-parented to us included), so that none stays a zombie."""
        for pid in self.pids():
            if pid == keep:
                continue
            info = _stat(pid)
            if info is None or info[0] != self.me or info[1] not in ("Z", "X"):
                continue
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def _wait_gone(self, pids: Iterable[int], seconds: float, *, keep: int | None) -> None:
        end = time.monotonic() + seconds
        pending = list(pids)
        while pending and time.monotonic() < end:
            self.reap(keep=keep)
            pending = [pid for pid in pending if _alive(pid)]
            if pending:
                time.sleep(0.02)
