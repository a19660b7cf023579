"""Where this process stands in a multi-process launch (torchrun): rank 0 of 1 unless told.

The run's single-writer work (mirror, loss log, retention, the seconds cadence, the manifest)
is global rank 0's; the node's work (the run-dir lock, the metrics endpoint, the notice
poller) is each node's local rank 0's. Each consumer asks `acts_as_primary` or
`acts_as_node_primary` in one place.

The environment is read by the entry point (the CLI passes `os.environ` to `from_env`), never
here: like every setting, the launch's variables come in through the one place that reads the
environment. They are not RunConfig fields: no user sets them (torchrun does, per process),
and RunConfig sits below the runtime layer that acts on them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from runner.errors import ConfigError

log = logging.getLogger(__name__)

# torchrun's variables (torch.distributed.elastic): GROUP_RANK is the node's rank.
ENV_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# where the ranks meet (torch.distributed's env:// init); torchrun sets both
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankContext:
    rank: int = 0
    """Global rank (torchrun's RANK)."""
    world_size: int = 1
    local_rank: int = 0
    """Rank on this node (LOCAL_RANK)."""
    local_world_size: int = 1
    node_rank: int = 0
    """This node's rank (GROUP_RANK)."""
    coordinated: bool = False
    """Whether the ranks share one run (they agree every step, save one checkpoint
    together, and leave the single-writer work to rank 0). `from_env` sets it for a launch of
    several ranks; a context built by hand is alone unless it says so."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE must be >= 1 (got {self.world_size})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"RANK must be 0..WORLD_SIZE-1 (got RANK={self.rank}, WORLD_SIZE={self.world_size})"
            )
        if not 1 <= self.local_world_size <= self.world_size:
            raise ConfigError(
                f"LOCAL_WORLD_SIZE must be 1..WORLD_SIZE (got LOCAL_WORLD_SIZE="
                f"{self.local_world_size}, WORLD_SIZE={self.world_size})"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"LOCAL_RANK must be 0..LOCAL_WORLD_SIZE-1 (got LOCAL_RANK={self.local_rank}, "
                f"LOCAL_WORLD_SIZE={self.local_world_size})"
            )
        if self.node_rank < 0:
            raise ConfigError(f"GROUP_RANK must be >= 0 (got {self.node_rank})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RankContext:
        """The context torchrun's variables describe; rank 0 of 1 without WORLD_SIZE. torchrun
        sets all of them, so a lone RANK or LOCAL_RANK left in the environment by something
        else is ignored rather than fatal. With WORLD_SIZE set, a missing RANK, LOCAL_RANK or
        GROUP_RANK is 0, and a missing LOCAL_WORLD_SIZE (launchers other than torchrun may
        leave it out) is WORLD_SIZE: every process of the launch then agrees on it (LOCAL_RANK
        + 1 would differ between the processes of one node), it holds any LOCAL_RANK the world
        can have, and it is exact for a one-node launch. A variable that is not a whole number,
        or values that contradict each other (RANK >= WORLD_SIZE, LOCAL_RANK >= WORLD_SIZE),
        are a ConfigError (exit 2) naming them."""
        world_size = _integer(environ, "WORLD_SIZE")
        if world_size is None:
            return cls()
        values = {name: _integer(environ, name) for name in ENV_VARIABLES}
        rank = _or(values["RANK"], 0)
        local_rank = _or(values["LOCAL_RANK"], 0)
        local_world_size = values["LOCAL_WORLD_SIZE"]
        if local_world_size is None:
            cls(rank=rank, world_size=world_size)  # WORLD_SIZE and RANK checked first, as ever
            if not 0 <= local_rank < world_size:
                # not __post_init__'s message: it would name a LOCAL_WORLD_SIZE nobody set
                raise ConfigError(
                    f"LOCAL_RANK must be 0..WORLD_SIZE-1 (got LOCAL_RANK={local_rank}, "
                    f"WORLD_SIZE={world_size})"
                )
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=_or(local_world_size, world_size),
            node_rank=_or(values["GROUP_RANK"], 0),
            coordinated=world_size > 1,
        )

    @property
    def is_primary(self) -> bool:
        """Global rank 0."""
        return self.rank == 0

    @property
    def is_local_primary(self) -> bool:
        """Rank 0 of this node."""
        return self.local_rank == 0

    @property
    def acts_as_primary(self) -> bool:
        """Whether this process does the run's single-writer work: the primary of coordinated
        ranks, and every process that runs alone."""
        return self.is_primary or not self.coordinated

    @property
    def multi_node(self) -> bool:
        """Coordinated ranks on more than one node: each node has its own run dir, and the
        mirror is the only state they share (runner.mirror.nodes)."""
        return self.coordinated and self.world_size > self.local_world_size

    @property
    def acts_as_node_primary(self) -> bool:
        """Whether this process does its node's work (run-dir lock, metrics endpoint, notice
        poller): local rank 0 of coordinated ranks, and every process that runs alone."""
        return self.is_local_primary or not self.coordinated


SINGLE_PROCESS = RankContext()
"""Rank 0 of 1: the in-process API's default (a caller under torchrun passes its own)."""


def launch_context(environ: Mapping[str, str]) -> RankContext:
    """The context of this process's launch, for the CLI. An environment that does not
    describe a valid rank (a stray or malformed WORLD_SIZE/RANK left by another tool; torchrun
    always sets valid ones) is warned about and runs as rank 0 of 1 instead of ending the run
    with exit 2."""
    try:
        context = RankContext.from_env(environ)
    except ConfigError as exc:
        log.warning("ignoring the launch variables (%s): running as rank 0 of 1", exc)
        return SINGLE_PROCESS
    missing = [name for name in RENDEZVOUS_VARIABLES if not environ.get(name)]
    if context.coordinated and missing:
        log.warning(
            "ignoring WORLD_SIZE=%d RANK=%d: no %s, so this is not a torchrun launch (start "
            "it with torchrun, or unset WORLD_SIZE); running as rank 0 of 1",
            context.world_size,
            context.rank,
            "/".join(missing),
        )
        return SINGLE_PROCESS
    return context


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} must be a whole number") from None


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
