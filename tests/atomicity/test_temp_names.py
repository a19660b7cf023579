"""Temp names: one builder, one parser, and the stale-leftover rule. The literal shapes below
are the ones the runner and the test trainers have written to disk before this module
existed; a leftover of any of them must still be recognised and cleaned."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.atomicity.temp import (
    TMP_PREFIX,
    TempName,
    is_stale_temp,
    parse_temp_name,
    temp_name,
    temp_path,
)
from runner.system.pids import pid_alive

PID = os.getpid()


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


@pytest.fixture
def live_pid() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "target", ["step_000025", "state.pt", "incoming", "loss-log.jsonl", "step-7", "a-1-2"]
)
def test_a_built_name_parses_back_to_its_target_and_this_pid(target: str) -> None:
    name = temp_name(target)
    parsed = parse_temp_name(name)
    assert parsed is not None
    assert (parsed.target, parsed.pid, parsed.tag) == (target, PID, None)
    assert name == f"{TMP_PREFIX}{target}-{PID}-{parsed.token}"
    assert len(parsed.token) == 12 and int(parsed.token, 16) >= 0


def test_a_tagged_name_keeps_the_pruned_shape() -> None:
    name = temp_name("step_000025", tag="pruned")
    parsed = parse_temp_name(name)
    assert parsed is not None
    assert (parsed.target, parsed.pid, parsed.tag) == ("step_000025", PID, "pruned")
    assert name == f".tmp-step_000025-{PID}-pruned-{parsed.token}"
    assert len(parsed.token) == 8


def test_two_names_for_one_target_differ() -> None:
    assert temp_name("step_000001") != temp_name("step_000001")


def test_temp_path_is_beside_the_final_name(tmp_path: Path) -> None:
    final = tmp_path / "checkpoints" / "step_000003"
    temp = temp_path(final, tag="pruned")
    assert temp.parent == final.parent
    assert parse_temp_name(temp.name) == TempName(
        target="step_000003", pid=PID, token=temp.name[-8:], tag="pruned"
    )


@pytest.mark.parametrize("bad", ["", "a/b"])
def test_a_target_must_be_a_plain_name(bad: str) -> None:
    with pytest.raises(ValueError):
        temp_name(bad)


@pytest.mark.parametrize("tag", ["Pruned", "pruned-1", ""])
def test_a_tag_is_lowercase_letters(tag: str) -> None:
    with pytest.raises(ValueError):
        temp_name("step_000001", tag=tag)


# Names exactly as earlier code built them (writer._staging, mirror download, resume's incoming
# dir, atomicity temp_path_for, retention's pruned rename) and as trainers write them
# (tests/trainers/seed_trainer.c, edge_trainer.py, seed_writer.py).
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            ".tmp-step_000005-4242-aaaaaaaaaaaa",
            TempName(target="step_000005", pid=4242, token="aaaaaaaaaaaa"),
        ),
        (
            ".tmp-incoming-77-0123456789ab",
            TempName(target="incoming", pid=77, token="0123456789ab"),
        ),
        (".tmp-state.pt-9-ffffffffffff", TempName(target="state.pt", pid=9, token="ffffffffffff")),
        (
            ".tmp-step_000003-123-pruned-1a2b3c4d",
            TempName(target="step_000003", pid=123, token="1a2b3c4d", tag="pruned"),
        ),
        (".tmp-step_000005.bin-31337-c", TempName(target="step_000005.bin", pid=31337, token="c")),
        (".tmp-step_000200-1-abc", TempName(target="step_000200", pid=1, token="abc")),
        (
            ".tmp-step_000005.bin-31337",
            TempName(target="step_000005.bin-31337", pid=None, token=""),
        ),
        (".tmp-step_000001-abc", TempName(target="step_000001-abc", pid=None, token="")),
        (".tmp-prealloc", TempName(target="prealloc", pid=None, token="")),
    ],
)
def test_names_of_earlier_code_and_of_trainers_parse(name: str, expected: TempName) -> None:
    assert parse_temp_name(name) == expected


@pytest.mark.parametrize("name", ["step_000005", "tmp-step_000005-1-aaaaaaaaaaaa", ".tmp"])
def test_a_name_without_the_prefix_is_not_a_temp(name: str) -> None:
    assert parse_temp_name(name) is None


def test_pid_alive_for_this_process_a_live_child_and_a_dead_one(live_pid: int) -> None:
    assert pid_alive(os.getpid()) is True
    assert pid_alive(live_pid) is True
    assert pid_alive(_dead_pid()) is False


def _leftover(directory: Path, name: str, *, age: float) -> Path:
    path = directory / name
    path.mkdir()
    (path / "state.pt").write_bytes(b"partial")
    when = time.time() - age
    os.utime(path / "state.pt", (when, when))
    os.utime(path, (when, when))
    return path


def test_stale_rule_mine_dead_and_idle_or_very_idle(tmp_path: Path, live_pid: int) -> None:
    dead = _dead_pid()
    stale = {
        "mine, fresh": _leftover(tmp_path, f".tmp-step_000001-{PID}-aaaaaaaaaaaa", age=0),
        "dead, idle": _leftover(tmp_path, f".tmp-step_000002-{dead}-bbbbbbbbbbbb", age=20),
        "dead, pruned": _leftover(tmp_path, f".tmp-step_000003-{dead}-pruned-1a2b3c4d", age=20),
        "trainer's, dead": _leftover(tmp_path, f".tmp-step_000004.bin-{dead}-c", age=20),
        "live, very idle": _leftover(
            tmp_path, f".tmp-step_000005-{live_pid}-cccccccccccc", age=200
        ),
        "no pid, very idle": _leftover(tmp_path, ".tmp-prealloc", age=200),
    }
    kept = {
        "dead, fresh": _leftover(tmp_path, f".tmp-step_000006-{dead}-dddddddddddd", age=0),
        "live, idle": _leftover(tmp_path, f".tmp-step_000007-{live_pid}-eeeeeeeeeeee", age=20),
        "no pid, idle": _leftover(tmp_path, f".tmp-step_000008.bin-{dead}", age=20),
    }
    judged = {what: is_stale_temp(p, stale_seconds=10.0) for what, p in {**stale, **kept}.items()}
    assert judged == {**dict.fromkeys(stale, True), **dict.fromkeys(kept, False)}


def test_a_file_growing_inside_an_old_dir_keeps_it_fresh(tmp_path: Path) -> None:
    path = _leftover(tmp_path, f".tmp-step_000001-{_dead_pid()}-aaaaaaaaaaaa", age=200)
    (path / "state.pt").write_bytes(b"more")  # mtime now; the dir's own mtime stays old
    assert is_stale_temp(path, stale_seconds=10.0) is False


def test_a_committed_name_is_never_stale(tmp_path: Path) -> None:
    path = _leftover(tmp_path, "step_000001", age=10_000)
    assert is_stale_temp(path, stale_seconds=1.0) is False
