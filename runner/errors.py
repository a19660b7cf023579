"""The project's error hierarchy and the one place errors map to exit codes.

Callers decide what to do by type, never by parsing messages. Every message says what is
wrong and what to do about it.
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTEGRITY = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: final checkpoint committed, retry elsewhere


class RunnerError(Exception):
    """Root of every error the runner raises on purpose."""

    exit_code = EXIT_FAILURE


class ConfigError(RunnerError):
    """Bad option, bad URI, inconsistent settings: the user must change the command."""

    exit_code = EXIT_USAGE


class RunDirLockedError(ConfigError):
    """Another process holds the run dir's lock (runner/runtime/runlock.py): one writer per
    run dir."""


class IntegrityError(RunnerError):
    """A checkpoint is corrupt, truncated, tampered with or unreadable."""

    exit_code = EXIT_INTEGRITY


class NoVerifiedCheckpointError(IntegrityError):
    """A checkpoint was required but none verified."""


class SchemaError(IntegrityError):
    """A manifest or payload has a schema version this runner cannot read."""


class PayloadNotLoadableError(SchemaError):
    """A payload whose bytes match its manifest that this runner (its torch) cannot
    deserialise: objects weights-only loading refuses, a newer serialisation. Not corrupt:
    possibly good for another version, so it is never replaced or deleted, only refused."""


class UnusableCheckpointsError(IntegrityError):
    """Checkpoints exist (locally or in the mirror) and none verifies and loads: training
    refuses to start rather than begin again at step 0 and replace them."""


class StorageError(RunnerError):
    """Object storage or filesystem failure."""


class CheckpointWriteError(StorageError):
    """A checkpoint could not be written locally (disk full, I/O error); the previous
    committed checkpoint is intact."""


class CheckpointConflictError(CheckpointWriteError):
    """A checkpoint of the same step already exists and verifies (or is of a schema/format
    this runner does not read) with other contents: it is never replaced. `kept` is where
    the save that lost was set aside, when it was."""

    def __init__(self, message: str, *, kept: Path | None = None) -> None:
        super().__init__(message)
        self.kept = kept


class StorageTransientError(StorageError):
    """Worth retrying: connection reset, timeout, 500, 503 SlowDown."""


class StoragePermanentError(StorageError):
    """Retrying will not help: access denied, no such bucket, invalid or missing credentials.
    The command or its environment must change, so it is a configuration error (exit 2):
    an orchestrator should stop, not retry elsewhere."""

    exit_code = EXIT_USAGE


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The object or file does not exist."""


class StorageConflictError(StorageError):
    """A create-only write found the object already there (another writer got there first)."""


class ChildFailedError(RunnerError):
    """A supervised trainer kept crashing past the restart limit."""


class TrainerUsageError(ConfigError):
    """A supervised trainer exited 2 (usage / configuration error): restarting it would fail
    the same way, so `runner run` exits 2 too."""


class TrainerIntegrityError(IntegrityError):
    """A supervised trainer exited 3 (integrity failure): not restarted, `runner run` exits 3
    too."""


class StartupInterrupted(RunnerError):
    """A stop request arrived while start-up still waited on the store (resume resolution, a
    download): the work was given up, nothing was trained, the checkpoints stand as they
    were. Exit 75: retrying elsewhere loses nothing."""

    exit_code = EXIT_PREEMPTED


class StorageTimeoutError(StorageTransientError):
    """A store call gave up: the store kept failing (or never answered) for its whole time
    budget (`--store-timeout`), or the caller's deadline came first. Still transient: a later
    call may succeed."""


class PeerLostError(RunnerError):
    """A collective with the other ranks of a torchrun job failed (runner/collective): a peer
    process died or hung past the channel's timeout. This rank exits 1 rather than wait
    forever; the last committed checkpoint stands."""

    exit_code = EXIT_FAILURE


def exit_code_for(exc: BaseException) -> int:
    """Map any exception to the process exit code (DESIGN.md, 'Exit codes')."""
    if isinstance(exc, RunnerError):
        return exc.exit_code
    return EXIT_FAILURE
