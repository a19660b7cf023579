"""`runner drill -- CMD ...`: the resume audit of any script built on `TrainSession` or an
integration.

CMD runs three times, each copy in a fresh working directory of its own (a relative run dir
lands there; the drill finds it by its checkpoints) and without `RUNNER_MIRROR`: straight to
the end; then with SIGTERM at a random step between its first committed checkpoint and the
end (it must exit 75); then the same command again, which resumes from that checkpoint and
finishes. The final fingerprints and the loss histories, step by step, say whether the resume
was exact; if not, the first step that differs and what usually causes it there.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runner.audit.outcome import RunOutcome, differing_steps, outcome
from runner.checkpoint.layout import CHECKPOINTS_DIR, MANIFEST_NAME
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.loss_log import LossLog
from runner.errors import EXIT_OK, EXIT_PREEMPTED, ConfigError, RunnerError
from runner.storage.file import FileStorage

RUN_TIMEOUT_SECONDS = 3600.0
POLL_SECONDS = 0.02
# how deep under a copy's working directory its run dir may be (runs/exp1 is 2)
SEARCH_DEPTH = 4


class DrillError(RunnerError):
    """A copy of the command did not run as the audit needs (exit 1, with its output)."""


@dataclass(frozen=True, kw_only=True)
class ScriptDrill:
    command: list[str]
    seed: int
    stop_at: int
    """The step the SIGTERM was sent at (the loss log had reached it)."""
    resumed_from: int
    """The final checkpoint of the interrupted copy: where the third one resumed."""
    straight: RunOutcome
    resumed: RunOutcome

    @property
    def differing(self) -> list[int]:
        return differing_steps(self.straight.losses, self.resumed.losses)

    @property
    def exact(self) -> bool:
        return self.straight.fingerprint == self.resumed.fingerprint and not self.differing

    def causes(self) -> str:
        """What usually makes a resume differ where this one did."""
        first = self.differing[0] if self.differing else None
        if first is not None and first <= self.resumed_from + 1:
            return (
                "the first step after the resume already differs: something that step uses is "
                "not in the checkpoint. A batch fetched before the stop (put its holder in "
                "ModuleTrainState(extra={'batch': holder})), a torch.Generator of your own "
                "(extra={'gen': g}), a data order not from ResumableSampler, or an RNG "
                "reseeded after the session restored (Hugging Face's Trainer calls set_seed() "
                "in __init__: build it before the session)"
            )
        if first is not None:
            return (
                f"the run is exact for {first - self.resumed_from - 1} steps after the resume, "
                "then diverges: state that acts later is missing (an LR schedule or optimizer "
                "built after the session restored, an EMA or GradScaler not in "
                "ModuleTrainState(extra=...), a data loader's worker seeds)"
            )
        return (
            "every loss matches but the final states differ: state that never reached the "
            "loss is missing or different (an EMA, optimizer state of a frozen parameter)"
        )


def run_script_drill(
    command: Sequence[str], *, work_dir: Path, seed: int, stop_at: int | None = None
) -> ScriptDrill:
    """The three copies of `command` under `work_dir` (straight/, stopped/), compared."""
    command = list(command)
    env = {k: v for k, v in os.environ.items() if k != "RUNNER_MIRROR"}
    straight_cwd, stopped_cwd = work_dir / "straight", work_dir / "stopped"
    for cwd in (straight_cwd, stopped_cwd):
        if cwd.exists() and any(cwd.iterdir()):
            raise ConfigError(f"{cwd} is not empty: give the drill a fresh --work-dir")
        cwd.mkdir(parents=True, exist_ok=True)
    _run_to_end(command, cwd=straight_cwd, env=env, what="the straight run")
    straight = outcome(_find_run_dir(straight_cwd))
    if not straight.fingerprint:
        # nothing to compare: a verdict of "exact" would be empty
        raise DrillError(
            f"the straight run's final checkpoint (step {straight.step}) carries no fingerprint "
            "of its state: the drill audits scripts built on TrainSession or an integration "
            "(runner.integrations), not checkpoints adopted by `runner run --adopt`"
        )
    last = max(straight.losses, default=straight.step)
    rng = random.Random(seed)
    sent_at, final_step, run_dir = _run_and_stop(
        command, cwd=stopped_cwd, env=env, pick=lambda first: _pick(rng, first, last, stop_at)
    )
    _run_to_end(command, cwd=stopped_cwd, env=env, what="the resumed run")
    return ScriptDrill(
        command=command,
        seed=seed,
        stop_at=sent_at,
        resumed_from=final_step,
        straight=straight,
        resumed=outcome(run_dir),
    )


def _pick(rng: random.Random, first: int, last: int, given: int | None) -> int:
    """The step to stop at: `given`, else one drawn between the first committed checkpoint
    and the step before the end (the copy stops at the end of the step it is in)."""
    if given is not None:
        return given
    return rng.randint(first, max(first, last - 1))


def _run_to_end(command: list[str], *, cwd: Path, env: dict[str, str], what: str) -> None:
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS
    )
    if done.returncode != EXIT_OK:
        raise DrillError(
            f"{what} ({' '.join(command)} in {cwd}) exited {done.returncode}, not 0; its "
            f"last output:\n{_tail(done.stdout + done.stderr)}"
        )


def _run_and_stop(
    command: list[str], *, cwd: Path, env: dict[str, str], pick: Callable[[int], int]
) -> tuple[int, int, Path]:
    """Start a copy, SIGTERM it once its loss log reaches the step `pick(first committed
    checkpoint's step)` returns; (that step, its final checkpoint's step, its run dir)."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    run_dir: Path | None = None
    target: int | None = None
    sent_at: int | None = None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if run_dir is None:
                run_dir = next(iter(_run_dirs(cwd)), None)
            if run_dir is not None and target is None:
                steps = list_checkpoints(FileStorage(run_dir))
                target = pick(steps[0]) if steps else None
            if run_dir is not None and target is not None:
                # how far it trained: its loss log, or its newest commit (a framework that
                # reports a loss only every `logging_steps`)
                committed = list_checkpoints(FileStorage(run_dir))
                logged = max([*LossLog(run_dir).read(), *committed[-1:]], default=0)
                if logged >= target:
                    proc.send_signal(signal.SIGTERM)
                    sent_at = logged
                    break
            time.sleep(POLL_SECONDS)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
    if sent_at is None:
        raise DrillError(
            f"the interrupted run ended (exit {code}) before the drill could stop it after a "
            f"checkpoint: give it more steps or a checkpoint sooner; its last output:\n"
            f"{_tail(''.join(output))}"
        )
    if code != EXIT_PREEMPTED:
        raise DrillError(
            f"the interrupted run exited {code} after SIGTERM at step {sent_at}, not 75: it "
            "did not stop with a final checkpoint (is its loop left through "
            f"session.should_stop?); its last output:\n{_tail(''.join(output))}"
        )
    assert run_dir is not None
    return sent_at, list_checkpoints(FileStorage(run_dir))[-1], run_dir


def _run_dirs(cwd: Path) -> list[Path]:
    """The directories under `cwd` holding committed checkpoints (at most one is allowed)."""
    found = set()
    for depth in range(SEARCH_DEPTH):
        pattern = "/".join(["*"] * depth + [CHECKPOINTS_DIR, "step_*", MANIFEST_NAME])
        found |= {manifest.parent.parent.parent for manifest in cwd.glob(pattern)}
    if len(found) > 1:
        raise DrillError(
            f"{cwd} holds several run dirs ({', '.join(str(p) for p in sorted(found))}): the "
            "drill audits a command that trains one run"
        )
    return sorted(found)


def _find_run_dir(cwd: Path) -> Path:
    found = _run_dirs(cwd)
    if not found:
        raise DrillError(
            f"the command left no checkpoint under its working directory {cwd}: the drill "
            "audits scripts built on TrainSession or an integration, with a relative run dir"
        )
    return found[0]


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines()[-lines:])


