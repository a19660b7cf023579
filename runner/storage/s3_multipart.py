"""Multipart uploads left behind on s3://: the sweep that aborts the uploads a failed call
started when s3transfer's own abort failed, and the keys of uploads never completed or
aborted (what `list_incomplete_uploads` reports).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# the S3Storage logger: these messages kept their name when they left runner.storage.s3
log = logging.getLogger("runner.storage.s3")


def abort_multipart(client: Any, *, bucket: str, full_key: str, since: datetime) -> None:
    """Abort full_key's multipart uploads started at or after since (best effort: the
    store's lifecycle rule for incomplete uploads is the backstop)."""
    try:
        listing = client.list_multipart_uploads(Bucket=bucket, Prefix=full_key)
        for upload in listing.get("Uploads", []):
            initiated = upload.get("Initiated")
            if upload.get("Key") != full_key:
                continue
            if isinstance(initiated, datetime) and initiated < since.replace(microsecond=0):
                continue
            client.abort_multipart_upload(Bucket=bucket, Key=full_key, UploadId=upload["UploadId"])
            log.info("aborted incomplete multipart upload of s3://%s/%s", bucket, full_key)
    except Exception as exc:  # the original upload error matters more than this one
        log.warning(
            "could not abort incomplete multipart uploads of s3://%s/%s: %s",
            bucket,
            full_key,
            exc,
        )


def incomplete_keys(response: Mapping[str, Any], *, root: str) -> tuple[str, ...]:
    """The keys (relative to root) of a ListMultipartUploads answer, sorted."""
    return tuple(sorted(u["Key"][len(root) :] for u in response.get("Uploads", [])))
