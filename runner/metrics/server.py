"""How the metrics are served: `/metrics` for Prometheus and `/healthz` for probes.

A small threaded HTTP server on a daemon thread, so a hung scrape can never hold the
training process open at exit.

`/healthz` answers 200 whenever the process serves, with the step and checkpoint ages as
JSON. It deliberately does not fail on stale checkpoints: a liveness probe that fails would
have the kubelet kill the very run that the stale alert asks a human to look at.

The port is reachable by whoever can reach the pod, so the server must never cost the
training process what it needs to checkpoint (file descriptors, threads, memory, a clean
log). `ServerLimits` bounds all of them: at most `max_connections` open at once (the oldest
one still waiting for its request is dropped to make room, so a scrape gets through a flood
of idle connections), a deadline for each request head and each response, a cap on the size
of a request head, and no accept at all while the process has fewer than `reserve_fds` file
descriptors left (the connections wait in the kernel's backlog instead). Bad requests and
dropped connections are one-line warnings, at most one per kind a minute.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import choose_encoder

from runner.errors import ConfigError
from runner.system.fds import nofile_limit, open_fds

if TYPE_CHECKING:
    from runner.metrics.registry import RunnerMetrics

__all__ = ["MetricsServer", "ServerLimits", "maybe_serve_metrics", "serve_metrics"]

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


class MetricsServer:
    """A running server; `host`/`port` are what it bound, `close()` stops it (idempotent)."""

    def __init__(self, httpd: _Server, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False
        self.host: str = str(httpd.server_address[0])
        self.port: int = int(httpd.server_address[1])
        self.limits = httpd.limits

    @property
    def bind_address(self) -> str:
        """`host:port` as bound, IPv6 in brackets: what the log names."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def scope(self) -> str:
        """Who can reach the bound address, in words."""
        if self.host == "0.0.0.0":
            return "every IPv4 interface"
        if self.host == "::":
            return "every interface"
        if self.host == "::1" or self.host.startswith("127."):
            return "this machine only"
        return f"the interface with address {self.host} only"

    @property
    def url(self) -> str:
        """A URL that reaches the server from this machine (a wildcard is not one)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(
    metrics: RunnerMetrics,
    *,
    host: str,
    port: int | None,
    limits: ServerLimits | None = None,
) -> MetricsServer:
    """Serve `metrics` on `host:port` from a daemon thread.

    `port=None` binds any free port (read it back from `.port`; meant for tests). Port 0 is
    refused because in the run configuration it means "metrics disabled": callers holding a
    config use `maybe_serve_metrics`. `limits` defaults to `ServerLimits.for_process()`.
    """
    if port == 0:
        raise ConfigError(
            "metrics port 0 means 'metrics disabled'; use maybe_serve_metrics() for config "
            "values, or port=None for any free port"
        )
    if port is not None and not 0 < port <= 65535:
        raise ConfigError(f"--metrics-port must be 1..65535 (got {port})")
    family, address = _resolve(host, port or 0)
    server_class = _IPv6Server if family == socket.AF_INET6 else _Server
    shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
    try:
        httpd = server_class(address, _Handler)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {shown}:{port or 0}: {exc.strerror or exc}; "
            "choose another --metrics-port (or --metrics-host), or --metrics-port 0 to "
            "disable metrics"
        ) from exc
    httpd.metrics = metrics
    httpd.limits = limits if limits is not None else ServerLimits.for_process()
    httpd.warnings = _Warnings(WARN_INTERVAL_S)
    thread = threading.Thread(
        target=httpd.serve_forever,
        kwargs={"poll_interval": 0.2},
        name=f"metrics-server:{httpd.server_address[1]}",
        daemon=True,
    )
    thread.start()
    return MetricsServer(httpd, thread)


def maybe_serve_metrics(metrics: RunnerMetrics, *, host: str, port: int) -> MetricsServer | None:
    """The entry points' call: `port` as configured (`--metrics-port`), 0 = no server."""
    if port == 0:
        return None
    return serve_metrics(metrics, host=host, port=port)