def report_text(drill: ScriptDrill) -> str:
    straight, resumed = drill.straight, drill.resumed
    lines = [
        f"straight: {len(straight.losses)} steps logged, final fingerprint "
        f"{straight.fingerprint[:16] or '(none)'}",
        f"SIGTERM at step {drill.stop_at} (seed {drill.seed}), final checkpoint step "
        f"{drill.resumed_from}, resumed in a fresh process: final fingerprint "
        f"{resumed.fingerprint[:16] or '(none)'}",
    ]
    if drill.exact:
        lines.append(f"exact: equal fingerprints, equal losses at all {len(straight.losses)} steps")
        return "\n".join(lines)
    differing = drill.differing
    if differing:
        first = differing[0]
        lines.append(
            f"NOT exact: the first differing step is {first} (loss {straight.losses.get(first)} "
            f"straight, {resumed.losses.get(first)} resumed); {len(differing)} steps differ"
        )
    else:
        lines.append("NOT exact: equal losses, different final fingerprints")
    lines.append(f"likely causes: {drill.causes()}")
    return "\n".join(lines)


def report_json(drill: ScriptDrill) -> dict[str, object]:
    return {
        "command": drill.command,
        "seed": drill.seed,
        "exact": drill.exact,
        "stopped_at": drill.stop_at,
        "resumed_from": drill.resumed_from,
        "first_differing_step": drill.differing[0] if drill.differing else None,
        "straight_fingerprint": drill.straight.fingerprint,
        "resumed_fingerprint": drill.resumed.fingerprint,
        "causes": None if drill.exact else drill.causes(),
    }
