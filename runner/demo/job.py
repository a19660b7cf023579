"""`runner demo`: the built-in job wired to the runner (signals, notices, metrics, mirror)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from runner.checkpoint.listing import local_step_dir, read_manifest_dir
from runner.checkpoint.manifest import created_at_unix
from runner.collective.group import peer_lost
from runner.config import RunConfig
from runner.demo.components import DemoComponents, build_demo
from runner.demo.display import ProgressDisplay
from runner.demo.launch import gather_from_ranks, process_group
from runner.errors import RunnerError
from runner.preemption.signals import install_signal_handlers
from runner.preemption.stop import StopController
from runner.runtime.rank import SINGLE_PROCESS, RankContext
from runner.session.coordination import refuse_differing, settings_of
from runner.session.train_session import TrainSession

log = logging.getLogger(__name__)

DEFAULT_DEMO_STEPS = 200


def run_demo(
    config: RunConfig,
    *,
    batch_size: int,
    progress: bool | None,
    threads: int | None = None,
    supervised: bool = False,
    rank: RankContext = SINGLE_PROCESS,
    sample_log: Path | None = None,
    parallel: str = "ddp",
) -> int:
    """Train the demo model to `config.steps`, resuming if possible; returns the exit code.
    `supervised`: run by `runner run`, whose resolution already logged every refusal.
    `rank`: this process's place in a launch (torchrun), handed to the session.
    `sample_log`: append each step's sample indices there (`.rank<R>` added per rank when
    several train).
    `parallel`: "ddp" or "fsdp" (FSDP2), how several ranks train (ignored for one process)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    total = config.steps if config.steps is not None else DEFAULT_DEMO_STEPS
    config.steps = total
    stop = StopController()
    restore_signals = install_signal_handlers(stop, grace_seconds=config.grace_seconds)
    ranks = rank.world_size if rank.coordinated else 1
    # one progress line per job: the other ranks' would interleave with it
    if rank.acts_as_primary:
        display = ProgressDisplay(total_steps=total, live=progress)
    else:
        display = ProgressDisplay(total_steps=total, live=False, every_seconds=float("inf"))
    try:
        with process_group(rank, config.device) as device, _sample_log(sample_log, rank) as out:
            demo_settings = {"--batch-size": batch_size, "--parallel": parallel}
            with _peer_collectives(rank, ranks, "of the ranks' set-up (DDP/FSDP)"):
                if ranks > 1:
                    # DDP's and FSDP's set-ups are collectives that differ with --parallel:
                    # the ranks compare their settings first (the session does again)
                    mine = settings_of(config, node=rank.node_rank, job=demo_settings)
                    refuse_differing(gather_from_ranks(mine))
                components = build_demo(
                    seed=config.seed,
                    device=device,
                    batch_size=batch_size,
                    total_steps=total,
                    world_size=ranks,
                    rank=rank.rank if ranks > 1 else 0,
                    parallel=parallel,
                )
            components.sample_log = out
            with TrainSession(
                config,
                state=components,
                stop=stop,
                refusals_reported=supervised,
                rank=rank,
                job_settings=demo_settings,
            ) as session:
                _fit_schedule(session, components, display)
                code = _train(session, components, display)
            display.close()
            # on every rank: a sharded (fsdp) state is gathered to be fingerprinted
            digest = components.full_fingerprint(primary=rank.acts_as_primary)
            if rank.acts_as_primary:
                print(
                    f"step {components.counters.step}/{display.total_steps} fingerprint {digest}",
                    file=sys.stderr,
                )
        if ranks > 1:
            log.info("rank %d of %d: exit %d", rank.rank, ranks, code)
        return code
    finally:
        stop.close()
        restore_signals()


@contextlib.contextmanager
def _sample_log(path: Path | None, rank: RankContext) -> Iterator[TextIO | None]:
    if path is None:
        yield None
        return
    if rank.coordinated and rank.world_size > 1:
        path = path.with_name(f"{path.name}.rank{rank.rank}")
    with open(path, "a", encoding="utf-8") as out:
        yield out


def _fit_schedule(
    session: TrainSession, components: DemoComponents, display: ProgressDisplay
) -> None:
    """After a resume at another world size the run's end is another step (its length is
    fixed in samples): the LR schedule and the progress line follow it."""
    target = session.target_steps
    if target is not None and target != components.config.total_steps:
        log.info(
            "run length fixed in samples (%s): it ends at step %d at this world size, "
            "not %d; the LR schedule is stretched to match",
            session.target_samples,
            target,
            components.config.total_steps,
        )
        components.rescale_schedule(target)
        display.total_steps = target


def _train(session: TrainSession, components: DemoComponents, display: ProgressDisplay) -> int:
    """The demo's loop under `session`, shown on `display`; returns the exit code."""
    if session.resumed_from is not None:
        display.checkpoint(
            session.resumed_from, age_seconds=_checkpoint_age(session, session.resumed_from)
        )
    shown = session.last_checkpoint
    while not session.should_stop:
        loss = _step(session, components)
        session.step_done()
        if session.last_stall_seconds is not None:
            display.stall(session.last_stall_seconds)
        if session.last_checkpoint is not shown:  # a new commit, not every step
            shown = session.last_checkpoint
            if shown is not None:
                display.checkpoint(shown.step)
        display.update(step=session.step, loss=loss)
    return session.finish()


def _step(session: TrainSession, components: DemoComponents) -> float:
    """One training step; with several ranks, a failure of its own collectives (DDP's
    gradient all-reduce, the loss average: a peer died) is the runner's PeerLostError, like
    one of the runner's collectives, not a traceback."""
    if session.group.single:
        return components.train_step()
    with _peer_collectives(session.rank, session.group.world_size, "in the training step"):
        return components.train_step()


@contextlib.contextmanager
def _peer_collectives(rank: RankContext, ranks: int, where: str) -> Iterator[None]:
    """With several ranks, a failure of torch.distributed's own collectives `where` (DDP's
    parameter broadcast and gradient all-reduce, FSDP's sharding, the loss average) means a
    peer died or hung: the one-line PeerLostError (exit 1), not a gloo traceback."""
    if ranks == 1:
        yield
        return
    try:
        yield
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, ...) are these
        raise peer_lost(rank.rank, ranks, where, exc) from exc


def _checkpoint_age(session: TrainSession, step: int) -> float:
    """Seconds since the checkpoint we resumed from was written (0 when unknown): a resumed
    run shows how old its starting point really is, not the moment it was loaded."""
    try:
        manifest = read_manifest_dir(local_step_dir(session.run_dir, step))
    except (OSError, RunnerError):
        return 0.0
    created = created_at_unix(manifest.created_at)
    return max(0.0, time.time() - created) if created is not None else 0.0
