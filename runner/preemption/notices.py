"""Poll a cloud's metadata server for a preemption notice in a background thread.

A notice turns into `controller.request_stop(reason, deadline=...)`: the loop commits its
final checkpoint at the next step boundary and exits 75, with the cloud's termination time
as the deadline. `--notices auto` finds the cloud by probing each endpoint from the thread
with short timeouts, so start-up never waits for it off-cloud.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from runner.config import RunConfig
from runner.preemption.clouds import MetadataUnavailable, Notice, NoticeSource, make_source
from runner.preemption.stop import StopController
from runner.storage.redact import has_userinfo, redact_url, strip_userinfo

log = logging.getLogger(__name__)

AUTO_ORDER = ("aws", "gcp", "azure")
PROBE_TIMEOUT_SECONDS = 1.0
REQUEST_TIMEOUT_SECONDS = 2.0


class NoticeMetrics(Protocol):
    def preemption_notice(self, source: str) -> None: ...


class NoticePoller:
    """Background thread: (probe,) poll every `interval` seconds, stop at the first notice."""

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        controller: StopController,
        *,
        interval: float,
        detect: bool = False,
        metrics: NoticeMetrics | None = None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not sources:
            raise ValueError("NoticePoller needs at least one source")
        self.sources = list(sources)
        self.controller = controller
        self.interval = interval
        self.detect = detect
        self.metrics = metrics
        self._wall = wall_clock
        self._mono = monotonic
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-notice-poller", daemon=True)
        self.active: NoticeSource | None = None if detect else self.sources[0]
        self.notice: Notice | None = None
        self.polls = 0

    def start(self) -> NoticePoller:
        self._thread.start()
        return self

    def close(self, timeout: float = REQUEST_TIMEOUT_SECONDS + 1.0) -> None:
        """Stop polling. A request in flight finishes within its own timeout (daemon thread)."""
        self._closing.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def stop(self) -> None:
        """Same as `close()`."""
        self.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        if self.detect:
            self.active = self._detect()
            if self.active is None:
                log.info("notices auto: no cloud metadata endpoint answered; notices off")
                return
            log.info("notices auto: polling %s preemption notices", self.active.name)
        source = self.active
        if source is None:
            return
        failures = 0
        while not self._closing.is_set():
            try:
                notice = source.check()
            except MetadataUnavailable as exc:
                failures += 1
                # Log the first failure and then rarely: a flaky endpoint must not flood logs.
                if failures == 1 or failures % 100 == 0:
                    log.warning("%s notice poll failed (%d so far): %s", source.name, failures, exc)
                notice = None
            self.polls += 1
            if notice is not None:
                self._deliver(notice)
                return
            self._closing.wait(self.interval)

    def _detect(self) -> NoticeSource | None:
        for source in self.sources:
            if self._closing.is_set():
                return None
            if source.probe():
                return source
        return None

    def _deliver(self, notice: Notice) -> None:
        self.notice = notice
        seconds_left = notice.deadline_unix - self._wall()
        self.controller.request_stop(
            f"{notice.source} preemption notice", deadline=self._mono() + seconds_left
        )
        if self.metrics is not None:
            self.metrics.preemption_notice(notice.source)
        log.warning(
            "%s preemption notice (%s): %.1f s left; final checkpoint at the next step boundary",
            notice.source,
            notice.detail,
            seconds_left,
        )


def start_notice_poller(
    config: RunConfig, controller: StopController, metrics: NoticeMetrics | None = None
) -> NoticePoller | None:
    """Start the poller `config.notices` asks for; None when notices are off."""
    if config.notices == "off":
        return None
    detect = config.notices == "auto"
    if config.notice_endpoint is not None and has_userinfo(config.notice_endpoint):
        log.warning(
            "--notice-endpoint %s carries a user:password, which metadata requests never "
            "send: polling %s without it",
            redact_url(config.notice_endpoint),
            strip_userinfo(config.notice_endpoint),
        )
    names = AUTO_ORDER if detect else (config.notices,)
    timeout = min(REQUEST_TIMEOUT_SECONDS, max(config.notice_poll_seconds, 0.1))
    sources = [
        make_source(
            name,
            base=config.notice_endpoint,
            timeout=PROBE_TIMEOUT_SECONDS if detect else timeout,
        )
        for name in names
    ]
    return NoticePoller(
        sources,
        controller,
        interval=config.notice_poll_seconds,
        detect=detect,
        metrics=metrics,
    ).start()
