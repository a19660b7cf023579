"""Click options defined once and shared by every command that takes them.

Every option is also read from `RUNNER_<OPTION>` (DESIGN.md, CLI). The options of a RunConfig
field take their default from RunConfig and leave their checks to it (one ConfigError, exit 2):
`config_from_options` builds the config of `runner demo` and `runner run` alike. Where `--help`
shows a choice or a range, the click type says it too, built from RunConfig's constants (click's
usual "Invalid value" error, shell completion); RunConfig checks the same values again for the
in-process API."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from runner.config import MAXIMA, NOTICE_SOURCES, SAVE_MODES, RunConfig
from runner.storage.limits import (
    DEFAULT_STORE_TIMEOUT_S,
    MAX_STORE_TIMEOUT_S,
    MIN_STORE_TIMEOUT_S,
)

F = TypeVar("F", bound=Callable[..., Any])


def _require_finite(
    param_type: click.ParamType,
    value: float,
    raw: Any,
    param: click.Parameter | None,
    ctx: click.Context | None,
) -> float:
    # float("nan") and float("inf") parse, and nan passes every `x > 0` check after it
    if not math.isfinite(value):
        param_type.fail(f"{raw!r} is not a finite number", param, ctx)
    return value


class FiniteFloat(click.types.FloatParamType):
    """A float that is not nan or +-inf."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return _require_finite(self, super().convert(value, param, ctx), value, param, ctx)


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also rejects nan (which no range comparison catches) and inf."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return _require_finite(self, super().convert(value, param, ctx), value, param, ctx)


FINITE_FLOAT = FiniteFloat()


def finite_float_type(param_type: click.ParamType) -> click.ParamType:
    """The finite version of click's float types; any other type unchanged. Applied to every
    option of every command by `cli.main.with_env_defaults`, so no float option can forget it."""
    if type(param_type) is click.FloatRange:
        return FiniteFloatRange(
            param_type.min,
            param_type.max,
            min_open=param_type.min_open,
            max_open=param_type.max_open,
            clamp=param_type.clamp,
        )
    if type(param_type) is click.types.FloatParamType:
        return FINITE_FLOAT
    return param_type


def _opt(*names: str, env: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*names, envvar=env, show_envvar=True, show_default=True, **kwargs)


run_dir = _opt(
    "--run-dir",
    env="RUNNER_RUN_DIR",
    type=click.Path(file_okay=False),
    default="runs/demo",
    help="Local run directory (checkpoints/, loss.jsonl).",
)
mirror = _opt(
    "--mirror",
    env="RUNNER_MIRROR",
    default=RunConfig.default("mirror"),
    help="Mirror checkpoints to s3://bucket/prefix, file:///abs/path or a directory path.",
)
steps = _opt(
    "--steps",
    env="RUNNER_STEPS",
    type=int,
    default=RunConfig.default("steps"),
    help="Total optimizer steps of the run.",
)
ckpt_every = _opt(
    "--ckpt-every",
    env="RUNNER_CKPT_EVERY",
    type=int,
    default=RunConfig.default("ckpt_every"),
    help="Checkpoint every N steps (0 disables).",
)


class SecondsOrAuto(click.ParamType):
    """A finite number of seconds, or `auto`."""

    name = "SECONDS|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        return FINITE_FLOAT.convert(value, param, ctx)


