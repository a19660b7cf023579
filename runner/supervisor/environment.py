"""The trainer's environment (the README lists these variables): the supervisor's own minus
what only the supervisor runs, plus where to write and what to resume from."""

from __future__ import annotations

import os
from pathlib import Path

from runner.checkpoint.resume_point import ResumePoint
from runner.config import RunConfig
from runner.runtime.runlock import RunDirLock
from runner.supervisor.adopt import payload_path

ENV_RUN_DIR = "RUNNER_RUN_DIR"
ENV_CKPT_DIR = "RUNNER_CKPT_DIR"
ENV_RESUME_FROM = "RUNNER_RESUME_FROM"
# The manifest's format (seed-bin, torch-state, torch-chunked, files): a trainer checks it before
# parsing RUNNER_RESUME_FROM, so a payload it cannot read is refused, not misread.
ENV_RESUME_FORMAT = "RUNNER_RESUME_FORMAT"
ENV_RESUME_STEP = "RUNNER_RESUME_STEP"
ENV_ATTEMPT = "RUNNER_ATTEMPT"
ENV_MIRROR = "RUNNER_MIRROR"
SUPERVISOR_ONLY_ENV = frozenset(
    {ENV_MIRROR, "RUNNER_METRICS_PORT", "RUNNER_NOTICES", "RUNNER_NOTICE_ENDPOINT"}
)


def child_env(
    config: RunConfig,
    *,
    run_dir: Path,
    ckpt_dir: Path,
    resume: ResumePoint[None] | None,
    attempt: int,
    run_lock: RunDirLock | None,
    mirror: str | None = None,
    resume_path: Path | None = None,
) -> dict[str, str]:
    """The environment of attempt number `attempt`, resuming from `resume` (None: scratch);
    `mirror`: the RUNNER_MIRROR its ranks commit in themselves (one node of several);
    `resume_path`: where the checkpoint was put back for it (--adopt), else its payload."""
    # The supervisor owns the mirror, the metrics port and the notice poller: a child
    # that is itself a runner (`runner run -- runner demo`) must not start its own.
    env = {k: v for k, v in os.environ.items() if k not in SUPERVISOR_ONLY_ENV}
    if mirror is not None:  # on several nodes the ranks own the mirror (multinode.py)
        env[ENV_MIRROR] = mirror
    # Training settings given on the command line reach a runner child as well.
    for name, value in (
        ("RUNNER_STEPS", config.steps),
        ("RUNNER_CKPT_EVERY", config.ckpt_every),
        (
            "RUNNER_CKPT_EVERY_SECONDS",
            "auto" if config.ckpt_every_seconds_auto else config.ckpt_every_seconds,
        ),
        ("RUNNER_MTBF", config.mtbf),
        ("RUNNER_KEEP", config.keep),
        ("RUNNER_GRACE_SECONDS", config.grace_seconds),
        ("RUNNER_SEED", config.seed),
        ("RUNNER_SAVE_MODE", config.save_mode),
    ):
        if value is not None:
            env[name] = str(value)
    env[ENV_RUN_DIR] = str(run_dir)
    env[ENV_CKPT_DIR] = str(ckpt_dir)
    if resume is None:
        env[ENV_RESUME_FROM] = ""
    else:
        env[ENV_RESUME_FROM] = str(resume_path or payload_path(resume.step_dir, resume.manifest))
    env[ENV_RESUME_FORMAT] = resume.manifest.format if resume else ""
    env[ENV_RESUME_STEP] = str(resume.step) if resume else ""
    env[ENV_ATTEMPT] = str(attempt)
    if run_lock is not None:
        env.update(run_lock.child_env())
    return env
