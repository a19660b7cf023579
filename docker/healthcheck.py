"""Container HEALTHCHECK: GET /healthz on the runner's metrics port.

Standard library only (runtime images rarely ship curl). A port of 0 means the metrics
server is disabled, so there is nothing to probe and the container counts as healthy."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def probe_url(env: dict[str, str]) -> str | None:
    """Where the runner serves /healthz, from the variables the runner itself reads; None
    when the metrics server is disabled. A wildcard bind is probed on loopback."""
    port = env.get("RUNNER_METRICS_PORT", "0").strip() or "0"
    if port == "0":
        return None
    host = env.get("RUNNER_METRICS_HOST", "").strip().strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}/healthz" if ":" in host else f"http://{host}:{port}/healthz"


def main() -> int:
    url = probe_url(dict(os.environ))
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
