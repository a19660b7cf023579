"""Translate botocore / s3transfer failures into the project's storage errors.

Not found, transient (retry) and permanent (do not retry) are decided by error code and HTTP
status, never by message text. Messages name the bucket, key and endpoint so an operator can
act, and never include credentials: a user:password in a URL botocore quotes is redacted.

Configuration mistakes botocore finds (a missing profile, an unparsable config file, a bad
region or endpoint) become ConfigError (exit 2) with one line saying what to fix. Errors while
reading a response body (`ClassifiedStream`) arrive classified too.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConfigParseError,
    CredentialRetrievalError,
    EndpointResolutionError,
    HTTPClientError,
    IncompleteReadError,
    InvalidConfigError,
    InvalidRegionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProfileNotFound,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from urllib3.exceptions import HTTPError as Urllib3Error

from runner.errors import (
    ConfigError,
    StorageError,
    StorageNotFoundError,
    StoragePermanentError,
    StorageTransientError,
)
from runner.storage.endpoint import endpoint_error
from runner.storage.redact import redact_text

NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})
PERMANENT_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "NoSuchBucket",
        "InvalidBucketName",
        "ExpiredToken",
        "InvalidToken",
        "InvalidObjectState",
    }
)
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "BadDigest",  # body damaged in transit: resending fixes it
        "XAmzContentSHA256Mismatch",
        "IncompleteBody",
    }
)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

_CREDENTIAL_HINT = (
    "check the credentials in the standard AWS chain (AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance role)"
)

_UNREACHABLE_HINT = (
    " (is the endpoint right? check AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and the network)"
)


def client_config_error(exc: BaseException) -> ConfigError | None:
    """A ConfigError for a mistake in the AWS configuration, None for anything else. The
    messages are this module's own: botocore's may quote the endpoint URL with credentials."""
    if isinstance(exc, ProfileNotFound):
        profile = getattr(exc, "kwargs", {}).get("profile", "?")
        return ConfigError(
            f"AWS profile {profile!r} does not exist: fix AWS_PROFILE or add the profile to "
            "the AWS config (AWS_CONFIG_FILE, default ~/.aws/config)"
        )
    if isinstance(exc, ConfigParseError):
        path = getattr(exc, "kwargs", {}).get("path", "?")
        return ConfigError(
            f"cannot parse the AWS config file {path} (AWS_CONFIG_FILE / "
            "AWS_SHARED_CREDENTIALS_FILE): it must be INI sections like [default] / "
            "[profile NAME] of key = value lines"
        )
    if isinstance(exc, InvalidRegionError):
        region = getattr(exc, "kwargs", {}).get("region_name", "?")
        return ConfigError(
            f"AWS region {region!r} is not a region name: fix AWS_DEFAULT_REGION or "
            "the profile's region (e.g. us-east-1)"
        )
    if isinstance(exc, NoRegionError):
        return ConfigError(
            "no AWS region configured: set AWS_DEFAULT_REGION or the profile's "
            "region (e.g. us-east-1)"
        )
    if isinstance(exc, InvalidConfigError):
        return ConfigError(f"invalid AWS configuration: {redact_text(str(exc))}")
    if isinstance(exc, EndpointResolutionError):
        return endpoint_error()
    return None


def classify(exc: BaseException, *, bucket: str, key: str, endpoint: str) -> StorageError:
    """A project error for exc, its message free of URL credentials; StorageError
    subclasses pass through unchanged."""
    if isinstance(exc, StorageError):
        return exc
    error = _classify(exc, bucket=bucket, key=key, endpoint=endpoint)
    error.args = tuple(redact_text(a) if isinstance(a, str) else a for a in error.args)
    return error


def _classify(exc: BaseException, *, bucket: str, key: str, endpoint: str) -> StorageError:
    where = f"s3://{bucket}/{key} at {endpoint}"
    if isinstance(exc, ClientError):
        return _classify_client_error(exc, bucket=bucket, where=where, endpoint=endpoint)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return StoragePermanentError(f"no usable AWS credentials for {where}: {_CREDENTIAL_HINT}")
    if isinstance(
        exc,
        BotoConnectionError
        | HTTPClientError  # connection closed before a response, read timeouts
        | IncompleteReadError
        | ResponseStreamingError
        | Urllib3Error,
    ):
        return StorageTransientError(f"connection problem with {where}: {exc}{_UNREACHABLE_HINT}")
    if isinstance(exc, ConnectionError | TimeoutError):
        return StorageTransientError(f"connection problem with {where}: {exc}{_UNREACHABLE_HINT}")
    if isinstance(exc, BotoCoreError):
        return StoragePermanentError(f"S3 client error for {where}: {exc}")
    return StorageError(f"unexpected failure for {where}: {type(exc).__name__}: {exc}")


def _classify_client_error(
    exc: ClientError, *, bucket: str, where: str, endpoint: str
) -> StorageError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    detail = f"{code or status}: {error.get('Message', '')}".rstrip(": ")
    if code == "NoSuchBucket":
        return StoragePermanentError(
            f"bucket {bucket!r} does not exist at {endpoint} ({detail}); create it or fix "
            "the s3:// location"
        )
    if code in PERMANENT_CODES or status in (401, 403):
        return StoragePermanentError(
            f"access to bucket {bucket!r} at {endpoint} was refused ({detail}); "
            f"{_CREDENTIAL_HINT} and the bucket policy"
        )
    if code in NOT_FOUND_CODES or (status == 404 and code not in TRANSIENT_CODES):
        return StorageNotFoundError(f"{where} does not exist")
    if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
        answer = detail if detail.startswith(str(status)) else f"{status} {detail}"
        return StorageTransientError(f"{where}: server answered {answer}")
    return StoragePermanentError(f"{where}: request refused ({status} {detail})")


def error_code(exc: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of a botocore error; ("", 0) for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


class ClassifiedStream(io.RawIOBase):
    """A response body whose read errors arrive as the project's storage errors."""

    def __init__(self, body: Any, *, on_error: Callable[[BaseException], StorageError]) -> None:
        self._body = body
        self._on_error = on_error

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._body.read(len(view))
        except Exception as exc:
            raise self._on_error(exc) from exc
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()
