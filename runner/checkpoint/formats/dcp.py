"""The `torch-dcp` payload: one checkpoint written by every rank with torch.distributed.checkpoint.

Layout of a step directory (the manifest, written last by rank 0, lists every file below):

    .metadata            DCP's index, written by its coordinator (rank 0)
    __{rank}_{i}.distcp  DCP data files, written by each rank
    train_state.pt       rank 0: the non-tensor part every rank shares
    rank_{rank:05d}.pt   one per rank: that rank's RNG and sampler position

Every file DCP creates goes through a hashing writer, so each file's size and sha256 come from
the pass that wrote it (nothing is read back) and each is fsynced before the save returns.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.atomicity.files import HashingFileWriter, fsync_dir
from runner.checkpoint.manifest import FileEntry
from runner.errors import CheckpointWriteError, PayloadNotLoadableError, RunnerError

if TYPE_CHECKING:
    import os

    from torch.distributed import ProcessGroup

DCP_METADATA = ".metadata"
TRAIN_STATE_FILE = "train_state.pt"
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_RANK_FILE = re.compile(r"^rank_(\d{5,})\.pt$")


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def rank_of_file(path: str) -> int | None:
    """The rank that writes `path` in this layout (rank 0 writes the index and the shared train
    state), None for a name the layout does not have."""
    if path in (DCP_METADATA, TRAIN_STATE_FILE):
        return 0
    match = _DATA_FILE.match(path) or _RANK_FILE.match(path)
    return int(match.group(1)) if match else None


def rank_totals(files: list[FileEntry]) -> list[tuple[int | None, int, int]]:
    """(rank, files, bytes) per rank that wrote `files`, by rank; a name outside the layout
    under rank None, last."""
    totals: dict[int | None, tuple[int, int]] = {}
    for entry in files:
        rank = rank_of_file(entry.path)
        count, size = totals.get(rank, (0, 0))
        totals[rank] = (count + 1, size + entry.size)
    order = sorted(totals, key=lambda r: (r is None, r or 0))
    return [(rank, *totals[rank]) for rank in order]


class _HashedStream:
    """What DCP writes a file through: a HashingFileWriter with the `close()` DCP calls inside
    its `with` (the file is committed when the stream's context ends, not on close)."""

    def __init__(self, writer: HashingFileWriter) -> None:
        self._writer = writer
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._writer.write(data)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._writer.tell()

    def fileno(self) -> int:
        return self._writer.fileno()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self.flush()
        self.closed = True


def _hashing_fs_class() -> type:
    """DCP's FileSystem with every stream opened for writing hashed as it is written; built on
    first use so importing this module does not import torch.distributed."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self, root: Path) -> None:
            super().__init__()
            self.root = root
            self.written: dict[str, tuple[int, str]] = {}  # name in root -> (size, sha256)
            self._lock = threading.Lock()  # DCP may write files on several threads

        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            final = Path(path)
            with HashingFileWriter(final) as writer:
                yield _HashedStream(writer)
                writer.commit(sync_dir=False)  # fsynced; the directory once, after the save
            with self._lock:
                self.written[self._name(final)] = (writer.size, writer.sha256)

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            with self._lock:  # `.metadata.tmp` -> `.metadata`: the hash goes with the name
                done = self.written.pop(self._name(Path(path)), None)
                if done is not None:
                    self.written[self._name(Path(new_path))] = done

        def _name(self, path: Path) -> str:
            return path.relative_to(self.root).as_posix()

    return HashingFileSystem


def save_dcp(
    stage_dir: Path,
    state_dict: dict[str, Any],
    *,
    process_group: ProcessGroup | None = None,
) -> list[FileEntry]:
    """COLLECTIVE: every rank calls it with its own state_dict (same keys) and the same
    `stage_dir` (already created). Returns this rank's files (rank 0's include `.metadata`),
    each hashed as written and fsynced, the directory fsynced too."""
    import torch.distributed.checkpoint as dcp

    stage_dir = Path(stage_dir)
    fs = _hashing_fs_class()(stage_dir)
    writer = dcp.FileSystemWriter(stage_dir, overwrite=False)  # a fresh stage has no index
    writer.fs = fs
    _collective(
        lambda no_dist: dcp.save(
            state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist
        ),
        failed=lambda why: CheckpointWriteError(f"{stage_dir}: saving with DCP failed: {why}"),
        group=process_group,
    )
    fsync_dir(stage_dir)
    return [
        FileEntry(path=name, size=size, sha256=sha256)
        for name, (size, sha256) in sorted(fs.written.items())
    ]


def load_dcp(
    step_dir: Path,
    state_dict: dict[str, Any],
    *,
    process_group: ProcessGroup | None = None,
    storage_reader: Any = None,
) -> None:
    """COLLECTIVE: load the checkpoint in `step_dir` into `state_dict`'s tensors in place,
    resharded to this world size (written by N ranks, read by M). The caller verified the
    files first (or passes a `storage_reader` that fetches and verifies what it reads)."""
    import torch.distributed.checkpoint as dcp

    reader = storage_reader or dcp.FileSystemReader(Path(step_dir))
    _collective(
        lambda no_dist: dcp.load(
            state_dict, storage_reader=reader, process_group=process_group, no_dist=no_dist
        ),
        failed=lambda why: PayloadNotLoadableError(
            f"{step_dir}: its verified DCP files do not load into this state: {why}"
        ),
        group=process_group,
    )


def read_dcp_full(step_dir: Path) -> dict[str, Any]:
    """One process reads the whole DCP state with no template, nested as it was saved (e.g.
    `{"model": {...}, "optimizer": {...}}`): for inspecting and converting. Holds every tensor
    in memory at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = dcp.FileSystemReader(Path(step_dir))
    _collective(
        lambda _: _load_state_dict(
            state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True
        ),
        failed=lambda why: PayloadNotLoadableError(f"{step_dir}: its DCP files do not load: {why}"),
    )
    return state


def _collective(
    run: Callable[[bool], object],
    *,
    failed: Callable[[str], RunnerError],
    group: ProcessGroup | None = None,
) -> None:
    """Run a DCP call, in one process (`no_dist`) when no process group is up (without DCP's
    warning that it assumed so), its CheckpointException (a BaseException, past every
    `except Exception`) raised as the typed error `failed(why)` from this rank's cause."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():
            if no_dist:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            run(no_dist)
    except CheckpointException as exc:
        causes = {rank: cause for rank, (cause, _) in exc.failures.items()}
        why = "; ".join(f"rank {r}: {type(c).__name__}: {c}" for r, c in sorted(causes.items()))
        here = 0 if no_dist else dist.get_rank(group)  # DCP keys failures by group rank
        raise failed(why) from causes.get(here, next(iter(causes.values()), exc))
