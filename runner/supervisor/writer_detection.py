"""Is a file the trainer wrote finished? Two Linux facts the adopter asks before it judges one.

- How it appeared (`DirWatch`, inotify): a file renamed into its final name (IN_MOVED_TO) was
  complete under its temp name before it got that name; one created under it (IN_CREATE) may
  be preallocated or half written for as long as the trainer runs. Size and mtime cannot tell:
  a preallocated file has the right size from the start, and a writer pausing between writes
  leaves both unchanged.
- Who still writes to it (`open_for_writing`, /proc): a process holding a descriptor to the
  same inode open with O_WRONLY or O_RDWR may change it after we hashed it (a rename keeps the
  inode, so a writer's descriptor follows the file into its checkpoint directory).

Both degrade instead of failing: without inotify (another OS, the per-user watch limit) the
watch reports nothing as known, without /proc `open_for_writing` returns None, and the adopter
falls back to weaker rules it documents.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Origin = Literal["renamed", "created"]

# <sys/inotify.h>
_IN_MOVED_FROM = 0x00000040
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE = 0x00000200
_IN_DELETE_SELF = 0x00000400
_IN_MOVE_SELF = 0x00000800
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = 0o2000000  # O_CLOEXEC on Linux
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name
_WATCH_MASK = (
    _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
)


class DirWatch:
    """How each entry of one directory appeared since the watch started: by a rename into
    that name, or created under it. `reliable` is False when events may have been missed
    (no inotify, queue overflow, directory replaced): then `origin` knows less than it seems,
    and the caller must not conclude anything from a name's absence."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._origins: dict[str, Origin] = {}
        self._fd: int | None = None
        self.reliable = False
        self._start()

    def _start(self) -> None:
        libc_name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(libc_name, use_errno=True)
            init1 = libc.inotify_init1
            add_watch = libc.inotify_add_watch
        except (OSError, AttributeError, TypeError):
            log.warning("no inotify here: adopting renamed seed files only by the fallback rule")
            return
        fd = init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            self._warn_unavailable(ctypes.get_errno())
            return
        if add_watch(fd, os.fsencode(self.directory), _WATCH_MASK | _IN_ONLYDIR) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            self._warn_unavailable(err)
            return
        self._fd = fd
        self.reliable = True

    def _warn_unavailable(self, err: int) -> None:
        log.warning(
            "cannot watch %s with inotify (%s; see fs.inotify.max_user_watches/instances): "
            "seed files are adopted while the trainer runs only once no process has them open "
            "for writing and they are unchanged over two scans",
            self.directory,
            os.strerror(err) if err else "unknown error",
        )

    def origin(self, name: str) -> Origin | None:
        """'renamed', 'created', or None when no event for `name` was seen."""
        self._drain()
        return self._origins.get(name)

    def _drain(self) -> None:
        if self._fd is None:
            return
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            offset = 0
            while offset + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
                offset += _EVENT.size + length
                self._event(mask, os.fsdecode(raw.rstrip(b"\0")))

    def _event(self, mask: int, name: str) -> None:
        if mask & _IN_Q_OVERFLOW:
            log.warning("inotify queue overflowed on %s: some events were lost", self.directory)
            self.reliable = False
        elif mask & (_IN_IGNORED | _IN_DELETE_SELF | _IN_MOVE_SELF):
            log.warning("%s was removed or moved: no longer watched", self.directory)
            self.reliable = False
        elif mask & _IN_MOVED_TO:
            self._origins[name] = "renamed"
        elif mask & _IN_CREATE:  # open(O_CREAT), link(), mknod: possibly unfinished
            self._origins[name] = "created"
        elif mask & (_IN_MOVED_FROM | _IN_DELETE):
            self._origins.pop(name, None)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self.reliable = False

    def __del__(self) -> None:
        self.close()


_ACCMODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR


def open_for_writing(paths: list[Path]) -> dict[Path, int] | None:
    """Which of `paths` some process holds open for writing: path -> the pid of one such
    process. Looks at every process this one may inspect (/proc/PID/fd: the trainer's whole
    tree and any helper it started, whatever its process group), matching descriptors by
    (st_dev, st_ino) so a renamed or hard-linked file is still recognised. None when there is
    no /proc to ask (not Linux)."""
    wanted: dict[tuple[int, int], Path] = {}
    for wanted_path in paths:
        with contextlib.suppress(OSError):
            st = wanted_path.stat()
            wanted[(st.st_dev, st.st_ino)] = wanted_path
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    found: dict[Path, int] = {}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # exited meanwhile, or another user's process
            continue
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")  # follows the link: the open file's inode
            except OSError:
                continue
            path = wanted.get((st.st_dev, st.st_ino))
            if path is None or path in found:
                continue
            if _fd_writable(f"/proc/{pid}/fdinfo/{fd}"):
                found[path] = int(pid)
    return found


def _fd_writable(fdinfo: str) -> bool:
    try:
        with open(fdinfo) as f:
            for line in f:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & _ACCMODE in (os.O_WRONLY, os.O_RDWR)
    except (OSError, ValueError, IndexError):
        pass
    return False
