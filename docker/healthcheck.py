"""Container HEALTHCHECK: GET /healthz on the runner's metrics port.

Standard library only (runtime images rarely ship curl). A port of 0 means the metrics
server is disabled, so there is nothing to probe and the container counts as healthy."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("RUNNER_METRICS_PORT", "0").strip() or "0"
    if port == "0":
        return 0
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
