"""How s3:// reaches its store: the location URI and the boto3 client built from the standard
AWS chain (environment, shared config/profile, instance role, `AWS_ENDPOINT_URL_S3` /
`AWS_ENDPOINT_URL`). A custom endpoint switches to path-style addressing, which MinIO,
SeaweedFS and most self-hosted stores need; a user:password in it is dropped, never shown.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config

from runner.errors import ConfigError
from runner.storage.endpoint import check_endpoint, endpoint_error
from runner.storage.redact import has_userinfo, redact_url, strip_userinfo
from runner.storage.s3_errors import client_config_error
from runner.storage.s3_transfer import TransferSettings

# the S3Storage logger: these messages kept their name when they left runner.storage.s3
log = logging.getLogger("runner.storage.s3")


def _is_aws_endpoint(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; the prefix has no leading/trailing '/'."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError(f"{uri!r}: expected s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")


def make_client(session: boto3.session.Session | None, settings: TransferSettings) -> Any:
    """The S3 client (a new boto3 session's without one); a mistake in the AWS configuration
    or endpoint raises ConfigError, whose message never quotes the endpoint URL (botocore's
    messages and exception chain may, credentials included)."""
    try:
        return _client(session or boto3.session.Session(), settings)
    except Exception as exc:
        config_error = client_config_error(exc)
        if config_error is not None:
            raise config_error from None
        if isinstance(exc, ValueError):  # botocore: "Invalid endpoint: <url>"
            raise endpoint_error() from None
        raise


def _client(session: boto3.session.Session, settings: TransferSettings) -> Any:
    s = settings
    # No SHA-256 of the body for the signature: botocore computes one over http:// for every
    # request, a second pass over each uploaded byte after the SHA-256 checksum it already
    # computes for the checksum header. That header is signed and the store checks the body
    # against it (a body changed in flight is refused: tests/storage/test_s3_unsigned_payload).
    config = Config(
        # total_max_attempts counts the first try; botocore's max_attempts would not
        retries={"mode": "standard", "total_max_attempts": s.request_attempts},
        connect_timeout=s.connect_timeout_s,
        read_timeout=s.read_timeout_s,
        max_pool_connections=max(10, 2 * s.concurrency),
        s3={"payload_signing_enabled": False},
    )
    client = session.client("s3", config=config)
    endpoint: str = client.meta.endpoint_url
    check_endpoint(endpoint)
    endpoint_url = None
    if has_userinfo(endpoint):
        endpoint_url = strip_userinfo(endpoint)
        log.warning(
            "the S3 endpoint %s carries a user:password, which S3 never uses (requests are "
            "signed with the AWS keys): connecting to %s without it",
            redact_url(endpoint),
            endpoint_url,
        )
    if not _is_aws_endpoint(endpoint):
        # Self-hosted stores rarely resolve bucket.host names.
        # (merge replaces the whole s3 dict: it carries the options above too)
        config = config.merge(
            Config(s3={"payload_signing_enabled": False, "addressing_style": "path"})
        )
    if endpoint_url is not None or not _is_aws_endpoint(endpoint):
        client = session.client("s3", config=config, endpoint_url=endpoint_url)
    return client
