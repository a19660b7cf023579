"""Checks of endpoint URLs: the S3 endpoint botocore resolved from the standard chain, and
(through `usable_http_url`) the --notice-endpoint of RunConfig."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from runner.errors import ConfigError
from runner.storage.redact import redact_url

ENDPOINT_HINT = "is not a usable S3 endpoint: give http://HOST[:PORT] or https://HOST[:PORT]"


def endpoint_source() -> str:
    """Where a custom endpoint was set, for messages (botocore reads it; this only names it)."""
    # AWS_ENDPOINT_URL* are boto3's own variables, read by botocore where the client is built;
    # this is the one place the runner looks at them, only to name the culprit
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return name
    return "the endpoint_url of the AWS config profile"


def endpoint_error(url: str | None = None) -> ConfigError:
    shown = f" {redact_url(url)!r}" if url else ""
    return ConfigError(f"{endpoint_source()}{shown} {ENDPOINT_HINT}")


def usable_http_url(url: str) -> bool:
    """An http(s)://HOST[:PORT] URL with a port 1..65535 if one is given."""
    try:
        parsed = urlparse(url)
        port_ok = parsed.port is None or parsed.port > 0
    except ValueError:  # a port that is not a number or out of range, a bad IPv6 host
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and port_ok


def check_endpoint(url: str) -> None:
    """A usable S3 endpoint, else ConfigError naming where it was set; the message never
    shows a user:password part."""
    if not usable_http_url(url):
        raise endpoint_error(url)
