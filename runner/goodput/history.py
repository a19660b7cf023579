"""The attempt records beside the checkpoints: read from a run dir or a mirror, copied up after
checkpoints and at exit, and pulled down by a new node so that its count goes on.

Store calls here are bounded (`within`): the records must never hold up training, a stop or
an exit; a failed or late copy is counted by the caller and tried again next time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runner.checkpoint.layout import ATTEMPTS_DIR
from runner.goodput.records import SUFFIX
from runner.storage.base import Storage

log = logging.getLogger(__name__)

UPLOAD_SECONDS = 10.0
"""The most an exit waits for its attempt record to land in the mirror."""


def records_at(storage: Storage) -> dict[str, bytes]:
    """Attempt id -> its file's bytes, for every record at `storage` (run dir or mirror)."""
    found: dict[str, bytes] = {}
    for info in storage.list(f"{ATTEMPTS_DIR}/"):
        name = info.key.rsplit("/", 1)[-1]
        if not name.endswith(SUFFIX) or name.startswith("."):
            continue
        try:
            found[name[: -len(SUFFIX)]] = storage.get_bytes(info.key)
        except (OSError, FileNotFoundError):
            continue  # pruned or replaced meanwhile
    return found


def local_records(run_dir: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    folder = Path(run_dir) / ATTEMPTS_DIR
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        try:
            found[path.name[: -len(SUFFIX)]] = path.read_bytes()
        except OSError:
            continue
    return found


def pull_records(storage: Storage, run_dir: Path) -> int:
    """Records in the mirror that this run dir lacks (or holds shorter) copied down; how many.
    A new node's metrics and the measured cadence then count the whole run's history."""
    folder = Path(run_dir) / ATTEMPTS_DIR
    pulled = 0
    for attempt_id, data in records_at(storage).items():
        path = folder / f"{attempt_id}{SUFFIX}"
        try:
            if path.exists() and path.stat().st_size >= len(data):
                continue
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.pull")
            tmp.write_bytes(data)
            tmp.replace(path)
            pulled += 1
        except OSError as exc:
            log.warning("attempt records: could not copy %s down: %s", attempt_id, exc)
    return pulled


def in_background(work: Callable[[], object], *, what: str) -> None:
    """`work()` on a daemon thread nothing waits for (a failure is logged)."""

    def run() -> None:
        try:
            work()
        except Exception as exc:  # a store's error of any kind: logged, never raised
            log.warning("%s failed: %s", what, exc)

    threading.Thread(target=run, name="attempt-records", daemon=True).start()


def copy_at_exit(
    put_record: Callable[[str, Path], object], key: str, path: Path, *, deadline: float | None
) -> bool:
    """An attempt's record (`key`, its local `path`) copied up at its end by `put_record`,
    waited for what is left of the stop's `deadline` (time.monotonic), at most
    UPLOAD_SECONDS and at least a second (a stop that used its grace still says so); False
    when it failed or is still running."""
    seconds = UPLOAD_SECONDS
    if deadline is not None:
        seconds = min(seconds, max(deadline - time.monotonic(), 1.0))
    return within(
        seconds, lambda: put_record(key, path), what=f"copying attempt record {key} to the mirror"
    )


def within(seconds: float, work: Callable[[], object], *, what: str) -> bool:
    """`work()` on a daemon thread, waited for at most `seconds`; False when it failed or is
    still running (it may land later; nothing waits for it)."""
    outcome: list[bool] = []

    def run() -> None:
        try:
            work()
            outcome.append(True)
        except Exception as exc:  # a store's error of any kind: counted, never raised
            log.warning("%s failed: %s", what, exc)
            outcome.append(False)

    thread = threading.Thread(target=run, name="attempt-records", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    if thread.is_alive():
        log.warning("%s did not finish within %.1f s; left to land later", what, seconds)
        return False
    return bool(outcome and outcome[0])
