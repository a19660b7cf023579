"""s3:// backend: `S3Storage`, any S3-compatible store through boto3 and s3transfer, with
the retry budget its operations share (`_call`). Configuration comes only from the standard
AWS chain (runner.storage.s3_client builds the client).

Integrity of an upload: while the transfer runs, one read of the local file computes its
sha256 (which must equal the manifest's, else the upload is deleted and IntegrityError raised)
and the SHA-256 of every multipart part in the same pass. The upload
asks the server to check SHA-256 per request (`ChecksumAlgorithm=SHA256`); afterwards a HEAD
checks the size and compares the server's checksum (the full digest, or for multipart the
composite digest of the part digests) with the local one (runner.storage.s3_checksum). Stores
that do not return checksums get a size check only; the manifest's sha256 is checked again on
every download.

Retries happen on two levels: botocore retries a single request a few times (so one dropped
part does not restart a 1 GB file), and the whole operation is retried with exponential backoff
and jitter on StorageTransientError, within the store timeout (`--store-timeout`): connect and
read timeouts are derived from it so that one try fits (runner.storage.s3_transfer), and no
try starts once the store has been failing for that long (docs/storage.md, "Time limits").
Permanent errors (403, NoSuchBucket, bad keys; runner.storage.s3_errors) are never retried. A
failed multipart upload is aborted by s3transfer; if that abort itself fails, a sweep aborts
the key's uploads started by this call (runner.storage.s3_multipart).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import boto3

from runner.atomicity.files import CHUNK, HashingFileWriter
from runner.errors import (
    ConfigError,
    IntegrityError,
    RunnerError,
    StorageConflictError,
    StorageError,
    StorageTimeoutError,
    StorageTransientError,
)
from runner.storage.base import ObjectInfo, ProgressCallback, check_download, check_key
from runner.storage.limits import DEFAULT_STORE_TIMEOUT_S
from runner.storage.retry import RetryPolicy
from runner.storage.s3_checksum import UploadCheck, expected_checksum
from runner.storage.s3_client import make_client, parse_s3_uri
from runner.storage.s3_errors import ClassifiedStream, classify, client_config_error, error_code
from runner.storage.s3_managers import Transfers
from runner.storage.s3_multipart import abort_multipart, incomplete_keys
from runner.storage.s3_parts import UPLOAD_PART_EVENT, PartChecksums, PartDigests
from runner.storage.s3_transfer import Moved, Progress, TransferSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


class S3Storage:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        session: boto3.session.Session | None = None,
        settings: TransferSettings | None = None,
        retry: RetryPolicy | None = None,
        store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
        give_up_once: bool = False,
    ) -> None:
        """store_timeout_s sizes the defaults of settings and retry (docs/storage.md, "Time
        limits"); explicit ones are used as given. With give_up_once (a CLI command), once a
        call gave up on the store every later call fails at once instead of spending the
        store timeout again (a command reading N checkpoints ends in T, not N x T)."""
        if not bucket:
            raise ConfigError("S3 location needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.settings = settings or TransferSettings.for_store_timeout(store_timeout_s)
        self.retry = retry or RetryPolicy(budget_s=store_timeout_s)
        self._client = make_client(session, self.settings)
        # never holds credentials: make_client drops any user:password@ part
        self.endpoint: str = self._client.meta.endpoint_url
        self._upload_check = UploadCheck(self.endpoint)
        self._part_checksums = PartChecksums()
        self._client.meta.events.register(UPLOAD_PART_EVENT, self._part_checksums.supply)
        # one long-lived manager (per lane) for every put_file / get_file; see close()
        self.transfers = Transfers(self._client, self.settings.transfer_config())
        self._conditional_puts = True
        self._give_up_once = give_up_once
        self._gave_up: StorageTransientError | None = None

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> S3Storage:
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket, prefix, **kwargs)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __repr__(self) -> str:
        return f"S3Storage({self.uri} at {self.endpoint})"

    def local_path(self, key: str = "") -> Path | None:
        return None  # objects, not files: every access is a request

    def close(self) -> None:
        """Shut down the transfer managers (runner.storage.s3_transfer.Transfers.close): never
        waits for a transfer still running; the storage stays usable."""
        self.transfers.close()

    # -- helpers -------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        check_key(key, uri=self.uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(
        self,
        what: str,
        key: str,
        func: Callable[[], T],
        *,
        last_progress: Callable[[], float | None] | None = None,
    ) -> T:
        """One operation with error classification and whole-operation retries, within the
        store timeout. A retry starts only if one more request that never gets an answer
        would still end within the budget."""

        def attempt() -> T:
            try:
                return func()
            except RunnerError:  # already in the project's terms (integrity, conflict, ...)
                raise
            except Exception as exc:  # classified below; unknown errors stay StorageError
                config_error = client_config_error(exc)
                if config_error is not None:
                    raise config_error from None
                raise classify(
                    exc, bucket=self.bucket, key=self._full_or_raw(key), endpoint=self.endpoint
                ) from exc

        if self._gave_up is not None:
            raise StorageTimeoutError(
                f"{what} {self.uri}/{key}: not tried, the store already failed this command "
                "(the first error says how)"
            )
        try:
            return self.retry.call(
                f"{what} {self.uri}/{key}",
                attempt,
                try_worst_s=self.settings.request_worst_s(),
                last_progress=last_progress,
            )
        except StorageTransientError as exc:
            # anything transient that escaped the retry loop used up its tries or its time:
            # either way the store failed this command
            if self._give_up_once:
                self._gave_up = exc
            raise

    def _full_or_raw(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix and key else key or self.prefix

    # -- upload --------------------------------------------------------------------------

    def put_file(
        self,
        key: str,
        src: Path,
        *,
        sha256: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Long: the local hash pass, the transfer and what a failure undoes (abort, delete)
        share one budgeted call."""
        full_key = self._full(key)
        size = Path(src).stat().st_size
        moved = Moved()
        with (
            ThreadPoolExecutor(1, "upload-checksum") as pool,
            self._part_checksums.track(self.bucket, full_key) as parts,
        ):
            # the local hash pass overlaps the transfer (and hands it each part's digest);
            # it is checked before verifying
            checksum = pool.submit(self._hash_pass, src, size, sha256, parts) if sha256 else None
            if checksum is None:
                parts.end()  # nothing hashes the parts: botocore does

            def upload() -> None:
                started = datetime.now(UTC)
                subscribers = [Progress(moved.touch)] + ([Progress(progress)] if progress else [])
                try:
                    self.transfers.run(
                        lambda manager: manager.upload(
                            str(src),
                            self.bucket,
                            full_key,
                            extra_args={"ChecksumAlgorithm": "SHA256"},
                            subscribers=subscribers,
                        )
                    )
                except BaseException as exc:
                    if size >= self.settings.multipart_threshold:
                        abort_multipart(
                            self._client, bucket=self.bucket, full_key=full_key, since=started
                        )
                    # a file that changed under the hash pass gets its parts refused as
                    # BadDigest (retryable); the pass's IntegrityError says what is wrong
                    if checksum is not None and isinstance(exc, Exception):
                        local = checksum.exception()
                        if isinstance(local, IntegrityError):
                            raise local from exc
                    raise
                expected = checksum.result() if checksum is not None else None
                self._verify_upload(key, size=size, expected=expected)

            try:
                # bytes sent restart the budget: a long upload that keeps moving is not cut
                self._call("upload", key, upload, last_progress=moved.at)
            except IntegrityError:
                # the local file does not match its manifest: what was sent must not stay
                with contextlib.suppress(Exception):
                    self._client.delete_object(Bucket=self.bucket, Key=full_key)
                raise

    def _hash_pass(self, src: Path, size: int, sha256: str, parts: PartDigests) -> str:
        try:
            return expected_checksum(
                src, size=size, sha256=sha256, settings=self.settings, on_part=parts.add
            )
        finally:
            parts.end()  # a part still waiting for its digest goes on without one

    def _verify_upload(self, key: str, *, size: int, expected: str | None) -> None:
        head = self._client.head_object(
            Bucket=self.bucket, Key=self._full(key), ChecksumMode="ENABLED"
        )
        self._upload_check.check(head, where=f"{self.uri}/{key}", size=size, expected=expected)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Single PUT; the server checks the body's SHA-256. With if_absent the write fails
        with StorageConflictError when the key exists (If-None-Match: *, atomic on the
        server); stores without conditional writes fall back to a check-then-put."""
        full_key = self._full(key)
        checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()

        def put() -> None:
            args: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": full_key,
                "Body": data,
                "ChecksumSHA256": checksum,
            }
            if if_absent and self._conditional_puts:
                args["IfNoneMatch"] = "*"
            elif if_absent and self._exists(full_key):
                raise StorageConflictError(f"{self.uri}/{key} already exists")
            try:
                self._client.put_object(**args)
            except Exception as exc:
                code, status = error_code(exc)
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                    raise StorageConflictError(f"{self.uri}/{key} already exists") from exc
                if "IfNoneMatch" in args and code in ("NotImplemented", "InvalidArgument"):
                    log.warning(
                        "%s does not support conditional writes; using check-then-put",
                        self.endpoint,
                    )
                    self._conditional_puts = False
                    raise StorageTransientError("retrying without If-None-Match") from exc
                raise

        self._call("put", key, put)

    def _exists(self, full_key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=full_key)
        except Exception as exc:
            code, status = error_code(exc)
            if status == 404 and code != "NoSuchBucket":
                return False
            raise
        return True

    # -- download ------------------------------------------------------------------------

    def get_file(
        self,
        key: str,
        dst: Path,
        *,
        progress: ProgressCallback | None = None,
        sha256: str | None = None,
        size: int | None = None,
    ) -> None:
        """Concurrent ranged GETs written in order into a hashing temp file (s3transfer keeps
        a non-seekable target in order), so the sha256 comes from the same pass; fsync,
        rename. With size / sha256 given, a mismatch raises IntegrityError and leaves nothing."""
        full_key = self._full(key)
        dst = Path(dst)
        moved = Moved()

        def download() -> None:
            subscribers = [Progress(moved.touch)] + ([Progress(progress)] if progress else [])
            with HashingFileWriter(dst) as writer:
                self.transfers.run(
                    lambda manager: manager.download(
                        self.bucket, full_key, cast(Any, writer), subscribers=subscribers
                    )
                )
                check_download(
                    f"{self.uri}/{key}",
                    got_size=writer.size,
                    got_sha256=writer.digest_so_far(),
                    size=size,
                    sha256=sha256,
                )
                writer.commit()

        self._call("download", key, download, last_progress=moved.at)

    def get_bytes(self, key: str) -> bytes:
        full_key = self._full(key)

        def get() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=full_key)["Body"]
            with body:
                return cast(bytes, body.read())

        return self._call("get", key, get)

    def open_read(self, key: str) -> BinaryIO:
        full_key = self._full(key)
        body = self._call(
            "open",
            key,
            lambda: self._client.get_object(Bucket=self.bucket, Key=full_key)["Body"],
        )
        raw = ClassifiedStream(body, on_error=lambda exc: self._classify(exc, key))
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=CHUNK))

    def _classify(self, exc: BaseException, key: str) -> StorageError:
        return classify(exc, bucket=self.bucket, key=self._full(key), endpoint=self.endpoint)

    # -- metadata ------------------------------------------------------------------------

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        root = f"{self.prefix}/" if self.prefix else ""

        def collect() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=root + prefix):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(root) :]
                    if key and not key.endswith("/"):
                        found.append(
                            ObjectInfo(
                                key=key,
                                size=int(obj["Size"]),
                                modified=_timestamp(obj.get("LastModified")),
                            )
                        )
            return found

        yield from self._call("list", prefix, collect)

    def head(self, key: str) -> ObjectInfo:
        full_key = self._full(key)
        response = self._call(
            "head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full_key)
        )
        return ObjectInfo(
            key=key,
            size=int(response["ContentLength"]),
            modified=_timestamp(response.get("LastModified")),
        )

    def delete(self, key: str) -> None:
        full_key = self._full(key)
        self._call(
            "delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full_key)
        )

    def list_incomplete_uploads(self, prefix: str = "") -> tuple[str, ...]:
        """Keys with multipart uploads that were neither completed nor aborted."""
        root = f"{self.prefix}/" if self.prefix else ""
        response = self._call(
            "list uploads",
            prefix,
            lambda: self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=root + prefix),
        )
        return incomplete_keys(response, root=root)

    @property
    def server_checksums(self) -> bool | None:
        """Whether the store returned SHA-256 checksums (None: no upload verified yet)."""
        return self._upload_check.server_checksums


def _timestamp(when: datetime | None) -> float | None:
    """Some S3-compatible stores omit LastModified; unknown age is never "old enough"."""
    return when.timestamp() if when is not None else None
