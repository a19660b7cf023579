"""Checks of the S3 endpoint botocore resolved from the standard chain."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from runner.errors import ConfigError
from runner.storage.redact import redact_text

ENDPOINT_HINT = "is not a usable S3 endpoint: give http://HOST[:PORT] or https://HOST[:PORT]"


def endpoint_source() -> str:
    """Where a custom endpoint was set, for messages (botocore reads it; this only names it)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return name
    return "the endpoint_url of the AWS config profile"


def endpoint_error(url: str | None = None) -> ConfigError:
    shown = f" {redact_text(url)!r}" if url else ""
    return ConfigError(f"{endpoint_source()}{shown} {ENDPOINT_HINT}")


def check_endpoint(url: str) -> None:
    """A usable http(s)://HOST[:PORT] endpoint (port 1..65535), else ConfigError naming
    where it was set; the message never shows a user:password part."""
    parsed = urlparse(url)
    try:
        port_ok = parsed.port is None or parsed.port > 0
    except ValueError:  # not a number, or out of range
        port_ok = False
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port_ok:
        raise endpoint_error(url)
