"""What to do about an OSError that stopped a checkpoint or a sidecar write.

The advice follows the errno: a process out of file descriptors (EMFILE) told to "free space"
would have its operator clean a disk that was never full while every checkpoint keeps failing.
"""

from __future__ import annotations

import errno
import os

from runner.system.fds import nofile_limit, open_fds

__all__ = ["oserror_advice"]


def oserror_advice(
    exc: OSError, *, place: str = "there", alternative: str | None = "use another --run-dir"
) -> str:
    """One sentence (no final period) naming the cause behind `exc` and what to do.

    `place` names where the write went ("there", "on that disk"); `alternative` is offered
    where moving elsewhere helps (None: no such offer)."""
    code = exc.errno
    or_else = f" or {alternative}" if alternative else ""
    if code == errno.EMFILE:
        return (
            "The process ran out of file descriptors (the disk is not the problem): "
            f"{_fd_usage()}. Raise the limit (ulimit -n, the container's nofile ulimit, "
            "LimitNOFILE= in systemd) or find what holds them open (ls -l /proc/PID/fd)"
        )
    if code == errno.ENFILE:
        return (
            "The whole system ran out of open files (the disk is not the problem): "
            "raise fs.file-max (sysctl) or stop what holds that many files open"
        )
    if code == errno.ENOSPC:
        return f"The disk is full: free space {place}{or_else}"
    if code == errno.EDQUOT:
        return f"The disk quota is used up: free space {place}, raise the quota{or_else}"
    if code == errno.EROFS:
        return (
            "The filesystem is read-only (mounted read-only, or remounted so after disk "
            f"errors: see dmesg){'; ' + alternative if alternative else ''}"
        )
    if code in (errno.EACCES, errno.EPERM):
        return (
            f"Permission denied: user id {_uid()} may not write {place}; fix the ownership "
            f"or mode{or_else}"
        )
    if code == errno.EIO:
        return f"An I/O error: the disk may be failing (see dmesg){or_else}"
    return f"Check that the disk {place} is writable and has free space{or_else}"


def _fd_usage() -> str:
    soft, used = nofile_limit(), open_fds()
    opened = "" if used is None else f"{used} open of "
    return f"{opened}a limit (RLIMIT_NOFILE) of {'unlimited' if soft is None else soft}"


def _uid() -> str:
    getuid = getattr(os, "getuid", None)
    return str(getuid()) if getuid is not None else "of this process"
