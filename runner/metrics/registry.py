"""What the runner measures: the Prometheus metrics named in DESIGN.md ('Metrics').

Every stage reports here (writer, mirror, preemption, resume); `runner.metrics.server` serves
the registry on `/metrics` and a short JSON summary on `/healthz`.

Checkpoint age is computed when Prometheus scrapes, not when a checkpoint is written, so a run
that silently stops checkpointing keeps getting older. Before the first checkpoint of this
process the age counts from the moment `RunnerMetrics` was created (process start): a run that
never checkpoints still goes stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from runner.metrics.goodput import GoodputCollector

__all__ = [
    "DURATION_BUCKETS",
    "FAILURE_STAGES",
    "LOCAL",
    "NOTICE_SOURCES",
    "REMOTE",
    "RunnerMetrics",
]

LOCAL = "local"
REMOTE = "remote"
FAILURE_STAGES = ("save", "upload", "verify", "restore", "loss_log", "attempts")
NOTICE_SOURCES = ("aws", "gcp", "azure", "sigterm")
# Seconds: a tiny CPU checkpoint takes ~0.1 s, a multi-GB upload over a slow link ~10 min.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A background save stalls the loop for a copy into host memory: milliseconds, so the stall's
# buckets start three decades lower (a sync save's stall lands in the upper ones).
STALL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


class RunnerMetrics:
    """The runner's metrics in one registry of their own (never the process-global one).

    Thread-safe: the training loop, the mirror's upload thread and the notice poller all
    report here while the HTTP server reads.

    `mirrored=False` (no `--mirror`) leaves out the `location="remote"` age series, so the
    stale alert watches the local checkpoints instead of paging about a mirror that does not
    exist.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.time,
        mirrored: bool = True,
    ) -> None:
        """Declares every metric of DESIGN.md's 'Metrics' table, one statement each: long, but
        the names, help texts and labels a dashboard depends on stay in one readable list."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._started_at = clock()
        self._locations = (LOCAL, REMOTE) if mirrored else (LOCAL,)
        self._lock = threading.Lock()
        self._last_success: dict[str, float] = {}
        self._last_step: dict[str, int] = {}
        self._step: int | None = None

        reg = self.registry
        self._last_success_ts = Gauge(
            "runner_checkpoint_last_success_timestamp_seconds",
            "Unix time of the newest checkpoint this process committed (local) or mirrored "
            "(remote).",
            ["location"],
            registry=reg,
        )
        self._last_step_gauge = Gauge(
            "runner_checkpoint_last_step",
            "Training step of the newest checkpoint committed (local) or mirrored (remote).",
            ["location"],
            registry=reg,
        )
        self._train_step = Gauge(
            "runner_train_step", "Optimizer updates completed so far.", registry=reg
        )
        self._save_duration = Histogram(
            "runner_checkpoint_save_duration_seconds",
            "Time to write and commit one local checkpoint.",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self._stall = Histogram(
            "runner_checkpoint_stall_seconds",
            "Time the training loop was blocked by one checkpoint (async: the copy into host "
            "memory and any wait for the previous save; sync: the whole save).",
            buckets=STALL_BUCKETS,
            registry=reg,
        )
        self._upload_duration = Histogram(
            "runner_checkpoint_upload_duration_seconds",
            "Time to upload and verify one checkpoint in the mirror.",
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self._bytes = Gauge(
            "runner_checkpoint_bytes",
            "Size in bytes of the newest committed local checkpoint.",
            registry=reg,
        )
        self._failures = Counter(
            "runner_checkpoint_failures",
            "Checkpoint operations that failed, by stage (save, upload, verify, restore, "
            "loss_log: an append to loss.jsonl, attempts: an attempt record's append or copy).",
            ["stage"],
            registry=reg,
        )
        self._notices = Counter(
            "runner_preemption_notices",
            "Preemption notices received, by source (aws, gcp, azure, sigterm).",
            ["source"],
            registry=reg,
        )
        self._resumes = Counter(
            "runner_resumes", "Times this run resumed from a checkpoint.", registry=reg
        )
        self._steps_lost = Counter(
            "runner_steps_lost",
            "Steps redone after resuming: progress past the checkpoint that was resumed.",
            registry=reg,
        )
        # Children exist from the start so that increase() sees the first failure or notice
        # (a counter that appears already at 1 looks like no increase at all).
        for stage in FAILURE_STAGES:
            self._failures.labels(stage=stage)
        for source in NOTICE_SOURCES:
            self._notices.labels(source=source)
        reg.register(_AgeCollector(self))
        self._goodput = GoodputCollector()
        reg.register(self._goodput)

    # -- reporting (called by the writer, the mirror, the loop, the notice poller) --------------

    def checkpoint_saved(self, *, step: int, duration_s: float, size_bytes: int) -> None:
        """A checkpoint was committed in the local run dir."""
        self._save_duration.observe(duration_s)
        self._bytes.set(size_bytes)
        self._record_success(LOCAL, step)

    def checkpoint_stalled(self, seconds: float) -> None:
        """The training loop was blocked `seconds` by one checkpoint."""
        self._stall.observe(seconds)

    def checkpoint_uploaded(self, *, step: int, duration_s: float) -> None:
        """A checkpoint is in the mirror, verified, manifest last."""
        self._upload_duration.observe(duration_s)
        self._record_success(REMOTE, step)

    def checkpoint_failed(self, stage: str) -> None:
        """One failed attempt at `stage`: save, upload, verify, restore or loss_log."""
        self._failures.labels(stage=stage).inc()

    def train_step(self, step: int) -> None:
        """`step` optimizer updates are complete."""
        with self._lock:
            self._step = step
        self._train_step.set(step)

    def preemption_notice(self, source: str) -> None:
        """A stop was requested by `source`: aws, gcp, azure (metadata notices) or sigterm."""
        self._notices.labels(source=source).inc()

    def resumed(self, *, steps_lost: int = 0) -> None:
        """Training resumed from a checkpoint; `steps_lost` steps must be redone."""
        if steps_lost < 0:
            raise ValueError(f"steps_lost must be >= 0, got {steps_lost}")
        self._resumes.inc()
        self._steps_lost.inc(steps_lost)

    def checkpoint_found(self, *, location: str, step: int, created_at: float) -> None:
        """A checkpoint committed before this process started (found when resuming).

        Ages then count from its `created_at` (Unix time) instead of from process start, so
        a run preempted again and again before it manages a new checkpoint still goes
        stale. Never moves a location's last success backwards.
        """
        if location not in (LOCAL, REMOTE):
            raise ValueError(f"location must be {LOCAL!r} or {REMOTE!r}, got {location!r}")
        self._record_success(location, step, at=created_at, only_if_newer=True)

    def goodput(self, *, ratio: float, badput: Mapping[str, float]) -> None:
        """The run's goodput so far (runner.goodput.account, every attempt's records)."""
        self._goodput.update(ratio=ratio, badput=badput)

    def checkpoint_interval(self, seconds: float) -> None:
        """The checkpoint interval in use (`--ckpt-every-seconds auto` re-chooses it)."""
        self._goodput.interval(seconds)

    # -- reading (scrapes, /healthz, tests) ------------------------------------------------------

    def checkpoint_ages(self) -> dict[str, float]:
        """Seconds since the newest checkpoint per location (since start when none yet)."""
        now = self._clock()
        with self._lock:
            return {
                loc: max(0.0, now - self._last_success.get(loc, self._started_at))
                for loc in self._locations
            }

    def health(self) -> dict[str, Any]:
        """The `/healthz` body: where training is and how old the checkpoints are."""
        ages = self.checkpoint_ages()
        with self._lock:
            return {
                "status": "ok",
                "step": self._step,
                "checkpoint_age_seconds": {loc: round(age, 3) for loc, age in ages.items()},
                "checkpoint_step": {loc: self._last_step.get(loc) for loc in self._locations},
            }

    def _record_success(
        self, location: str, step: int, *, at: float | None = None, only_if_newer: bool = False
    ) -> None:
        when = self._clock() if at is None else at
        with self._lock:
            if only_if_newer and when <= self._last_success.get(location, float("-inf")):
                return
            self._last_success[location] = when
            self._last_step[location] = step
            # Inside the lock so the gauges and the age collector never disagree.
            self._last_success_ts.labels(location=location).set(when)
            self._last_step_gauge.labels(location=location).set(step)


class _AgeCollector(Collector):
    """`runner_checkpoint_age_seconds{location}`, evaluated at each scrape."""

    def __init__(self, metrics: RunnerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Lets the registry learn the name without evaluating the clock at registration.
        yield GaugeMetricFamily("runner_checkpoint_age_seconds", "", labels=["location"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "runner_checkpoint_age_seconds",
            "Seconds since the newest checkpoint committed (local) or mirrored (remote); "
            "since process start when there is none yet.",
            labels=["location"],
        )
        for location, age in self._metrics.checkpoint_ages().items():
            family.add_metric([location], age)
        yield family
