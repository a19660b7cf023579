"""The background services every entry point runs beside training: metrics (and their HTTP
server), cloud preemption notice polling, and the mirror. Built from the config in one place so
`runner demo`, `runner run` and the in-process `TrainSession` behave alike."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.config import RunConfig
from runner.metrics.registry import RunnerMetrics
from runner.metrics.server import maybe_serve_metrics
from runner.preemption.notices import start_notice_poller
from runner.preemption.stop import StopController
from runner.runtime import runlock
from runner.runtime.lifecycle import stop_deadline
from runner.runtime.rank import SINGLE_PROCESS, RankContext

if TYPE_CHECKING:
    from runner.mirror import Mirror

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Services:
    metrics: RunnerMetrics
    mirror: Mirror | None


def make_mirror(config: RunConfig, metrics: RunnerMetrics | None) -> Mirror | None:
    """The mirror `--mirror` asks for, or None."""
    if config.mirror is None:
        return None
    from runner.mirror import Mirror  # boto3 is imported only when a mirror is used
    from runner.storage import open_storage

    # a run mirrors for hours: a store call that gave up does not stop later uploads
    storage = open_storage(config.mirror, store_timeout_s=config.store_timeout, give_up_once=False)
    return Mirror(storage, keep=config.keep, writer_id=config.writer_id, metrics=metrics)


@contextlib.contextmanager
def run_services(
    config: RunConfig, stop: StopController, *, rank: RankContext = SINGLE_PROCESS
) -> Iterator[Services]:
    """Metrics served on `--metrics-port` (0: not served), the notice poller (`--notices`)
    and the mirror; all stopped on exit, the mirror after its queued uploads. Metrics and
    notices run on each node's local rank 0 (`acts_as_node_primary`: one endpoint per node,
    and a notice is a node's), the mirror on global rank 0 (`acts_as_primary`); any other
    rank gets an unserved registry and no mirror, and learns of a stop at the next step's
    agreement (runner.session.coordination)."""
    if not rank.acts_as_node_primary:
        yield Services(metrics=RunnerMetrics(mirrored=False), mirror=None)
        return
    # remote series only where the mirror runs (global rank 0)
    metrics = RunnerMetrics(mirrored=config.mirror is not None and rank.acts_as_primary)
    with contextlib.ExitStack() as stack:
        server = maybe_serve_metrics(metrics, host=config.metrics_host, port=config.metrics_port)
        if server is not None:
            stack.callback(server.close)
            log.info(
                "metrics served on %s (%s; --metrics-host to change): /metrics, /healthz",
                server.bind_address,
                server.scope,
            )
        poller = start_notice_poller(config, stop, metrics)
        if poller is not None:
            stack.callback(poller.close)
        mirror = make_mirror(config, metrics) if rank.acts_as_primary else None
        if mirror is not None:
            stack.callback(close_mirror, mirror, stop, grace_seconds=config.grace_seconds)
        yield Services(metrics=metrics, mirror=mirror)


def close_mirror(mirror: Mirror, stop: StopController, *, grace_seconds: float) -> None:
    """After a stop, wait for the mirror only until the stop's deadline (the one rule,
    runner.runtime.lifecycle.stop_deadline): an upload still retrying against a dead
    endpoint must not keep a preempted process alive past its notice. Whatever is left is
    abandoned; runner.preemption.exiting then exits without joining the threads stuck on it.
    Then the storage's transfer threads are released (never waiting for an abandoned one)."""
    deadline = stop_deadline(stop, grace_seconds=grace_seconds)
    try:
        if deadline is None:  # no stop: queued uploads finish
            mirror.close()
        else:
            mirror.close(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        mirror.storage.close()


def lock_and_serve(
    owned: contextlib.ExitStack,
    config: RunConfig,
    stop: StopController,
    rank: RankContext,
    services: Services | None,
) -> tuple[runlock.RunDirLock | None, Services]:
    """An in-process run's start: the run dir's lock (one writer per run dir: a second
    process on it exits 2 naming this one; taken before the services start and before
    anything is written there), then `services` or those the config asks for. Both are
    released when `owned` closes, the lock last; by the kernel if the process dies. Of a
    coordinated launch's ranks, the node's local rank 0 holds the lock for all of them."""
    lock = None
    if not rank.coordinated or rank.is_local_primary:
        lock = owned.enter_context(runlock.acquire(Path(config.run_dir), command="TrainSession"))
    if services is None:
        services = owned.enter_context(run_services(config, stop, rank=rank))
    return lock, services
