"""file:// backend: a local directory used as a bucket (the embedded default).

No symlink below the root is ever followed: checkpoint writers never create one, and a
location whose files point elsewhere (a `file://` mirror someone else can write, a copied run
dir) must not make `pull`, `verify` or a resume read outside it. Reads open every component
with O_NOFOLLOW relative to the previous one (no check-then-open race); a symlink anywhere
below the root is an IntegrityError "is a symlink; refusing to follow it". The root itself
may be a symlink (it is what the user named). `list` does not descend into symlinked
directories and reports symlinked files (their own lstat size) so that reading them fails
loudly instead of the file silently vanishing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from runner.atomicity.files import HashingFileWriter, fsync_dir, read_chunks
from runner.atomicity.temp import is_temp_name, temp_path
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

    def local_path(self, key: str = "") -> Path | None:
        return self._path(key) if key else self.root

    def _path(self, key: str) -> Path:
        return self.root / check_key(key, uri=self.uri)

    def _symlink_error(self, key: str) -> IntegrityError:
        return IntegrityError(
            f"{self.uri}/{key} is a symlink; refusing to follow it (checkpoint writers never "
            "create symlinks: the location was tampered with or assembled by hand)"
        )

    @contextlib.contextmanager
    def _parent_fd(self, key: str) -> Iterator[tuple[int, str]]:
        """(fd of the key's parent directory, last name), every directory below the root
        opened with O_NOFOLLOW. StorageNotFoundError when a directory is missing."""
        parts = check_key(key, uri=self.uri).split("/")
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = os.open(self.root, flags)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from exc
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    child = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                        raise self._symlink_error("/".join(parts[: i + 1])) from exc
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                        raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from exc
                    raise
                os.close(fd)
                fd = child
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _check_no_symlink(self, key: str) -> None:
        """Before a write or delete: no existing component below the root is a symlink
        (a write must not land outside the location through one)."""
        parts = check_key(key, uri=self.uri).split("/")
        path = self.root
        for i, part in enumerate(parts):
            path = path / part
            try:
                st = path.lstat()
            except (FileNotFoundError, NotADirectoryError):
                return
            if stat.S_ISLNK(st.st_mode):
                raise self._symlink_error("/".join(parts[: i + 1]))

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
            self._check_no_symlink(key)
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
            self._check_no_symlink(key)
            dst = self._path(key)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not if_absent:
                with HashingFileWriter(dst) as writer:
                    writer.write(data)
                    writer.commit()
                return
            # create-only: link() refuses an existing name atomically, unlike rename()
            temp = temp_path(dst)
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
        """The file at `key`, opened without following any symlink below the root; only a
        regular file is opened (a FIFO or device would block or never end)."""
        with self._os_errors("read", key), self._parent_fd(key) as (dir_fd, name):
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._symlink_error(key) from exc
                if exc.errno == errno.ENXIO:  # a socket
                    raise IntegrityError(
                        f"{self.uri}/{key} is not a regular file; refusing to read it"
                    ) from exc
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
                    raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from exc
                raise
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISDIR(mode):
                    raise StorageNotFoundError(f"{self.uri}/{key} does not exist (a directory)")
                if not stat.S_ISREG(mode):
                    raise IntegrityError(
                        f"{self.uri}/{key} is not a regular file; refusing to read it"
                    )
                os.set_blocking(fd, True)
                return os.fdopen(fd, "rb")
            except BaseException:
                os.close(fd)
                raise

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.root
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if directory:
            # listing "checkpoints/" through a symlinked checkpoints dir would follow it, and
            # skipping it would hide every checkpoint: refuse loudly instead
            self._check_no_symlink(directory)
        for dirpath, dirnames, filenames in os.walk(base):
            # in-progress writes are invisible to readers
            dirnames[:] = [d for d in dirnames if not is_temp_name(d)]
            for name in filenames:
                if is_temp_name(name):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(base).as_posix()
                if key.startswith(prefix):
                    try:
                        # lstat: a symlinked file is listed as itself (reading it then
                        # fails loudly), never as what it points at
                        st = full.lstat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def head(self, key: str) -> ObjectInfo:
        """Size of the file at `key`; a symlink anywhere below the root is refused."""
        with self._os_errors("read", key), self._parent_fd(key) as (dir_fd, name):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError) as exc:
                raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from exc
        if stat.S_ISLNK(st.st_mode):
            raise self._symlink_error(key)
        return ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def delete(self, key: str) -> None:
        # a symlinked directory on the way would make the delete land outside the location;
        # a symlink as the last part is removed itself (unlink never follows it)
        parts = check_key(key, uri=self.uri).split("/")
        if len(parts) > 1:
            self._check_no_symlink("/".join(parts[:-1]))
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

    def close(self) -> None:
        pass  # nothing is kept between calls


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
