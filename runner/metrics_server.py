"""How the metrics are served: `/metrics` for Prometheus and `/healthz` for probes.

A small threaded HTTP server on a daemon thread, so a hung scrape can never hold the
training process open at exit.

`/healthz` answers 200 whenever the process serves, with the step and checkpoint ages as
JSON. It deliberately does not fail on stale checkpoints: a liveness probe that fails would
have the kubelet kill the very run that the stale alert asks a human to look at.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client.exposition import choose_encoder

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.metrics import RunnerMetrics

__all__ = ["MetricsServer", "maybe_serve_metrics", "serve_metrics"]


class MetricsServer:
    """A running server; `port` is the bound port, `close()` stops it (idempotent)."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self._closed = False
        self.host: str = str(httpd.server_address[0])
        self.port: int = int(httpd.server_address[1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
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


def serve_metrics(metrics: RunnerMetrics, *, host: str, port: int | None) -> MetricsServer:
    """Serve `metrics` on `host:port` from a daemon thread.

    `port=None` binds any free port (read it back from `.port`; meant for tests). Port 0 is
    refused because in the run configuration it means "metrics disabled": callers holding a
    config use `maybe_serve_metrics`.
    """
    if port == 0:
        raise ConfigError(
            "metrics port 0 means 'metrics disabled'; use maybe_serve_metrics() for config "
            "values, or port=None for any free port"
        )
    if port is not None and not 0 < port <= 65535:
        raise ConfigError(f"--metrics-port must be 1..65535 (got {port})")
    server_class = _IPv6Server if ":" in host else _Server
    try:
        httpd = server_class((host, port or 0), _Handler)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; "
            "choose another --metrics-port, or 0 to disable metrics"
        ) from exc
    httpd.metrics = metrics
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    metrics: RunnerMetrics


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

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

    def log_message(self, format: str, *args: object) -> None:
        # Scrapes every few seconds would flood the training log; errors still surface.
        pass
