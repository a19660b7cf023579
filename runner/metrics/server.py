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

import socket
import threading
from typing import TYPE_CHECKING, Any

from runner.errors import ConfigError
from runner.metrics.guarded_server import (
    WARN_INTERVAL_S,
    GuardedServer,
    IPv6GuardedServer,
    ServerLimits,
    Warnings,
)
from runner.metrics.handler import Handler

if TYPE_CHECKING:
    from runner.metrics.registry import RunnerMetrics

__all__ = ["MetricsServer", "ServerLimits", "maybe_serve_metrics", "serve_metrics"]


class MetricsServer:
    """A running server; `host`/`port` are what it bound, `close()` stops it (idempotent)."""

    def __init__(self, httpd: GuardedServer, thread: threading.Thread) -> None:
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
    server_class = IPv6GuardedServer if family == socket.AF_INET6 else GuardedServer
    shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
    try:
        httpd = server_class(address, Handler)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {shown}:{port or 0}: {exc.strerror or exc}; "
            "choose another --metrics-port (or --metrics-host), or --metrics-port 0 to "
            "disable metrics"
        ) from exc
    httpd.metrics = metrics
    httpd.limits = limits if limits is not None else ServerLimits.for_process()
    httpd.warnings = Warnings(WARN_INTERVAL_S)
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
