"""Everything a user can set, in one object built by the CLI. Nothing else reads the
environment: the CLI maps `--option` and `RUNNER_<OPTION>` onto these fields."""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from runner.errors import ConfigError
from runner.storage.limits import (
    DEFAULT_STORE_TIMEOUT_S,
    MAX_STORE_TIMEOUT_S,
    MIN_STORE_TIMEOUT_S,
)

NOTICE_SOURCES = ("off", "auto", "aws", "gcp", "azure")
"""`--notices`: the choices of its click option and of RunConfig's check (listed once)."""

SAVE_MODES = ("async", "sync")
"""`--save-mode`: async copies the state into host memory and persists it in the background;
sync persists it on the training loop."""


def default_writer_id() -> str:
    """Identifies this process/pod/attempt in manifests (unique per process start)."""
    pod = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{pod}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_dir: Path
    """Local run directory (checkpoints/, loss.jsonl, sidecars)."""
    mirror: str | None = None
    """`s3://bucket/prefix`, `file:///abs/path` or a directory path (stored as file:///abs,
    resolved against the cwd when the config is made); None keeps checkpoints local only."""
    steps: int | None = None
    """Total optimizer steps of the run (None: the trainer decides)."""
    ckpt_every: int | None = 100
    """Save every N steps (None or 0 disables the step cadence)."""
    ckpt_every_seconds: float | None = None
    """Save every T seconds of wall clock, whichever of steps/seconds comes first."""
    ckpt_every_seconds_auto: bool = False
    """`--ckpt-every-seconds auto`: T chosen from the measured checkpoint cost and the run's
    failures without notice (runner.goodput.cadence), re-chosen at each checkpoint."""
    mtbf: float = 86_400.0
    """`auto`'s prior for the mean time between failures without notice, in seconds (one
    pseudo-observation: the run's own failures take over as they are seen)."""
    keep: int = 3
    """Committed checkpoints kept locally and in the mirror (>= 2: the newest may be in flight)."""
    grace_seconds: float = 110.0
    """Time budget from SIGTERM to exit (final step + save + upload)."""
    save_mode: str = "async"
    """One of SAVE_MODES: how a checkpoint blocks the training loop (async: only for a copy
    into reused host buffers, about the state's size in host memory; sync: the whole save)."""
    metrics_port: int = 0
    """Port for /metrics and /healthz; 0 disables the server."""
    metrics_host: str = "0.0.0.0"
    notices: str = "off"
    """Cloud preemption notice source, one of NOTICE_SOURCES."""
    notice_poll_seconds: float = 5.0
    notice_endpoint: str | None = None
    """Override the metadata endpoint base URL (tests, proxies)."""
    max_restarts: int = 3
    """Supervisor: crashes restarted with backoff before giving up."""
    restart_backoff: float = 1.0
    """Supervisor: seconds before the first restart, doubled each time (at most 60 s)."""
    store_timeout: float = DEFAULT_STORE_TIMEOUT_S
    """Seconds a store call (the s3:// mirror) keeps trying while the store fails or does not
    answer; a training run's mirror still tries its later uploads after one gave up."""
    collective_timeout: float = 300.0
    """Multi-rank runs: seconds a rank waits in a collective with the others (the step's stop
    agreement, a save, the resume) before giving up with exit 1. Bounds how long the ranks
    wait for one that hangs; one that dies is noticed at once. Longer than a save takes."""
    seed: int = 0
    fresh_start: bool = False
    """Only when checkpoints exist and none can be used: set them aside (kept) and start at
    step 0 instead of refusing (exit 3). Never discards a usable checkpoint."""
    device: str = "auto"
    adopt: tuple[str, ...] = ()
    """`runner run`: globs, relative to the trainer's working directory, of the checkpoint
    files or directories the trainer writes itself; each becomes a `files` checkpoint."""
    adopt_quiet_seconds: float = 5.0
    """`runner run --adopt`: a match written in place is finished once nothing in it changed
    for this long (and no process has a file of it open for writing)."""
    writer_id: str = field(default_factory=default_writer_id)
    attempt_id: str | None = None
    """Set by `runner run` for its trainer (RUNNER_ATTEMPT_ID): the attempt record the
    trainer appends to (runner.goodput.records); None: the process starts an attempt of its
    own."""

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field `name`: the CLI's options take theirs from here, so a default
        lives once."""
        for f in fields(cls):
            if f.name == name and f.default is not MISSING:
                return f.default
        raise KeyError(f"RunConfig.{name} has no plain default")

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        # checked in this order, so that the first bad setting is the one reported
        _check_finite(self)
        _check_bounds(self)
        _check_checkpointing(self)
        _check_metrics_and_notices(self)
        _check_recovery(self)
        self.adopt = tuple(self.adopt)
        _check_adopt(self)
        if self.mirror is not None:
            self.mirror = _mirror_of(self.mirror, run_dir=self.run_dir)
        if self.notice_endpoint is not None:
            _check_endpoint(self.notice_endpoint)


def _check_finite(config: RunConfig) -> None:
    for f in fields(config):
        value = getattr(config, f.name)
        # nan passes every `> 0` check that follows, and inf turns deadlines and cadences
        # into never; neither is a meaningful setting
        if isinstance(value, float) and not math.isfinite(value):
            option = f"--{f.name.replace('_', '-')}"
            raise ConfigError(f"{option} must be a finite number (got {value})")


def _check_checkpointing(config: RunConfig) -> None:
    """How long the run is, when it saves, what it keeps and the time a stop has to save."""
    if config.keep < 2:
        raise ConfigError(
            f"--keep must be >= 2 (got {config.keep}): the newest checkpoint may still be in flight"
        )
    if config.steps is not None and config.steps < 1:
        raise ConfigError(f"--steps must be >= 1 (got {config.steps})")
    if config.ckpt_every is not None and config.ckpt_every < 0:
        raise ConfigError(f"--ckpt-every must be >= 0 (got {config.ckpt_every})")
    if config.ckpt_every_seconds is not None and config.ckpt_every_seconds <= 0:
        raise ConfigError("--ckpt-every-seconds must be > 0 (or auto)")
    if config.ckpt_every_seconds_auto and config.ckpt_every_seconds is not None:
        raise ConfigError("--ckpt-every-seconds is either auto or a number of seconds, not both")
    if config.mtbf <= 0:
        raise ConfigError(f"--mtbf must be > 0 seconds (got {config.mtbf})")
    if config.grace_seconds <= 0:
        raise ConfigError("--grace-seconds must be > 0")


def _check_metrics_and_notices(config: RunConfig) -> None:
    """The metrics server, the save mode and the preemption notices."""
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be 0..65535 (got {config.metrics_port})")
    if config.save_mode not in SAVE_MODES:
        raise ConfigError(f"--save-mode must be one of {', '.join(SAVE_MODES)}")
    if config.notices not in NOTICE_SOURCES:
        raise ConfigError(f"--notices must be one of {', '.join(NOTICE_SOURCES)}")
    if config.notice_poll_seconds <= 0:
        raise ConfigError("--notice-poll-seconds must be > 0")


def _check_recovery(config: RunConfig) -> None:
    """Restarts, the timeouts of stores and collectives, and the seed."""
    if config.max_restarts < 0:
        raise ConfigError("--max-restarts must be >= 0")
    if config.restart_backoff < 0:
        raise ConfigError(f"--restart-backoff must be >= 0 (got {config.restart_backoff})")
    if config.collective_timeout <= 0:
        raise ConfigError(
            f"--collective-timeout must be > 0 (got {_number(config.collective_timeout)})"
        )
    if config.store_timeout < MIN_STORE_TIMEOUT_S:
        raise ConfigError(
            f"--store-timeout must be >= {_number(MIN_STORE_TIMEOUT_S)} "
            f"(got {_number(config.store_timeout)})"
        )
    # torch.manual_seed's range; beyond it the seeding raises deep inside the job
    if not -(1 << 63) <= config.seed < (1 << 64):
        raise ConfigError(f"--seed must fit in 64 bits (got {config.seed})")


def _check_adopt(config: RunConfig) -> None:
    """--adopt patterns name the trainer's files, relative to its working directory, and
    never the runner's own checkpoints."""
    if config.adopt_quiet_seconds < 0:
        raise ConfigError(
            f"--adopt-quiet-seconds must be >= 0 (got {_number(config.adopt_quiet_seconds)})"
        )
    run_dir = os.path.realpath(config.run_dir)
    for pattern in config.adopt:
        parts = Path(pattern).parts
        if not pattern or Path(pattern).is_absolute() or ".." in parts:
            raise ConfigError(
                f"--adopt {pattern!r}: give a glob relative to the trainer's working directory "
                "without '..' (e.g. 'out/checkpoint-*'); its checkpoints are restored there"
            )
        inside = os.path.realpath(Path(*_literal_prefix(parts)) if _literal_prefix(parts) else ".")
        if inside == run_dir or inside.startswith(run_dir + os.sep):
            raise ConfigError(
                f"--adopt {pattern!r} reaches into the run dir {config.run_dir}: the runner's "
                "own copies are there; have the trainer write its checkpoints elsewhere"
            )


