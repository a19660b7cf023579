"""Log records and the live progress line share one terminal: a record printed while the line
is live starts at column 0 (the line is cleared first and redrawn after), in a real pty."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.demo.display import ProgressDisplay

REPO = Path(__file__).resolve().parents[2]
LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING) runner[.\w]*: .+$")
PROGRESS = re.compile(
    r"^step \d+/\d+  loss \d+\.\d+  \d+\.\d steps/s  last checkpoint: "
    r"(none yet|step \d+ \(\d+s ago\)(  stall \d+ ms|  stall \d+\.\d s)?)$"
)
FINAL = re.compile(r"^step \d+/\d+ fingerprint [0-9a-f]{64}$")


def render(output: str) -> list[str]:
    """What a terminal shows for `output`: \r moves to column 0, \n to a new line, ESC[K
    erases to the end of the line, other characters overwrite."""
    lines: list[list[str]] = [[]]
    col = 0
    i = 0
    while i < len(output):
        if output.startswith("\x1b[K", i):
            del lines[-1][col:]
            i += 3
            continue
        char = output[i]
        i += 1
        if char == "\r":
            col = 0
        elif char == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
    return ["".join(line) for line in lines]


def run_in_pty(argv: list[str], *, timeout: float = 120) -> tuple[int, str]:
    """Run `argv` with stdin/stdout/stderr on a new pty; return its exit code and all it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, start_new_session=True
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every holder of the slave side has closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    # the pty turns "\n" into "\r\n"; keep "\n" alone so each line ends once
    return code, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.slow
def test_log_lines_start_at_column_0_while_the_progress_line_is_live(tmp_path: Path) -> None:
    """`runner demo` on a terminal (live line by default) logs each checkpoint commit during
    the progress display: every record is on a line of its own. Without the cooperation the
    record lands glued after the progress text ("... last checkpoint: none yet2026-...")."""
    argv = [
        sys.executable, "-m", "runner", "demo", "--run-dir", str(tmp_path / "run"),
        "--steps", "30", "--ckpt-every", "10", "--device", "cpu", "--threads", "1",
    ]  # fmt: skip
    code, output = run_in_pty(argv)
    assert code == 0, output
    assert "\r\x1b[Kstep 1/30" in output, output  # the live, redrawn line was on
    screen = [line for line in render(output) if line]
    marker = "INFO runner.session.train_session: checkpoint step"
    commits = [line for line in screen if marker in line]
    assert [re.search(r"checkpoint step (\d+) committed", c)[1] for c in commits] == [  # type: ignore[index]
        "10",
        "20",
        "30",
    ], screen
    for line in screen:
        assert LOG.match(line) or PROGRESS.match(line) or FINAL.match(line), (line, screen)
    # each record begins right after a line start: nothing of the progress line precedes it
    for match in re.finditer(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO", output):
        before = output[: match.start()]
        line_start = max(before.rfind("\r"), before.rfind("\n")) + 1
        assert before[line_start:].replace("\x1b[K", "") == "", before[-200:]
    assert FINAL.match(screen[-1]) and PROGRESS.match(screen[-2]), screen[-3:]


def test_the_progress_line_is_redrawn_under_each_record_and_handlers_get_their_stream_back() -> (
    None
):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("runner")
    logger.addHandler(handler)
    try:
        display = ProgressDisplay(total_steps=10, stream=out, live=True, clock=lambda: 0.0)
        display.update(step=3, loss=1.0)
        logging.getLogger("runner.test").warning("store slow")
        display.update(step=4, loss=1.0)
        display.close()
        assert handler.stream is out
        logging.getLogger("runner.test").warning("after close")
    finally:
        logger.removeHandler(handler)
    line3 = "step 3/10  loss 1.0000  0.0 steps/s  last checkpoint: none yet"
    line4 = line3.replace("step 3/", "step 4/")
    assert out.getvalue() == (
        f"\r\x1b[K{line3}\r\x1b[KWARNING store slow\n\r\x1b[K{line3}\r\x1b[K{line4}\n"
        "WARNING after close\n"
    )


def test_a_line_per_interval_leaves_log_handlers_alone() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger("runner").addHandler(handler)
    try:
        display = ProgressDisplay(total_steps=10, stream=out, live=False, clock=lambda: 0.0)
        assert handler.stream is out
        display.close()
    finally:
        logging.getLogger("runner").removeHandler(handler)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_record_during_a_transfer_bar_gets_a_line_of_its_own() -> None:
    """push/pull's byte bar (tqdm) and a retry warning on the same terminal: the bar is cleared
    before the record and redrawn after it, and the handler gets its stream back."""
    from runner.console.progress import transfer_progress

    out = _Terminal()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("runner").addHandler(handler)
    try:
        with transfer_progress(1000, desc="push step 5", stream=out, show_after_s=0) as advance:
            advance(400)
            assert "push step 5" in out.getvalue()  # the bar is on the terminal
            logging.getLogger("runner.storage").warning("slow down: retrying part 3")
            advance(100)
        assert handler.stream is out
    finally:
        logging.getLogger("runner").removeHandler(handler)
    output = out.getvalue()
    at = output.index("WARNING slow down: retrying part 3\n")
    before = output[:at]
    assert before.endswith("\r"), repr(before[-120:])  # the bar was cleared: column 0
    assert "push step 5" in output[at:], repr(output[at:])  # and drawn again after it
    screen = [line.strip() for line in render(output)]
    assert "WARNING slow down: retrying part 3" in screen, screen


def test_a_record_before_the_bar_shows_is_left_alone() -> None:
    from runner.console.progress import transfer_progress

    out = _Terminal()
    handler = logging.StreamHandler(out)
    logging.getLogger("runner").addHandler(handler)
    try:
        with transfer_progress(1000, desc="pull", stream=out, show_after_s=60) as advance:
            advance(10)
            logging.getLogger("runner.storage").warning("early")
    finally:
        logging.getLogger("runner").removeHandler(handler)
    assert out.getvalue() == "early\n"


def test_records_from_other_threads_never_split_the_progress_line() -> None:
    """Mirror uploads log from their own threads while the loop redraws the line."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("runner").addHandler(handler)
    try:
        display = ProgressDisplay(total_steps=500, stream=out, live=True, clock=lambda: 0.0)

        def upload(n: int) -> None:
            for i in range(50):
                logging.getLogger("runner.mirror").warning("upload %d retry %d", n, i)

        threads = [threading.Thread(target=upload, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for step in range(1, 501):
            display.update(step=step, loss=1.0)
        for t in threads:
            t.join()
        display.close()
    finally:
        logging.getLogger("runner").removeHandler(handler)
    screen = [line for line in render(out.getvalue()) if line]
    records = [line for line in screen if line.startswith("WARNING ")]
    assert len(records) == 200 and all(
        re.fullmatch(r"WARNING upload \d retry \d+", r) for r in records
    )
    assert all(PROGRESS.match(line) for line in screen if not line.startswith("WARNING ")), screen
    assert screen[-1].startswith("step 500/500 ")
