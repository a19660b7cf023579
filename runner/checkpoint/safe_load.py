"""Deserialise payload bytes the safe way: `torch.load(weights_only=True)` on the CPU, a local
file opened without following a symlink, and the loader's failures as PayloadNotLoadableError.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO

from runner.checkpoint.listing import open_local
from runner.errors import PayloadNotLoadableError


def not_loadable(exc: BaseException, *, source: str) -> PayloadNotLoadableError:
    """The error for a payload whose bytes verified but that torch would not deserialise."""
    if isinstance(exc, pickle.UnpicklingError):
        return PayloadNotLoadableError(
            f"{source}: payload holds objects that weights-only loading refuses ({exc}); "
            "it was not written by spot-runner and was not executed"
        )
    return PayloadNotLoadableError(
        f"{source}: payload cannot be deserialised by this torch ({exc})"
    )


def torch_load(path: Path | str | BinaryIO, *, source: str, mmap: bool) -> Any:
    """torch.load(weights_only=True) with the loader's failures as IntegrityError."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise not_loadable(exc, source=source) from exc


def torch_load_bytes(data: bytes, *, source: str) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise not_loadable(exc, source=source) from exc


def load_local(step_dir: Path, rel: str) -> Any:
    """Deserialise a local payload file, mapped (only the pages read are touched) and opened
    without following a symlink: torch maps the already-open file through /proc/self/fd."""
    source = str(step_dir / rel)
    with open_local(step_dir, rel) as f:
        # only torch's zip format can be mapped; a legacy (pre-1.6) file is read whole
        zipped = f.read(4) == b"PK\x03\x04"
        f.seek(0)
        by_fd = f"/proc/self/fd/{f.fileno()}"
        target = by_fd if os.path.exists(by_fd) else step_dir / rel
        return torch_load(target if zipped else f, source=source, mmap=zipped)
