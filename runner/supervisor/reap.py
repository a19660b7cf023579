"""Every process a supervised trainer started is gone before `runner run` goes on.

A trainer may leave processes behind that its process group does not reach: a helper started
with `setsid`, a daemon that double-forked, a worker that ignores SIGTERM. Two Linux facts
find them all, whatever they did with groups and sessions:

- `become_subreaper` (prctl PR_SET_CHILD_SUBREAPER): an orphaned descendant is re-parented to
  this process instead of init, so it stays in our tree of parent links.
- `Descendants.sweep` walks that tree (the ppid field of /proc/PID/stat), sends SIGTERM, then
  SIGKILL to what is left after a short grace, and reaps the ones that are our children.

Never by name, never a process that was already our child before the trainer started (a
test harness embedding the supervisor has its own), and never a process in the supervisor's
own process group (`os.getpgrp()`): what this process starts during an attempt (a botocore
`credential_process` run for the mirror thread, the host program's own children) stays in our
group, and no process of the trainer's can be there: the trainer starts in a new session, and
a process can join only a group of its own session (setpgid(2)), so neither it nor anything
below it can enter ours. (A host program that starts its own children with a new session or
group during an attempt must take them as the trainer's.) Not a cgroup: creating one needs a
delegated cgroup v2 subtree (root, or systemd delegation), which an unprivileged container or
a Kubernetes pod does not have; the subreaper works without privileges.

While the trainer runs, its exited orphans are reaped as they come (`reap`, called from the
supervisor's loop): a trainer that runs `os.system("cmd &")` again and again would otherwise
pile zombies onto this process until the pod's pid limit. Never the trainer itself there:
subprocess must collect its exit status.
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
from typing import NamedTuple

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


class _Stat(NamedTuple):
    ppid: int
    state: str
    pgrp: int
    start: int  # clock ticks after boot: tells a reused pid from the process that had it


def _stat(pid: int) -> _Stat | None:
    """Parent, state, process group and start time of `pid`, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the
    # last ')'
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return _Stat(int(fields[1]), fields[0].decode(), int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _process_table() -> dict[int, _Stat]:
    """Every visible process (zombies included)."""
    table: dict[int, _Stat] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            table[int(entry)] = info
    return table


def children_of(parent: int) -> list[int]:
    """The live processes whose parent is `parent` (torchrun's workers)."""
    return sorted(
        pid
        for pid, info in _process_table().items()
        if info.ppid == parent and info.state not in ("Z", "X")
    )


def _alive(pid: int) -> bool:
    info = _stat(pid)
    return info is not None and info.state not in ("Z", "X")


class Descendants:
    """The processes that belong to one trainer attempt: every descendant of this process
    except those already our children when the attempt began and those in our own process
    group (and what runs below them), plus every member of the trainer's process group
    (`set_group`) and what runs below them: an orphan of that group is re-parented to init
    when this process is not a subreaper (the supervisor embedded in another program), yet
    keeps its group.

    The group is matched only while it exists: once seen empty (its leader reaped, no member
    left) its id is free for the next process that starts a session, an unrelated one, so it
    is dropped for good; and a process holding the leader's pid with another start time is
    that unrelated leader (the group emptied and was reused between two looks)."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.own_group = os.getpgrp()
        table = _process_table()
        self.foreign = frozenset(pid for pid, info in table.items() if info.ppid == self.me)
        self.group: int | None = None
        self._group_start: int | None = None

    def set_group(self, leader: int) -> None:
        """Match the members of `leader`'s process group too (the trainer, just started in a
        session of its own: group id = its pid)."""
        info = _stat(leader)
        self.group = leader
        self._group_start = info.start if info is not None else None

    def pids(self) -> list[int]:
        """Processes of this attempt, zombies included, parents before their children."""
        table = _process_table()
        children: dict[int, list[int]] = {}
        for pid, info in table.items():
            children.setdefault(info.ppid, []).append(pid)
        todo = list(children.get(self.me, []))
        if self.group is not None:
            members = [pid for pid, info in table.items() if info.pgrp == self.group]
            leader = table.get(self.group)
            if not members or (leader is not None and leader.start != self._group_start):
                self.group = None  # gone: its id may already name someone else's group
            else:
                todo += members
        found: list[int] = []
        seen: set[int] = set()
        while todo:
            pid = todo.pop(0)
            entry = table.get(pid)
            if pid in seen or entry is None:
                continue
            seen.add(pid)
            if pid in self.foreign or entry.pgrp == self.own_group:
                continue  # not the trainer's, and neither is what runs below it
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    def sweep(
        self, *, grace_seconds: float = SWEEP_GRACE_SECONDS, keep: int | None = None
    ) -> list[int]:
        """SIGTERM every live descendant, SIGKILL those alive after `grace_seconds`, reap the
        ones that are our children. `keep`: a pid this process must not reap (the trainer,
        while subprocess still owns its exit status). `grace_seconds` 0: SIGKILL at once (a
        stop deadline has passed). Returns the pids that were signalled."""
        live = self._live(keep)
        signalled = list(live)
        if live and grace_seconds > 0:
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
            if info is None or info.ppid != self.me or info.state not in ("Z", "X"):
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
