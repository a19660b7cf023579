"""A failed checkpoint or loss-log write names its real cause: running out of file descriptors
(EMFILE) is not a full disk (ENOSPC), and neither is a read-only or forbidden directory."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from runner.checkpoint.oserror_advice import oserror_advice


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def test_out_of_file_descriptors_is_not_called_a_full_disk() -> None:
    advice = oserror_advice(_error(errno.EMFILE))
    assert advice.startswith("The process ran out of file descriptors (the disk is not the")
    assert "ulimit -n" in advice
    assert "free space" not in advice.lower()
    system = oserror_advice(_error(errno.ENFILE))
    assert "fs.file-max" in system
    assert "free space" not in system.lower()


def test_full_disk_and_quota_say_free_space() -> None:
    assert oserror_advice(_error(errno.ENOSPC)) == (
        "The disk is full: free space there or use another --run-dir"
    )
    assert oserror_advice(_error(errno.ENOSPC), place="on that disk", alternative=None) == (
        "The disk is full: free space on that disk"
    )
    assert oserror_advice(_error(errno.EDQUOT)) == (
        "The disk quota is used up: free space there, raise the quota or use another --run-dir"
    )


@pytest.mark.parametrize(
    ("code", "start"),
    [
        (errno.EROFS, "The filesystem is read-only"),
        (errno.EACCES, f"Permission denied: user id {os.getuid()} may not write there"),
        (errno.EPERM, f"Permission denied: user id {os.getuid()} may not write there"),
        (errno.EIO, "An I/O error: the disk may be failing"),
    ],
)
def test_read_only_permission_and_io_errors_get_their_own_advice(code: int, start: str) -> None:
    advice = oserror_advice(_error(code))
    assert advice.startswith(start)
    assert "free space" not in advice.lower()
    assert advice.endswith("use another --run-dir")


def test_a_real_emfile_names_the_descriptor_limit() -> None:
    # The errno as the kernel gives it: a child process with a 64-descriptor limit opens
    # files until open() fails, frees a few so the advice can count them, and prints it.
    script = textwrap.dedent(
        """
        import os, resource
        from runner.checkpoint.oserror_advice import oserror_advice
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            for fd in held[-4:]:
                os.close(fd)
            print(exc.errno, oserror_advice(exc), sep="|")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    code, advice = done.stdout.strip().split("|")
    assert int(code) == errno.EMFILE
    assert advice.startswith("The process ran out of file descriptors")
    assert "open of a limit (RLIMIT_NOFILE) of 64." in advice