AUTO = "auto"
ckpt_every_seconds = _opt(
    "--ckpt-every-seconds",
    env="RUNNER_CKPT_EVERY_SECONDS",
    type=SecondsOrAuto(),
    metavar="SECONDS|auto",
    default=RunConfig.default("ckpt_every_seconds"),
    help="Also checkpoint every T seconds, whichever first; `auto`: T = √(2·C·M) from the "
    "measured cost C of one checkpoint and the run's mean time M between failures without "
    "notice (--mtbf until it has seen some), re-chosen at each checkpoint.",
)
mtbf = _opt(
    "--mtbf",
    env="RUNNER_MTBF",
    type=click.FloatRange(min=0, min_open=True, max=MAXIMA["mtbf"]),
    default=RunConfig.default("mtbf"),
    help="--ckpt-every-seconds auto: the prior mean time between failures without notice, "
    "in seconds (the run's own failures take over as it sees them).",
)
keep = _opt(
    "--keep",
    env="RUNNER_KEEP",
    type=int,
    default=RunConfig.default("keep"),
    help="Checkpoints kept locally and remotely (>= 2).",
)
grace_seconds = _opt(
    "--grace-seconds",
    env="RUNNER_GRACE_SECONDS",
    type=FINITE_FLOAT,
    default=RunConfig.default("grace_seconds"),
    help="Budget from SIGTERM to exit for the final checkpoint and upload.",
)
save_mode = _opt(
    "--save-mode",
    env="RUNNER_SAVE_MODE",
    type=click.Choice(SAVE_MODES),
    default=RunConfig.default("save_mode"),
    help="async: a checkpoint blocks training only to copy the state into host memory "
    "(as much again as the state), then is written in the background; sync: training waits "
    "for the whole save.",
)
collective_timeout = _opt(
    "--collective-timeout",
    env="RUNNER_COLLECTIVE_TIMEOUT",
    type=FINITE_FLOAT,
    default=RunConfig.default("collective_timeout"),
    help="Under torchrun: seconds a rank waits for the others in a collective before exit 1.",
)
metrics_port = _opt(
    "--metrics-port",
    env="RUNNER_METRICS_PORT",
    type=int,
    default=RunConfig.default("metrics_port"),
    help="Serve /metrics and /healthz on this port (0 disables).",
)
metrics_host = _opt(
    "--metrics-host",
    env="RUNNER_METRICS_HOST",
    default=RunConfig.default("metrics_host"),
    help="Address the metrics server binds: 0.0.0.0 every IPv4 interface (what a Prometheus "
    "scraping the pod IP needs), 127.0.0.1 this machine only, :: or ::1 for IPv6.",
)
notices = _opt(
    "--notices",
    env="RUNNER_NOTICES",
    default=RunConfig.default("notices"),
    type=click.Choice(NOTICE_SOURCES),
    help="Poll a cloud's preemption notice endpoint.",
)
notice_poll_seconds = _opt(
    "--notice-poll-seconds",
    env="RUNNER_NOTICE_POLL_SECONDS",
    type=FINITE_FLOAT,
    default=RunConfig.default("notice_poll_seconds"),
    help="Interval between preemption notice polls.",
)
notice_endpoint = _opt(
    "--notice-endpoint",
    env="RUNNER_NOTICE_ENDPOINT",
    default=RunConfig.default("notice_endpoint"),
    help="Override the metadata server base URL.",
)
max_restarts = _opt(
    "--max-restarts",
    env="RUNNER_MAX_RESTARTS",
    type=int,
    default=RunConfig.default("max_restarts"),
    help="Crashes restarted with backoff before giving up.",
)
restart_backoff = _opt(
    "--restart-backoff",
    env="RUNNER_RESTART_BACKOFF",
    # no min: a negative backoff is RunConfig's ConfigError, as it was before the range showed
    type=click.FloatRange(max=MAXIMA["restart_backoff"]),
    default=RunConfig.default("restart_backoff"),
    help="First delay before restarting a crashed trainer, doubled each time (max 60 s).",
)


STORE_TIMEOUT_HELP = (
    "Give up on a store call (S3) that keeps failing or never answers for this long; "
    "a transfer that keeps moving bytes is never cut."
)


def _apply_store_timeout(ctx: click.Context, param: click.Parameter, value: float) -> float:
    from runner.storage import set_store_timeout  # no boto3: that loads with s3:// only

    set_store_timeout(value, give_up_once=True)
    ctx.call_on_close(lambda: set_store_timeout(None))  # embedding, tests: no leftover
    return value


