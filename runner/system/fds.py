"""This process's file descriptors: its soft limit and how many are open. Read by the metrics
server (its own budget, well below the limit) and by the advice a failed write gives."""

from __future__ import annotations

import os


def nofile_limit() -> int | None:
    """The soft RLIMIT_NOFILE; None when unlimited or not a POSIX system."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def open_fds() -> int | None:
    """Descriptors open now; None without /proc (macOS)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
