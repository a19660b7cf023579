"""The alert rules, defined once: `deploy/prometheus/alerts.yml` and the k8s PrometheusRule
are both rendered from here (`python -m runner.metrics.alerting`), and tests render the same rules
with short thresholds for a live Prometheus.

Thresholds are tied to the checkpoint cadence: the defaults suit the seeds' cadence of about
17 minutes (100 steps at 6 steps/min). A run that checkpoints less often needs a larger
`stale_after`, roughly three checkpoint intervals plus one upload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runner.errors import ConfigError

GROUP_NAME = "spot-runner"

_DURATION = re.compile(r"(\d+)(d|h|m|s)")
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> int:
    """Seconds in a Prometheus-style duration such as `1h30m`, `45s` or `2d`."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ConfigError(f"{text!r} is not a duration: use e.g. 90s, 30m, 1h30m or 2d")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in parts)


def format_duration(seconds: int) -> str:
    """The shortest Prometheus duration for `seconds` (3600 -> `1h`, 90 -> `1m30s`)."""
    if seconds <= 0:
        return "0s"
    out = []
    for unit in ("d", "h", "m", "s"):
        count, seconds = divmod(seconds, _UNIT_SECONDS[unit])
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Alert thresholds in seconds (docs/metrics.md explains how to choose them)."""

    stale_after: int = 3600
    """RunnerCheckpointStale: newest durable checkpoint older than this (about 3 intervals)."""
    stale_for: int = 300
    """... for this long (rides out a slow final upload)."""
    mirror_lag: int = 1800
    """RunnerCheckpointMirrorLagging: remote checkpoint this much older than the local one."""
    mirror_lag_for: int = 600
    """... for this long (the first upload of a run takes a while)."""
    failures_window: int = 900
    """RunnerCheckpointFailures: any failure within this window."""
    down_for: int = 300
    """RunnerDown: target unscrapable for this long (a container restart takes less)."""
    goodput_below: float = 0.9
    """RunnerGoodputLow: the run's goodput ratio under this ..."""
    badput_over: int = 3600
    """... once its badput adds up to more than this (a young run's startup is no alarm) ..."""
    goodput_for: int = 1800
    """... for this long."""
    job_matcher: str = 'job=~".*spot-runner.*"'
    """PromQL label matcher selecting the runner's scrape targets for RunnerDown."""

    def __post_init__(self) -> None:
        for name in (
            "stale_after",
            "stale_for",
            "mirror_lag",
            "mirror_lag_for",
            "failures_window",
            "down_for",
            "badput_over",
            "goodput_for",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"alert threshold {name} must be > 0 seconds")
        if not 0 < self.goodput_below < 1:
            raise ConfigError(
                f"alert threshold goodput_below must be a ratio between 0 and 1 "
                f"(got {self.goodput_below})"
            )
        if not re.fullmatch(r'[a-zA-Z_]\w*\s*(=|!=|=~|!~)\s*"[^"]*"', self.job_matcher):
            raise ConfigError(
                f"job matcher {self.job_matcher!r} is not a PromQL label matcher; "
                'write e.g. job="spot-runner" or job=~".*spot-runner.*"'
            )


@dataclass(frozen=True, kw_only=True)
class AlertRule:
    name: str
    expr: str
    for_seconds: int
    severity: str
    summary: str
    description: str


