"""Translate botocore / s3transfer failures into the project's storage errors.

Not found, transient (retry) and permanent (do not retry) are decided by error code and HTTP
status, never by message text. Messages name the bucket, key and endpoint so an operator can
act, and never include credentials.
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from urllib3.exceptions import HTTPError as Urllib3Error

from runner.errors import (
    StorageError,
    StorageNotFoundError,
    StoragePermanentError,
    StorageTransientError,
)

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


def classify(exc: BaseException, *, bucket: str, key: str, endpoint: str) -> StorageError:
    """A project error for exc; StorageError subclasses pass through unchanged."""
    if isinstance(exc, StorageError):
        return exc
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
        return StorageTransientError(f"{where}: server answered {status} {detail}; will retry")
    return StoragePermanentError(f"{where}: request refused ({status} {detail})")
