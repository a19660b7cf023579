"""file:// backend: a local directory used as a bucket (the embedded default)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from runner.checkpoint.atomic import HashingFileWriter, fsync_dir, read_chunks, temp_path_for
from runner.checkpoint.layout import TMP_PREFIX
from runner.errors import (
    IntegrityError,
    RunnerError,
    StorageConflictError,
    StorageError,
    StorageNotFoundError,
)
from runner.storage.base import ObjectInfo, ProgressCallback, check_download, check_key


class FileStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()

    @property
    def uri(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key, uri=self.uri)

    @contextlib.contextmanager
    def _os_errors(self, action: str, key: str) -> Iterator[None]:
        """A failing disk or mount (full, read-only, a file where a directory should be)
        becomes a StorageError naming the location, like any other backend's failure."""
        try:
            yield
        except RunnerError:
            raise
        except OSError as exc:
            raise self._storage_error(action, key, exc) from exc

    def _storage_error(self, action: str, key: str, exc: OSError) -> StorageError:
        where = f" ({exc.filename})" if exc.filename else ""
        return StorageError(f"{self.uri}/{key}: cannot {action}: {exc.strerror or exc}{where}")

    def put_file(
        self,
        key: str,
        src: Path,
        *,
        sha256: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        with self._os_errors("write", key):
            dst = self._path(key)
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as f, HashingFileWriter(dst) as writer:
                for chunk in read_chunks(f):
                    writer.write(chunk)
                    if progress:
                        progress(len(chunk))
                if sha256 is not None and writer.digest_so_far() != sha256:
                    raise IntegrityError(
                        f"{src} changed while copying to {self.uri}/{key}: sha256 mismatch"
                    )
                writer.commit()

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        with self._os_errors("write", key):
            dst = self._path(key)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not if_absent:
                with HashingFileWriter(dst) as writer:
                    writer.write(data)
                    writer.commit()
                return
            # create-only: link() refuses an existing name atomically, unlike rename()
            temp = temp_path_for(dst)
            try:
                with open(temp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(temp, dst)
                except FileExistsError as exc:
                    raise StorageConflictError(f"{self.uri}/{key} already exists") from exc
                fsync_dir(dst.parent)
            finally:
                temp.unlink(missing_ok=True)

    def get_file(
        self,
        key: str,
        dst: Path,
        *,
        progress: ProgressCallback | None = None,
        sha256: str | None = None,
        size: int | None = None,
    ) -> None:
        with (
            self._os_errors("download", key),
            self.open_read(key) as f,
            HashingFileWriter(dst) as writer,
        ):
            for chunk in read_chunks(f):
                writer.write(chunk)
                if progress:
                    progress(len(chunk))
            check_download(
                f"{self.uri}/{key}",
                got_size=writer.size,
                got_sha256=writer.digest_so_far(),
                size=size,
                sha256=sha256,
            )
            writer.commit()

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.root
        for dirpath, dirnames, filenames in os.walk(base):
            # in-progress writes are invisible to readers
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(base).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def head(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from exc
        return ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError as exc:
            raise self._storage_error("delete", key, exc) from exc
        # drop directories left empty, up to the root
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
