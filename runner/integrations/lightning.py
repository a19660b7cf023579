"""spot-runner for a Lightning `lightning.pytorch.Trainer`, in three lines and one import:

    from runner.integrations.lightning import RunConfig, SpotRunnerCallback, exit_process

    spot = SpotRunnerCallback(RunConfig(run_dir="runs/pl", mirror="s3://bucket/pl"))
    trainer = pl.Trainer(..., callbacks=[spot])
    trainer.fit(model, data, ckpt_path=spot.resume_from)   # newest verified, or None
    exit_process(spot.exit_code)                           # 0 done, 75 stopped

What it adds (runner.integrations.spot): a stop agreed by every rank after one batch, that
step saved (`trainer.save_checkpoint`) and training ended (`should_stop`) in place of
Lightning's own SIGTERM handling (which raises SIGTERMException on the rank that got it);
every `.ckpt` the Trainer writes (ModelCheckpoint's and the stop's) committed as a `files`
checkpoint once written, mirrored and pruned; the newest that verifies put back under
`dirpath`. And what Lightning's checkpoint leaves out, in this callback's own state inside the
`.ckpt`: every rank's global RNG and the train loader's place in its epoch
(runner.integrations.data_position), so a resume mid-epoch is bit-exact.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from torch.utils.data import DataLoader

from runner.config import RunConfig
from runner.errors import ConfigError
from runner.integrations.data_position import Position, ResumableLoader, make_resumable
from runner.integrations.spot import SpotRun, run_or_exit
from runner.preemption.exiting import exit_process
from runner.preemption.stop import StopController
from runner.state.fingerprint import fingerprint_state
from runner.state.rng import capture_rng, restore_rng

__all__ = ["RunConfig", "SpotRunnerCallback", "exit_process"]

log = logging.getLogger(__name__)


class SpotRunnerCallback(pl.Callback):
    """Pass it in `callbacks=[...]`, read `resume_from` for `fit(ckpt_path=...)` and
    `exit_code` once `fit` returned."""

    def __init__(
        self,
        config: RunConfig,
        *,
        dirpath: str | Path = "checkpoints",
        stop: StopController | None = None,
    ) -> None:
        """Signal handlers, the run dir's lock, metrics and the mirror start here: create it
        first thing in the script. `dirpath`: where the stop's checkpoint is written and a
        resumed one put back (ModelCheckpoint's own files stay where it writes them)."""
        self.spot = run_or_exit(lambda: SpotRun(config, integration="lightning", stop=stop))
        self.dirpath = Path(dirpath)
        self._resolved = False
        self._resume_from: Path | None = None
        self._loaded: list[dict[str, Any]] | None = None  # every rank's, from the checkpoint
        self._loaders: list[ResumableLoader] = []
        self._handler: Any = None
        self._trainer: pl.Trainer | None = None

    @property
    def resume_from(self) -> str | None:
        """The checkpoint for `fit(ckpt_path=...)`: the newest that verified (run dir or
        mirror), put back under `dirpath`; None to start from scratch. Under torchrun reading
        it initialises torch.distributed (Lightning then uses that group)."""
        if not self._resolved:
            _init_process_group(self.spot)
            self._resume_from = run_or_exit(lambda: self.spot.resume(self.dirpath), self.spot)
            self._resolved = True
        return str(self._resume_from) if self._resume_from is not None else None

    @property
    def exit_code(self) -> int:
        """0 finished (final checkpoint mirrored), 75 stopped with its checkpoint committed,
        1 otherwise; ask once `fit()` returned."""
        if self.spot.exit_code is None:
            raise ConfigError("SpotRunnerCallback.exit_code is known once trainer.fit() ended")
        return self.spot.exit_code

    # -- the Trainer's hooks (every rank) -----------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        run_or_exit(self.spot.attach, self.spot)
        self._trainer = trainer
        trainer.strategy.checkpoint_io = _Committing(trainer.strategy.checkpoint_io, self)
        # the train loaders exist only inside the fit loop's data set-up, just before their
        # first iterator is made: there they learn to keep their place
        fit_loop = trainer.fit_loop
        load_states = fit_loop._load_combined_loader_states

        def with_positions() -> None:
            self._keep_positions(trainer)
            load_states()

        fit_loop._load_combined_loader_states = with_positions  # type: ignore[method-assign]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():
            self._handler = signal.getsignal(signal.SIGTERM)  # ours, before Lightning's

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back_sigterm(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back_sigterm(trainer)
        mine = self._mine()
        if mine is not None:
            restore_rng(mine["rng"])  # after the sanity check: training draws as it did

    def _take_back_sigterm(self, trainer: pl.Trainer) -> None:
        """Lightning's SIGTERM handler (set after on_fit_start) would end the run on the rank
        that got the signal (SIGTERMException, exit 0); the stop is ours, agreed after a
        batch. A SIGTERM that came meanwhile reached our handler too (Lightning chains it):
        Lightning's flag is dropped."""
        if self._handler is not None:
            signal.signal(signal.SIGTERM, self._handler)
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector.received_sigterm = False

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning's SIGTERMException is a SystemExit with code None: a stop that ends the
        # run that way (a SIGTERM before our handler was back) must not exit 0
        if isinstance(exception, SystemExit) and exception.code in (None, 0):
            code = self.spot.abandon(f"{type(exception).__name__} ended the Trainer")
            raise SystemExit(code) from exception

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        loss = _loss_of(outputs)
        stop, save = run_or_exit(lambda: self.spot.step_ended(step, loss=loss), self.spot)
        if save:
            trainer.save_checkpoint(self.dirpath / f"spot-step={step}.ckpt")
        if stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reached = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        finished = reached or self.spot.stopped_at is None
        run_or_exit(lambda: self.spot.end(finished=finished), self.spot)

    # -- this callback's state in the .ckpt (every rank's) -------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # inside trainer.save_checkpoint, which every rank calls: every rank's part gathered
        mine = {"rng": capture_rng(), "loaders": [vars(dl.position()) for dl in self._loaders]}
        return {"ranks": self.spot.group.all_gather(mine)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = list(state_dict.get("ranks", []))

    def _mine(self) -> dict[str, Any] | None:
        if not self._loaded:
            return None
        rank, ranks = self.spot.group.rank, len(self._loaded)
        if ranks != self.spot.group.world_size:
            log.warning(
                "the checkpoint holds the RNG and data position of %d rank(s), this run has %d: "
                "they are not restored, so the run is not bit-identical to an uninterrupted one",
                ranks,
                self.spot.group.world_size,
            )
            self._loaded = None
            return None
        return self._loaded[rank]

    def _keep_positions(self, trainer: pl.Trainer) -> None:
        combined = trainer.fit_loop._combined_loader
        if combined is None:
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress

        def trained() -> int:
            done = int(progress.current.processed)  # type: ignore[attr-defined]
            return 0 if done >= trainer.num_training_batches else done

        self._loaders = [
            make_resumable(dl, trained=trained)
            for dl in combined.flattened
            if isinstance(dl, DataLoader)
        ]
        mine = self._mine()
        if mine is not None:
            for dl, saved in zip(self._loaders, mine["loaders"], strict=False):
                dl.resume_at(Position(**saved))

    def committed(self, path: Path, step: int, *, fingerprint: Callable[[], str] | None) -> None:
        """Rank 0 wrote `path` (alone: Lightning's checkpoint is rank 0's)."""
        max_steps = self._trainer.max_steps if self._trainer is not None else -1
        final = 0 < max_steps <= step
        run_or_exit(
            lambda: self.spot.saved(
                path, step, final=final, every_rank=False, fingerprint=fingerprint
            ),
            self.spot,
        )


class _Committing(CheckpointIO):
    """The strategy's checkpoint IO, and a commit of each file once it is written (on the
    rank that writes it, rank 0)."""

    def __init__(self, inner: CheckpointIO, callback: SpotRunnerCallback) -> None:
        self.inner = inner
        self.callback = callback

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        weights = checkpoint.get("state_dict")
        self.callback.committed(
            Path(path),
            int(checkpoint.get("global_step", 0)),
            fingerprint=None if weights is None else lambda: fingerprint_state(weights, None),
        )

    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _loss_of(outputs: Any) -> float | None:
    """The loss `training_step` returned (a tensor, or a dict's "loss"), when it has one."""
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().item())
    return None


def _init_process_group(spot: SpotRun) -> None:
    """Under torchrun the resume is decided on rank 0 before `fit` (which would initialise
    torch.distributed itself): initialised here from torchrun's environment, the backend
    torch picks (gloo on CPU, nccl for CUDA tensors), which Lightning's DDP then takes."""
    if spot.rank.coordinated and spot.rank.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if _cuda() else "gloo")


def _cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
