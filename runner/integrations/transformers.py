"""spot-runner for a Hugging Face `transformers.Trainer`, in three lines and one import:

    from runner.integrations.transformers import RunConfig, SpotRunnerCallback, exit_process

    spot = SpotRunnerCallback(RunConfig(run_dir="runs/hf", mirror="s3://bucket/hf"))
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[spot])
    trainer.train(resume_from_checkpoint=spot.resume_from)   # newest verified, or None
    exit_process(spot.exit_code)                             # 0 done, 75 stopped

What it adds to the Trainer (runner.integrations.spot): SIGTERM, SIGINT and cloud notices
become a stop that every rank agrees on at one step end (`should_save`, then
`should_training_stop`); each `checkpoint-N/` the Trainer writes, once every rank wrote its
part, is committed as a `files` checkpoint (sha256 of every file), mirrored and pruned; the
newest one that verifies, in the run dir or the mirror, is put back into `output_dir` before
training so that the Trainer's own resume reads it. The Trainer's files keep their format.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from runner.config import RunConfig
from runner.errors import ConfigError
from runner.integrations.spot import SpotRun, run_or_exit
from runner.preemption.exiting import exit_process
from runner.preemption.stop import StopController
from runner.state.fingerprint import fingerprint_state

# what a script needs beside the callback, from one import line
__all__ = ["RunConfig", "SpotRunnerCallback", "exit_process"]

log = logging.getLogger(__name__)


class SpotRunnerCallback(TrainerCallback):
    """Pass it in `callbacks=[...]`; read `resume_from` once the Trainer is built and
    `exit_code` once `train()` returned."""

    def __init__(self, config: RunConfig, *, stop: StopController | None = None) -> None:
        """Signal handlers, the run dir's lock, metrics and the mirror start here: create it
        first thing in the script (before the model loads) so that a SIGTERM is never
        missed. `stop`: a controller whose handlers the script installed itself."""
        self.spot = run_or_exit(lambda: SpotRun(config, integration="transformers", stop=stop))
        self._resume_from: Path | None = None
        self._built = False

    @property
    def resume_from(self) -> str | None:
        """The checkpoint directory to pass to `train(resume_from_checkpoint=...)`: the
        newest that verified, restored into `output_dir`; None to start from scratch."""
        if not self._built:
            raise ConfigError(
                "SpotRunnerCallback.resume_from is known once the Trainer is built: create "
                "the Trainer with callbacks=[spot] first"
            )
        return str(self._resume_from) if self._resume_from is not None else None

    @property
    def exit_code(self) -> int:
        """0 finished (final checkpoint mirrored), 75 stopped with its checkpoint committed,
        1 otherwise; ask once `train()` returned."""
        if self.spot.exit_code is None:
            raise ConfigError("SpotRunnerCallback.exit_code is known once trainer.train() ended")
        return self.spot.exit_code

    # -- the Trainer's events (every rank) ----------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        self._resume_from = run_or_exit(lambda: self.spot.resume(_output_dir(args)), self.spot)
        self._built = True
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        stop, save = run_or_exit(lambda: self.spot.step_ended(state.global_step), self.spot)
        if save:
            control.should_save = True
        if stop:
            control.should_training_stop = True
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        step = state.global_step
        path = _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        final = state.max_steps > 0 and step >= state.max_steps
        model = kw.get("model")
        weights = None if model is None else lambda: fingerprint_state(model.state_dict(), None)
        run_or_exit(
            lambda: self.spot.saved(path, step, final=final, fingerprint=weights), self.spot
        )
        return control

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        # the loss HF reports every `logging_steps` (the mean since the last report)
        logs = kw.get("logs") or {}
        if isinstance(logs.get("loss"), int | float):
            self.spot.log_loss(state.global_step, float(logs["loss"]))
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        finished = state.max_steps > 0 and state.global_step >= state.max_steps
        run_or_exit(lambda: self.spot.end(finished=finished), self.spot)
        return control


def _output_dir(args: TrainingArguments) -> Path:
    return Path(args.output_dir or ".")
