"""`runner run -- torchrun --nnodes N ...` with N > 1: this supervisor is one node of a job on
several nodes, each with its own run dir on its own disk.

There the ranks themselves commit every checkpoint in the mirror and resume from it
(runner/mirror/nodes.py); this node's run dir holds none. So the supervisor runs no mirror,
resolves no resume point and judges no checkpoint: it gives the trainer RUNNER_MIRROR,
forwards a stop to each torchrun worker (runner/supervisor/torchrun.py) and passes on the
workers' exit code: 75 only when they all exited 75, each rank's word that the final
checkpoint is committed in the mirror. Its metrics endpoint and notice poller stay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from runner.config import RunConfig
from runner.errors import EXIT_FAILURE, EXIT_INTEGRITY, EXIT_PREEMPTED, EXIT_USAGE, ConfigError
from runner.supervisor.child import describe_exit
from runner.supervisor.torchrun import torchrun_nnodes

# the supervisor's lines keep the one logger name they have always had
log = logging.getLogger("runner.supervisor.supervise")


class OneNode:
    """The whole job on this node: the supervisor resolves the resume point, adopts and
    follows what the trainer commits, mirrors it and judges a stop's final checkpoint."""

    owns_checkpoints = True
    stops_workers = False  # a stop goes to the trainer (torchrun forwards it itself)
    trainer_mirror: str | None = None  # the supervisor mirrors: the trainer is given none

    def describe(self) -> str | None:
        return None

    def without_resume(self) -> str:
        """Where the trainer starts from when the supervisor hands it no checkpoint."""
        return "scratch"


@dataclass(frozen=True)
class MultiNode:
    """One node of `nnodes`, its ranks committing in `mirror` (the normalised URI)."""

    nnodes: int
    mirror: str
    owns_checkpoints = False  # the ranks commit and resume in the mirror themselves
    stops_workers = True  # a stop goes to each torchrun worker (runner/supervisor/torchrun.py)

    @property
    def trainer_mirror(self) -> str | None:
        return self.mirror

    def without_resume(self) -> str:
        return f"the newest checkpoint in {self.mirror}, as its ranks choose"

    def describe(self) -> str:
        return (
            f"torchrun --nnodes {self.nnodes}: the ranks commit checkpoints in {self.mirror} "
            "themselves; this supervisor forwards signals and passes on their exit code"
        )

    def finish_stop(self, code: int, *, killed: bool, took: float, grace: float) -> int:
        """After a stop we forwarded, by the workers' exit code alone (after
        `Torchrun.exit_code`): 75 when they exited 75 before the deadline, 2 and 3 passed
        on, anything else 1."""
        how = "killed at the end of the grace period" if killed else describe_exit(code)
        if not killed and code == EXIT_PREEMPTED:
            log.warning(
                "trainer stopped (%s) %.2f s after the stop signal (grace %.0f s); the ranks "
                "committed their final checkpoint in %s",
                how,
                took,
                grace,
                self.mirror,
            )
            return EXIT_PREEMPTED
        passed_on = not killed and code in (EXIT_USAGE, EXIT_INTEGRITY)
        log.error(
            "trainer stopped (%s) %.2f s after the stop signal (grace %.0f s): the ranks did "
            "not report a committed final checkpoint (each exits 75 once it is in %s); "
            "exiting %d, not 75",
            how,
            took,
            grace,
            self.mirror,
            code if passed_on else EXIT_FAILURE,
        )
        return code if passed_on else EXIT_FAILURE


def multi_node_mode(command: Sequence[str], config: RunConfig) -> MultiNode | None:
    """The multi-node mode when `command` is torchrun on more than one node (chosen from the
    command alone), else None; ConfigError (exit 2) when it has no --mirror."""
    nnodes = torchrun_nnodes(command)
    if nnodes is None or nnodes <= 1:
        return None
    if config.mirror is None:
        raise ConfigError(
            f"several nodes need --mirror: `torchrun --nnodes {nnodes}` runs this job on "
            f"{nnodes} nodes, each with its own run dir, and its ranks commit every checkpoint "
            "in the mirror, the only storage the nodes share. Give every node's `runner run` "
            "the same --mirror (s3://bucket/run)"
        )
    return MultiNode(nnodes=nnodes, mirror=config.mirror)


def supervisor_mode(command: Sequence[str], config: RunConfig) -> OneNode | MultiNode:
    """How `runner run` supervises `command`: one node of several (`multi_node_mode`), or
    the whole job on this node."""
    return multi_node_mode(command, config) or OneNode()