store_timeout = _opt(
    "--store-timeout",
    env="RUNNER_STORE_TIMEOUT",
    type=click.FloatRange(min=MIN_STORE_TIMEOUT_S, max=MAX_STORE_TIMEOUT_S),
    default=DEFAULT_STORE_TIMEOUT_S,
    callback=_apply_store_timeout,
    expose_value=False,
    is_eager=True,
    metavar="SECONDS",
    help=STORE_TIMEOUT_HELP,
)
"""For the one-shot commands that talk to a store (ls, verify, pull, ...): the command stops
at its first store call that gave up. The value reaches every location the command opens."""
training_store_timeout = _opt(
    "--store-timeout",
    env="RUNNER_STORE_TIMEOUT",
    type=click.FloatRange(min=MIN_STORE_TIMEOUT_S, max=MAXIMA["store_timeout"]),
    default=RunConfig.default("store_timeout"),
    metavar="SECONDS",
    help=STORE_TIMEOUT_HELP,
)
"""For `runner demo` and `runner run` (in run_options): RunConfig.store_timeout (its range
checked by click, as the one-shot option's, and by RunConfig); their mirror keeps trying later
uploads after a call gave up (hours of training)."""

STEP = click.IntRange(min=0)
"""A checkpoint step (`--step N`): step 0 is the state before the first update."""

seed = _opt(
    "--seed",
    env="RUNNER_SEED",
    type=int,
    default=RunConfig.default("seed"),
    help="Random seed of the run.",
)
fresh_start = _opt(
    "--fresh-start",
    env="RUNNER_FRESH_START",
    is_flag=True,
    default=RunConfig.default("fresh_start"),
    help=(
        "When checkpoints exist but none can be resumed from, move them to RUN_DIR/aside/ "
        "(kept) and start at step 0 instead of refusing with exit 3. Ignored while a usable "
        "checkpoint exists."
    ),
)
adopt = _opt(
    "--adopt",
    env="RUNNER_ADOPT",
    multiple=True,
    default=RunConfig.default("adopt"),
    metavar="PATTERN",
    help="Adopt the checkpoints the trainer writes itself: a glob relative to its working "
    "directory matching files or directories whose name holds the step (repeatable; "
    "RUNNER_ADOPT takes several separated by spaces), e.g. 'out/checkpoint-*'.",
)
adopt_quiet_seconds = _opt(
    "--adopt-quiet-seconds",
    env="RUNNER_ADOPT_QUIET_SECONDS",
    type=click.FloatRange(min=0, max=MAXIMA["adopt_quiet_seconds"]),
    default=RunConfig.default("adopt_quiet_seconds"),
    help="An --adopt match written in place is taken once nothing in it changed for this "
    "long and no process has a file of it open for writing.",
)
attempt_id = _opt(
    "--attempt-id",
    env="RUNNER_ATTEMPT_ID",
    hidden=True,  # set by `runner run` for its trainer, not by a person
    default=None,
    help="The attempt record this trainer appends to.",
)
json_output = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def run_options(func: F) -> F:
    """The options shared by `runner demo` and `runner run`."""
    for decorator in reversed(
        [
            run_dir,
            mirror,
            steps,
            ckpt_every,
            ckpt_every_seconds,
            mtbf,
            keep,
            grace_seconds,
            save_mode,
            metrics_port,
            metrics_host,
            notices,
            notice_poll_seconds,
            notice_endpoint,
            seed,
            fresh_start,
            training_store_timeout,
            attempt_id,
        ]
    ):
        func = decorator(func)
    return func


def config_from_options(**params: Any) -> RunConfig:
    """The RunConfig of `runner demo` and `runner run` from their option values (keys that are
    no RunConfig field are the command's own, left out); RunConfig checks every value."""
    names = {f.name for f in dataclasses.fields(RunConfig)}
    if params.get("ckpt_every_seconds") == AUTO:
        params = {**params, "ckpt_every_seconds": None, "ckpt_every_seconds_auto": True}
    return RunConfig(**{k: v for k, v in params.items() if k in names and v is not None})