def _resolve(host: str, port: int) -> tuple[int, tuple[Any, ...]]:
    """The address family and socket address `host` means ("[::1]" and "::1" alike)."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name:
        raise ConfigError("--metrics-host is empty: use 0.0.0.0 (every interface) or 127.0.0.1")
    try:
        infos = socket.getaddrinfo(
            name, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"--metrics-host {host!r} is not an address of this machine "
            f"({getattr(exc, 'strerror', None) or exc}); use an IP address such as 0.0.0.0, "
            "127.0.0.1, :: or ::1"
        ) from exc
    usable = [i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)]
    if not usable:
        raise ConfigError(f"--metrics-host {host!r} resolves to no IPv4 or IPv6 address")
    family, _, _, _, address = usable[0]
    return int(family), tuple(address)


class _Warnings:
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Connections the kernel completes while the server is at its limits wait here, costing
    # the process no descriptor.
    request_queue_size = 128
    metrics: RunnerMetrics
    limits: ServerLimits
    warnings: _Warnings

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
                    deadline=now + self.limits.read_timeout_s, peer=_peer(client_address), since=now
                )
        if victim is not None:
            _hang_up(victim[0])
        if victim is not None or not admitted:
            what = "dropped the oldest idle connection" if victim else "refused a connection"
            self.warnings.note(
                "full", f"{what} from {_peer(client_address)}: {limit} connections are open"
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
            _hang_up(sock)
            self.warnings.note("timeout", f"closed a connection from {conn.peer} at its deadline")
        self.warnings.flush()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's default prints a traceback to stderr: the training log.
        if self.dropped(request):
            return  # we hung up on it ourselves; already reported
        exc = sys.exc_info()[1]
        self.warnings.note(
            "error", _clip(f"connection from {_peer(client_address)} failed: {exc!r}")
        )

    def server_close(self) -> None:
        super().server_close()
        with self._conns_lock:
            socks = list(self._conns)
            for conn in self._conns.values():
                conn.dropped = True
        for sock in socks:
            _hang_up(sock)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


def _hang_up(sock: socket.socket) -> None:
    # shutdown() wakes the handler thread blocked in recv(); it then closes the socket.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _peer(address: Any) -> str:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return "an unknown peer"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A refused request may leave unread bytes (the rest of an oversized head): closing on them
# makes the kernel send a reset, which can destroy the reply before the client reads it. So
# the reply is followed by a FIN and a short, bounded drain (what web servers call a lingering
# close).
DRAIN_MAX_BYTES = 256 * 1024
DRAIN_MAX_S = 1.0


def _drain_unread(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + DRAIN_MAX_S
        left = DRAIN_MAX_BYTES
        while left > 0:
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            sock.settimeout(remaining)
            chunk = sock.recv(min(left, 65536))
            if not chunk:
                break
            left -= len(chunk)


class _HeadReader:
    """The handler's rfile, refusing a request head over `limit` bytes: http.server alone
    would hold up to 100 header lines of 64 KiB each per connection."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw = raw
        self._limit = limit
        self.left = limit

    def readline(self, size: int = -1) -> bytes:
        cap = self.left + 1 if size is None or size < 0 else min(size, self.left + 1)
        line: bytes = self._raw.readline(cap)
        self.left -= len(line)
        if self.left < 0:
            raise http.client.LineTooLong(f"request head over {self._limit} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # An unparsable request line still gets a status line (http.server would answer it the
    # HTTP/0.9 way: a bare HTML body).
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        # The server's deadlines bound the whole head/response and close the connection
        # quietly; this per-recv/send timeout is only the backstop should they not.
        limits = self.server.limits
        self.connection.settimeout(max(limits.read_timeout_s, limits.write_timeout_s) + 5)
        self.rfile = _HeadReader(self.rfile, limits.max_head_bytes)  # type: ignore[assignment]

    def handle_one_request(self) -> None:
        self.server.track(self.connection, reading=True)
        reader = self.rfile
        if isinstance(reader, _HeadReader):
            reader.left = self.server.limits.max_head_bytes
        try:
            super().handle_one_request()
        except http.client.LineTooLong:
            # the request line itself ran past the head cap (http.server catches this only
            # for header lines): answered like http.server's own over-long request line
            self.requestline = self.request_version = self.command = ""
            self.close_connection = True
            self.send_error(http.HTTPStatus.REQUEST_URI_TOO_LONG)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        super().send_error(code, message, explain)
        self._refused = True

    def finish(self) -> None:
        super().finish()  # flushes the reply
        if getattr(self, "_refused", False):
            _drain_unread(self.connection)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.server.track(self.connection, reading=False)
        return ok

    def do_GET(self) -> None:
        self._respond(with_body=True)

    def do_HEAD(self) -> None:
        # Some load balancers and probes check with HEAD.
        self._respond(with_body=False)

    def _respond(self, *, with_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            status, body = 200, encoder(self.server.metrics.registry)
        elif path == "/healthz":
            content_type = "application/json"
            status = 200
            body = (json.dumps(self.server.metrics.health(), sort_keys=True) + "\n").encode()
        else:
            content_type = "text/plain; charset=utf-8"
            status, body = 404, b"not found: try /metrics or /healthz\n"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_error(self, format: str, *args: Any) -> None:
        # Malformed requests and timeouts: one rate-limited line, never the raw bytes in full.
        if self.server.dropped(self.connection):
            return
        self.server.warnings.note(
            "bad-request", _clip(f"bad request from {_peer(self.client_address)}: {format % args}")
        )

    def log_message(self, format: str, *args: Any) -> None:
        # Scrapes every few seconds would flood the training log; errors go to log_error.
        pass
