"""The metrics server's request handler: `/metrics`, `/healthz`, a capped request head, and a
lingering close after a refused request.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client.exposition import choose_encoder

from runner.metrics.guarded_server import GuardedServer, clip, peer

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


class Handler(BaseHTTPRequestHandler):
    server: GuardedServer
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
            "bad-request", clip(f"bad request from {peer(self.client_address)}: {format % args}")
        )

    def log_message(self, format: str, *args: Any) -> None:
        # Scrapes every few seconds would flood the training log; errors go to log_error.
        pass