def alert_rules(t: Thresholds) -> list[AlertRule]:
    """The five alerts of DESIGN.md with the given thresholds. Long: one table of rules, read top to
    bottom."""
    d = {
        "stale_after": format_duration(t.stale_after),
        "mirror_lag": format_duration(t.mirror_lag),
        "failures_window": format_duration(t.failures_window),
        "down_for": format_duration(t.down_for),
        "badput_over": format_duration(t.badput_over),
    }
    return [
        AlertRule(
            name="RunnerCheckpointStale",
            # Remote age when the run has a mirror; local age for a run without one (its
            # metrics have no remote series).
            expr=(
                f'runner_checkpoint_age_seconds{{location="remote"}} > {t.stale_after}\n'
                f'or (runner_checkpoint_age_seconds{{location="local"}} > {t.stale_after}\n'
                '    unless ignoring (location) runner_checkpoint_age_seconds{location="remote"})'
            ),
            for_seconds=t.stale_for,
            severity="critical",
            summary=(
                "{{ $labels.job }} {{ $labels.instance }}: no {{ $labels.location }} checkpoint "
                "for {{ $value | humanizeDuration }}"
            ),
            description=(
                "The newest durable ({{ $labels.location }}) checkpoint of this run is older "
                f"than {d['stale_after']} (about three checkpoint intervals). If the node is "
                "preempted now, all training since that checkpoint is lost.\n"
                "Check: is the step advancing (runner_train_step)? Which stage fails "
                "(runner_checkpoint_failures_total by stage, and the runner log)? Which "
                "checkpoint is newest and verified (`runner status RUN_DIR_OR_MIRROR_URI`)?\n"
                "Act: step not advancing = the trainer is hung: stop it (kubectl delete pod, "
                "docker stop) and it restarts from the newest checkpoint. Saves or uploads "
                "failing = fix disk space, bucket credentials or endpoint, then send SIGUSR1 "
                "to the runner to checkpoint at once. If the run simply checkpoints less often "
                "than this, regenerate the rules with a larger --stale-after."
            ),
        ),
        AlertRule(
            name="RunnerCheckpointMirrorLagging",
            expr=(
                'runner_checkpoint_age_seconds{location="remote"}\n'
                '- ignoring (location) runner_checkpoint_age_seconds{location="local"}\n'
                f"> {t.mirror_lag}"
            ),
            for_seconds=t.mirror_lag_for,
            severity="warning",
            summary=(
                "{{ $labels.job }} {{ $labels.instance }}: the mirror is "
                "{{ $value | humanizeDuration }} behind the local checkpoints"
            ),
            description=(
                "Checkpoints are committed on the node but are not reaching object storage: "
                f"the remote copy is more than {d['mirror_lag']} older than the local one. Local "
                "checkpoints die with a spot node; only the remote copy survives a "
                "preemption.\n"
                'Check: runner_checkpoint_failures_total{stage="upload"} and the runner log '
                "for storage errors (credentials, endpoint, bucket policy, quota); "
                "runner_checkpoint_upload_duration_seconds for uploads slower than the "
                "checkpoint interval.\n"
                "Act: fix bucket access; the runner keeps retrying and mirrors the newest "
                "checkpoint by itself. If uploads are merely slow, checkpoint less often or "
                "use a bucket closer to the nodes."
            ),
        ),
        AlertRule(
            name="RunnerCheckpointFailures",
            expr=f"increase(runner_checkpoint_failures_total[{d['failures_window']}]) > 0",
            for_seconds=0,
            severity="warning",
            summary=(
                "{{ $labels.job }} {{ $labels.instance }}: checkpoint {{ $labels.stage }} "
                "is failing"
            ),
            description=(
                "Checkpoint stage {{ $labels.stage }} failed within the last "
                f"{d['failures_window']}. save: the local write failed (disk full, permissions). "
                "upload: object storage refused or timed out (retried, but the durable copy "
                "is late). verify: a checkpoint does not match its manifest (corruption). "
                "restore: resuming had to skip a bad checkpoint. loss_log: an append to "
                "loss.jsonl failed (disk full; held in memory, training goes on).\n"
                "Check: the runner log around the failure for the error; `runner verify "
                "LOCATION` for verify and restore failures; free space in the run dir for "
                "save and loss_log failures.\n"
                "Act: fix the cause the log names. Upload failures that the retries absorb "
                "need no action; if they persist, RunnerCheckpointMirrorLagging and "
                "RunnerCheckpointStale follow."
            ),
        ),
        AlertRule(
            name="RunnerDown",
            expr=f"up{{{t.job_matcher}}} == 0",
            for_seconds=t.down_for,
            severity="critical",
            summary="{{ $labels.job }} {{ $labels.instance }}: runner is down",
            description=(
                f"Prometheus has not scraped this runner for {d['down_for']} while its target is "
                "still registered (the pod still exists, or the VM is still a configured "
                "target). A dead runner writes no checkpoints, and its checkpoint-age alerts "
                "go silent with it.\n"
                "Check: `kubectl describe pod` and `kubectl logs --previous`, or `systemctl "
                "status` and `docker ps -a` on the VM. Exit code 75 = preempted after its "
                "final checkpoint (it should be started again), 2 = configuration error, "
                "3 = corrupt checkpoint (`runner verify`).\n"
                "Act: restart or reschedule the job; it resumes from the newest verified "
                "checkpoint. If the run has finished (exit 0), remove the scrape target."
            ),
        ),
        AlertRule(
            name="RunnerGoodputLow",
            # the ratio counts every attempt of the run (its attempt records), so a new pod
            # carries the history on; the badput floor keeps a young run's startup quiet
            expr=(
                f"runner_goodput_ratio < {t.goodput_below:g}\n"
                "and on (job, instance)\n"
                f"sum by (job, instance) (runner_badput_seconds_total) > {t.badput_over}"
            ),
            for_seconds=t.goodput_for,
            severity="warning",
            summary=(
                "{{ $labels.job }} {{ $labels.instance }}: goodput "
                "{{ $value | humanizePercentage }} of the run's time"
            ),
            description=(
                f"Less than {t.goodput_below:.0%} of this run's wall time (every attempt so "
                f"far) trained steps that survive, and over {d['badput_over']} went elsewhere: "
                "the spot discount is being spent on restarts, lost steps or waiting.\n"
                "Check: `runner goodput RUN_DIR_OR_MIRROR_URI` names the badput: "
                "wasted_progress (failures without notice lose the steps since the last "
                "checkpoint), between_attempts (waiting for capacity or a new node), startup "
                "and restore (image pull, download), checkpoint_stall (saves on the loop).\n"
                "Act: wasted_progress = checkpoint more often (--ckpt-every-seconds auto "
                "chooses from the measured cost and failure rate); between_attempts = another "
                "zone or instance type, or a capacity reservation; startup or restore = a "
                "smaller image, a bucket in the same region; checkpoint_stall = --save-mode "
                "async."
            ),
        ),
    ]
