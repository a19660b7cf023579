"""The metrics server's guard: what it may use (`ServerLimits`) and the HTTP server that keeps
to it (connection limit, oldest-idle eviction, head/response deadlines, descriptor reserve) and
reports trouble as rate-limited warnings. Why: runner.metrics.server.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from runner.system.fds import nofile_limit, open_fds

if TYPE_CHECKING:
    from runner.metrics.registry import RunnerMetrics

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 60.0


@dataclass(frozen=True)
class ServerLimits:
    """What the metrics server may use. `for_process()` sizes it from RLIMIT_NOFILE."""

    max_connections: int = 32
    reserve_fds: int = 256
    """Accept only while the process has more than this many descriptors free."""
    read_timeout_s: float = 10.0
    """Whole request line and headers, however slowly they trickle in (slowloris)."""
    write_timeout_s: float = 10.0
    max_head_bytes: int = 16384

    @classmethod
    def for_process(cls) -> ServerLimits:
        soft = nofile_limit()
        if soft is None:
            return cls()
        # A quarter of the limit stays free for training; the server itself takes at most
        # 2 * max_connections + 1 (dropped connections count until their thread closes them).
        return cls(max_connections=max(1, min(32, soft // 32)), reserve_fds=max(64, soft // 4))


class Warnings:
    """One log line per kind of trouble per `interval`; the ones held back are counted and
    reported with the next line (or by `flush` once the interval is over)."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def note(self, kind: str, text: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        more = f" ({held} more like it in the last {self._interval:.0f} s)" if held else ""
        log.warning("metrics server: %s%s; training is not affected", text, more)

    def flush(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [k for k, n in self._held.items() if n and now - self._last[k] >= self._interval]
            counts = {k: self._held.pop(k) for k in due}
            for kind in due:
                self._last[kind] = now
        for kind, held in counts.items():
            log.warning(
                "metrics server: %d more %s in the last %.0f s; training is not affected",
                held,
                _KIND_NAMES.get(kind, kind),
                self._interval,
            )


_KIND_NAMES = {
    "bad-request": "malformed request(s)",
    "error": "connection error(s)",
    "full": "connection(s) refused or dropped at the connection limit",
    "timeout": "connection(s) closed at the read/write deadline",
    "fds": "pause(s) in accepting for lack of file descriptors",
}


@dataclass
class _Conn:
    deadline: float
    peer: str = "an unknown peer"
    reading: bool = True
    since: float = 0.0
    dropped: bool = False


class GuardedServer(ThreadingHTTPServer):
    daemon_threads = True
    # Connections the kernel completes while the server is at its limits wait here, costing
    # the process no descriptor.
    request_queue_size = 128
    metrics: RunnerMetrics
    limits: ServerLimits
    warnings: Warnings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._conns: dict[socket.socket, _Conn] = {}
        self._conns_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look up the host's FQDN: a DNS query that can hang
        # start-up where no resolver answers.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def get_request(self) -> tuple[socket.socket, Any]:
        if not self._fd_headroom():
            time.sleep(0.1)  # the listening socket stays readable: do not spin on it
            raise OSError("no file descriptor headroom")  # serve_forever skips this round
        try:
            return super().get_request()
        except OSError as exc:  # EMFILE/ENFILE despite the check: training took them
            self.warnings.note("fds", f"cannot accept a connection ({exc.strerror or exc})")
            time.sleep(0.1)
            raise

    def _fd_headroom(self) -> bool:
        soft, used = nofile_limit(), open_fds()
        if soft is None or used is None or soft - used > self.limits.reserve_fds:
            return True
        self.warnings.note(
            "fds",
            f"not accepting connections while the process has {soft - used} of {soft} file "
            f"descriptors free (keeping {self.limits.reserve_fds} for training)",
        )
        return False

    def verify_request(self, request: Any, client_address: Any) -> bool:
        now = time.monotonic()
        limit = self.limits.max_connections
        with self._conns_lock:
            live = [c for c in self._conns.items() if not c[1].dropped]
            if len(live) >= limit:
                waiting = [c for c in live if c[1].reading]
                if not waiting or len(self._conns) >= 2 * limit:
                    victim = None
                else:
                    victim = min(waiting, key=lambda c: c[1].since)
                    victim[1].dropped = True
            else:
                victim = None
            # Dropped connections count until their thread has closed them: the descriptors
            # held never exceed 2 * limit (+ the listening socket).
            admitted = len(self._conns) < 2 * limit and (len(live) < limit or victim is not None)
            if admitted:
                self._conns[request] = _Conn(
                    deadline=now + self.limits.read_timeout_s, peer=peer(client_address), since=now
                )
        if victim is not None:
            hang_up(victim[0])
        if victim is not None or not admitted:
            what = "dropped the oldest idle connection" if victim else "refused a connection"
            self.warnings.note(
                "full", f"{what} from {peer(client_address)}: {limit} connections are open"
            )
        return admitted

    def track(self, request: socket.socket, *, reading: bool) -> None:
        """The connection starts waiting for a request head, or starts being answered."""
        now = time.monotonic()
        timeout = self.limits.read_timeout_s if reading else self.limits.write_timeout_s
        with self._conns_lock:
            conn = self._conns.get(request)
            if conn is not None and not conn.dropped:
                conn.reading, conn.since, conn.deadline = reading, now, now + timeout

    def dropped(self, request: Any) -> bool:
        with self._conns_lock:
            conn = self._conns.get(request)
            return conn is not None and conn.dropped

    def close_request(self, request: Any) -> None:
        try:
            super().close_request(request)
        finally:
            with self._conns_lock:
                self._conns.pop(request, None)

    def service_actions(self) -> None:
        # Runs on the serve_forever thread after every accept and every poll interval.
        now = time.monotonic()
        with self._conns_lock:
            late = [(s, c) for s, c in self._conns.items() if not c.dropped and c.deadline <= now]
            for _, conn in late:
                conn.dropped = True
        for sock, conn in late:
            hang_up(sock)
            self.warnings.note("timeout", f"closed a connection from {conn.peer} at its deadline")
        self.warnings.flush()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's default prints a traceback to stderr: the training log.
        if self.dropped(request):
            return  # we hung up on it ourselves; already reported
        exc = sys.exc_info()[1]
        self.warnings.note("error", clip(f"connection from {peer(client_address)} failed: {exc!r}"))

    def server_close(self) -> None:
        super().server_close()
        with self._conns_lock:
            socks = list(self._conns)
            for conn in self._conns.values():
                conn.dropped = True
        for sock in socks:
            hang_up(sock)


class IPv6GuardedServer(GuardedServer):
    address_family = socket.AF_INET6


def hang_up(sock: socket.socket) -> None:
    # shutdown() wakes the handler thread blocked in recv(); it then closes the socket.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def peer(address: Any) -> str:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return "an unknown peer"


def clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
