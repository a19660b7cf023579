"""Storage backends behind one protocol; `open_storage` picks one from a URI or path."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from runner.errors import ConfigError
from runner.storage.base import ObjectInfo, ProgressCallback, Storage
from runner.storage.limits import DEFAULT_STORE_TIMEOUT_S

__all__ = [
    "ObjectInfo",
    "ProgressCallback",
    "Storage",
    "is_remote_uri",
    "is_run_dir_path",
    "mirror_uri",
    "open_existing",
    "open_storage",
    "set_store_timeout",
    "store_timeout",
]

# Set by the one-shot commands' --store-timeout (ls, verify, pull, ...) for the command being
# run; None: the documented default. A training run passes its RunConfig's to open_storage.
_store_timeout_s: float | None = None
_give_up_once = False


def set_store_timeout(seconds: float | None, *, give_up_once: bool = True) -> None:
    """The store timeout of every location opened from now on (None: the default, and no
    command). give_up_once: the command stops at its first store call that gave up (a
    one-shot command); a training run's mirror passes False and keeps trying later
    checkpoints."""
    global _store_timeout_s, _give_up_once
    _store_timeout_s = seconds
    _give_up_once = give_up_once and seconds is not None


def store_timeout() -> float:
    return DEFAULT_STORE_TIMEOUT_S if _store_timeout_s is None else _store_timeout_s


def is_remote_uri(location: str) -> bool:
    return location.startswith("s3://")


def is_run_dir_path(location: str | Path) -> bool:
    """A plain local path (a run dir a trainer may be writing), not a `file://` or `s3://`
    mirror location."""
    return "://" not in str(location) and not str(location).startswith("file:")


def open_storage(
    location: str | Path, *, store_timeout_s: float | None = None, give_up_once: bool = False
) -> Storage:
    """`s3://bucket/prefix`, `file:///abs/path`, or a plain local path (a run dir).
    `store_timeout_s`: a training run's (RunConfig.store_timeout), with `give_up_once` (False:
    later calls are still tried); None: the one-shot command's, set by `set_store_timeout`."""
    text = str(location)
    if text.startswith("s3://"):
        from runner.storage.s3 import S3Storage  # boto3 is imported only when needed

        if store_timeout_s is None:
            store_timeout_s, give_up_once = store_timeout(), _give_up_once
        return S3Storage.from_uri(text, store_timeout_s=store_timeout_s, give_up_once=give_up_once)
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{text}: file:// URIs need an absolute path (file:///abs/path)")
        from runner.storage.file import FileStorage

        return FileStorage(Path(parsed.path))
    if text.startswith("file:") or "://" in text:
        raise ConfigError(
            f"{text}: unsupported location; use s3://bucket/prefix, file:///path or a path"
        )
    from runner.storage.file import FileStorage

    return FileStorage(Path(text))


def mirror_uri(location: str | Path, *, cwd: Path | None = None) -> str:
    """A mirror location in one form: `s3://...` and `file:///...` as given, a plain path
    (absolute, or relative to cwd, resolved now and never again) as `file:///abs/path`."""
    text = str(location)
    if text.startswith("s3://") or text.startswith("file:///"):
        return text
    if not text or text.startswith("file:") or "://" in text:
        raise ConfigError(
            f"--mirror {text!r}: use s3://bucket/prefix, file:///absolute/path or a directory path"
        )
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    # not percent-encoded: open_storage takes a file:// path as written
    return "file://" + os.path.normpath(path)


def open_existing(location: str | Path) -> Storage:
    """`open_storage` for commands that read a location: a local directory that does not
    exist is a mistyped path, not an empty location."""
    from runner.storage.file import FileStorage

    storage = open_storage(location)
    if isinstance(storage, FileStorage) and not storage.root.is_dir():
        raise ConfigError(
            f"{location}: no such directory; give a run dir, file:///abs/path or s3://bucket/prefix"
        )
    return storage
