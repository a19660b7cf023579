"""What each cloud's metadata server says about preemption, one small class per cloud.

Every source has `probe()` (is this cloud's endpoint here at all?) and `check()` (is a
preemption notice posted now?). They talk plain HTTP to a link-local address and never go
through a proxy: HTTP(S)_PROXY from the environment must not see metadata requests.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import ClassVar, Protocol

from runner.storage.redact import redact_text, strip_userinfo

METADATA_BASE = "http://169.254.169.254"
# metadata.google.internal resolves to the same address; using it avoids a DNS lookup that
# can hang off-cloud.
GCP_METADATA_BASE = METADATA_BASE
# GCP gives 30 s between the preemption notice and the hard stop; Azure Spot at least 30 s.
GCP_NOTICE_SECONDS = 30.0
AZURE_DEFAULT_NOTICE_SECONDS = 30.0


class MetadataUnavailable(Exception):
    """The endpoint did not answer like the cloud it imitates (off-cloud, network down)."""


@dataclass(frozen=True, slots=True)
class Notice:
    source: str
    """aws | gcp | azure"""
    detail: str
    deadline_unix: float
    """Wall-clock (UNIX time) instant of the termination."""


class NoticeSource(Protocol):
    name: str

    def probe(self) -> bool: ...

    def check(self) -> Notice | None: ...


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(
    url: str, *, headers: dict[str, str], timeout: float, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body). HTTP error statuses are returned, not raised; network
    failures raise MetadataUnavailable."""
    try:
        # inside the try: a malformed URL raises ValueError here, and in the poller thread
        # an exception that is not MetadataUnavailable would end polling for the whole run
        req = urllib.request.Request(url, headers=headers, method=method)
        with _NO_PROXY.open(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read() if exc.fp is not None else b""
        return exc.code, dict(exc.headers.items()) if exc.headers else {}, body
    except (urllib.error.URLError, OSError, ValueError) as exc:
        # logged by the poller: a user:password in --notice-endpoint must not show
        raise MetadataUnavailable(redact_text(f"{url}: {exc}")) from exc


def _parse_iso8601(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class _MetadataClient:
    """Where a cloud's metadata server is, how long to wait for it, and the wall clock."""

    def __init__(
        self,
        base: str = METADATA_BASE,
        *,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # urllib never sends a URL's user:password (it would take it for part of the host
        # name) and metadata servers want none: dropped, so it is never echoed either
        self.base = strip_userinfo(base).rstrip("/")
        self.timeout = timeout
        self._clock = clock


class AwsSpotNotice(_MetadataClient):
    """EC2 IMDSv2: a session token (PUT), then `spot/instance-action` (404 = no notice).

    The notice looks like `{"action": "terminate", "time": "2026-11-30T06:02:00Z"}`.
    """

    name = "aws"
    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    TOKEN_TTL_SECONDS = 21600

    def __init__(
        self,
        base: str = METADATA_BASE,
        *,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(base, timeout=timeout, clock=clock)
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        status, _, body = _request(
            self.base + self.TOKEN_PATH,
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_SECONDS)},
            timeout=self.timeout,
        )
        if status != 200 or not body:
            raise MetadataUnavailable(f"IMDSv2 token request answered HTTP {status}")
        self._token = body.decode().strip()
        # Refresh well before the TTL runs out.
        self._token_expires = self._clock() + self.TOKEN_TTL_SECONDS / 2
        return self._token

    def _token_now(self) -> str:
        if self._token is None or self._clock() >= self._token_expires:
            return self._fetch_token()
        return self._token

    def probe(self) -> bool:
        try:
            self._fetch_token()
        except MetadataUnavailable:
            return False
        return True

    def check(self) -> Notice | None:
        status, _, body = self._get_action(self._token_now())
        if status == 401:  # token expired or revoked: one fresh try
            status, _, body = self._get_action(self._fetch_token())
        if status == 404:
            return None
        if status != 200:
            raise MetadataUnavailable(f"spot/instance-action answered HTTP {status}")
        try:
            data = json.loads(body)
            action = str(data["action"])
            deadline = _parse_iso8601(str(data["time"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataUnavailable(f"spot/instance-action: unreadable notice {body!r}") from exc
        return Notice(self.name, f"spot instance-action {action} at {data['time']}", deadline)

    def _get_action(self, token: str) -> tuple[int, dict[str, str], bytes]:
        return _request(
            self.base + self.ACTION_PATH,
            headers={"X-aws-ec2-metadata-token": token},
            timeout=self.timeout,
        )


class GcpPreemptedNotice(_MetadataClient):
    """GCE metadata `instance/preempted`: "TRUE" once the VM is being preempted (30 s left)."""

    name = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def _get(self) -> tuple[int, dict[str, str], bytes]:
        return _request(self.base + self.PATH, headers=self.HEADERS, timeout=self.timeout)

    def probe(self) -> bool:
        try:
            status, headers, _ = self._get()
        except MetadataUnavailable:
            return False
        flavor = {k.lower(): v for k, v in headers.items()}.get("metadata-flavor")
        return status == 200 and flavor == "Google"

    def check(self) -> Notice | None:
        status, _, body = self._get()
        if status != 200:
            raise MetadataUnavailable(f"instance/preempted answered HTTP {status}")
        if body.strip().upper() != b"TRUE":
            return None
        return Notice(self.name, "instance/preempted is TRUE", self._clock() + GCP_NOTICE_SECONDS)


class AzurePreemptNotice(_MetadataClient):
    """Azure Scheduled Events: an event with EventType "Preempt"; NotBefore is the deadline."""

    name = "azure"
    PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata": "true"}

    def _events(self) -> list[dict[str, object]]:
        status, _, body = _request(
            self.base + self.PATH, headers=self.HEADERS, timeout=self.timeout
        )
        if status != 200:
            raise MetadataUnavailable(f"scheduledevents answered HTTP {status}")
        try:
            data = json.loads(body)
            events = data["Events"]
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataUnavailable(f"scheduledevents: unreadable answer {body!r}") from exc
        if not isinstance(events, list):
            raise MetadataUnavailable("scheduledevents: 'Events' is not a list")
        return [e for e in events if isinstance(e, dict)]

    def probe(self) -> bool:
        try:
            self._events()
        except MetadataUnavailable:
            return False
        return True

    def check(self) -> Notice | None:
        for event in self._events():
            if event.get("EventType") != "Preempt":
                continue
            not_before = str(event.get("NotBefore") or "")
            try:
                deadline = parsedate_to_datetime(not_before).timestamp()
            except (TypeError, ValueError):
                # An event without a usable NotBefore has started already: use the minimum.
                deadline = self._clock() + AZURE_DEFAULT_NOTICE_SECONDS
            detail = (
                f"scheduled event {event.get('EventId', '?')} Preempt, NotBefore {not_before!r}"
            )
            return Notice(self.name, detail, deadline)
        return None


def make_source(name: str, *, base: str | None, timeout: float) -> NoticeSource:
    if name == "aws":
        return AwsSpotNotice(base or METADATA_BASE, timeout=timeout)
    if name == "gcp":
        return GcpPreemptedNotice(base or GCP_METADATA_BASE, timeout=timeout)
    if name == "azure":
        return AzurePreemptNotice(base or METADATA_BASE, timeout=timeout)
    raise ValueError(f"unknown notice source {name!r}")