def _literal_prefix(parts: tuple[str, ...]) -> list[str]:
    """The leading parts of a glob without a wildcard in them."""
    prefix: list[str] = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        prefix.append(part)
    return prefix


def _mirror_of(mirror: str, *, run_dir: Path) -> str:
    """--mirror as a URI; ConfigError when it names the run dir itself."""
    from runner.storage import mirror_uri  # light: boto3 loads only for s3://

    uri = mirror_uri(mirror)
    # resolved, not compared as text: a symlink to the run dir or `..` in a file://
    # URI names the same directory, which cannot be its own copy
    local = uri.removeprefix("file://")
    if local != uri and os.path.realpath(local) == os.path.realpath(run_dir):
        raise ConfigError(f"--mirror {uri} is the run dir itself: give another directory")
    return uri


# Upper bounds of numeric settings: far beyond any real use, low enough that nothing
# overflows later (a thread join or sleep takes at most threading.TIMEOUT_MAX, ~9.2e9 s on
# Linux; step counters are int64 in torch and in manifests' readers).
INT64_MAX = (1 << 63) - 1
MAXIMA: dict[str, float] = {
    "steps": INT64_MAX,
    "ckpt_every": INT64_MAX,
    "ckpt_every_seconds": 30 * 86_400.0,  # a month
    "mtbf": 3_650 * 86_400.0,  # ten years
    "keep": 1_000_000,
    "grace_seconds": 86_400.0,  # a day; Kubernetes and clouds give minutes
    "notice_poll_seconds": 3_600.0,
    "max_restarts": 1_000,  # each restart doubles a backoff: 2.0**1000 is still a float
    "restart_backoff": 3_600.0,
    "store_timeout": MAX_STORE_TIMEOUT_S,
    "collective_timeout": 86_400.0,
    "adopt_quiet_seconds": 86_400.0,
}


def _check_bounds(config: RunConfig) -> None:
    for name, maximum in MAXIMA.items():
        value = getattr(config, name)
        if value is not None and value > maximum:
            option = f"--{name.replace('_', '-')}"
            raise ConfigError(f"{option} must be <= {_number(maximum)} (got {_number(value)})")


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _check_endpoint(url: str) -> None:
    """Fail at start-up, not in the poller thread where a bad URL would only switch notices
    off with a log line."""
    from runner.storage.endpoint import usable_http_url  # light: no boto3
    from runner.storage.redact import redact_url

    if not usable_http_url(url):
        raise ConfigError(
            f"--notice-endpoint {redact_url(url)!r}: give the metadata server's base URL, "
            "http://HOST[:PORT] or https://HOST[:PORT] (e.g. http://169.254.169.254)"
        )
