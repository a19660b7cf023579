"""`runner_goodput_ratio`, `runner_badput_seconds_total{kind}` and
`runner_checkpoint_interval_seconds`: the run's goodput so far, from its attempt records
(runner.goodput.account), so that a new pod continues the count of the ones before it."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class GoodputCollector(Collector):
    """The newest account, served at each scrape. A kind's badput never goes down (a counter:
    Prometheus reads a decrease as a reset), although a later account may move seconds from
    `other` to a named kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ratio: float | None = None
        self._badput: dict[str, float] = {}
        self._interval: float | None = None

    def update(self, *, ratio: float, badput: Mapping[str, float]) -> None:
        with self._lock:
            self._ratio = ratio
            for kind, seconds in badput.items():
                self._badput[kind] = max(self._badput.get(kind, 0.0), seconds)

    def interval(self, seconds: float) -> None:
        with self._lock:
            self._interval = seconds

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("runner_goodput_ratio", "")
        yield CounterMetricFamily("runner_badput_seconds", "", labels=["kind"])
        yield GaugeMetricFamily("runner_checkpoint_interval_seconds", "")

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            ratio, badput, interval = self._ratio, dict(self._badput), self._interval
        # families without samples until the first account: never a made-up 0
        ratio_family = GaugeMetricFamily(
            "runner_goodput_ratio",
            "Share of the run's wall time so far (every attempt, from the attempt records) "
            "that trained steps which survive.",
        )
        if ratio is not None:
            ratio_family.add_metric([], ratio)
        yield ratio_family
        family = CounterMetricFamily(
            "runner_badput_seconds",
            "The run's wall time so far that did not train surviving steps, by kind "
            "(startup, restore, checkpoint_stall, wasted_progress, between_attempts, other).",
            labels=["kind"],
        )
        for kind, seconds in sorted(badput.items()):
            family.add_metric([kind], seconds)
        yield family
        interval_family = GaugeMetricFamily(
            "runner_checkpoint_interval_seconds",
            "The checkpoint interval in use (--ckpt-every-seconds, or the one chosen by "
            "`auto` from the measured checkpoint cost and failure rate).",
        )
        if interval is not None:
            interval_family.add_metric([], interval)
        yield interval_family
