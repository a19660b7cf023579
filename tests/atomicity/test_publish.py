"""publish_dir: a staged directory appears under its final name whole or not at all, and what
was there before is only ever touched by the caller's policy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runner.atomicity.publish import ATTEMPTS, Existing, publish_dir
from runner.errors import RunnerError


def _tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _dir(path: Path, **files: bytes) -> Path:
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


NEW = {"state.pt": b"new state", "manifest.json": b'{"new": 1}'}
OLD = {"state.pt": b"old state", "manifest.json": b'{"old": 1}'}


def test_publish_into_an_empty_slot(tmp_path: Path) -> None:
    staged = _dir(tmp_path / ".tmp-step_000001-1-aaaaaaaaaaaa", **NEW)
    final = tmp_path / "step_000001"
    assert publish_dir(staged, final) is True
    assert _tree(final) == NEW
    assert not staged.exists()


def test_an_existing_one_without_a_policy_raises_and_stays(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)
    with pytest.raises(OSError):
        publish_dir(staged, final)
    assert _tree(final) == OLD and _tree(staged) == NEW


def test_policy_keep_leaves_both_as_they_were(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)
    asked: list[Path] = []

    def keep(path: Path) -> Existing:
        asked.append(path)
        return Existing.KEEP

    assert publish_dir(staged, final, on_existing=keep) is False
    assert asked == [final]
    assert _tree(final) == OLD and _tree(staged) == NEW


def test_policy_moving_the_old_one_aside_publishes_the_new_one(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)
    aside = tmp_path / "aside" / "step_000001-corrupt"

    def move_aside(path: Path) -> Existing:
        aside.parent.mkdir()
        os.rename(path, aside)
        return Existing.MOVED

    assert publish_dir(staged, final, on_existing=move_aside) is True
    assert _tree(final) == NEW and _tree(aside) == OLD
    assert not staged.exists()


def test_a_policy_refusing_leaves_the_old_one_under_the_final_name(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)

    def refuse(path: Path) -> Existing:
        raise RunnerError("conflict")

    with pytest.raises(RunnerError, match="conflict"):
        publish_dir(staged, final, on_existing=refuse)
    assert _tree(final) == OLD and _tree(staged) == NEW


def test_fake_crash_between_move_aside_and_rename_loses_neither(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)
    aside = tmp_path / "step_000001-aside"

    def move_then_crash(path: Path) -> Existing:
        os.rename(path, aside)
        raise KeyboardInterrupt  # the process dies here

    with pytest.raises(KeyboardInterrupt):
        publish_dir(staged, final, on_existing=move_then_crash)
    # nothing partial under the final name: the old copy whole where the policy put it, the
    # new one whole in staging
    assert not final.exists()
    assert _tree(aside) == OLD and _tree(staged) == NEW


def test_sigkill_between_move_aside_and_rename_loses_neither(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)
    aside = tmp_path / "step_000001-aside"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from runner.atomicity.publish import publish_dir

        def move_then_die(path):
            os.rename(path, {str(aside)!r})
            os.kill(os.getpid(), signal.SIGKILL)

        publish_dir(Path({str(staged)!r}), Path({str(final)!r}), on_existing=move_then_die)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    assert done.returncode == -signal.SIGKILL
    assert not final.exists()
    assert _tree(aside) == OLD and _tree(staged) == NEW


def test_a_name_that_keeps_being_taken_gives_up(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = _dir(tmp_path / "step_000001", **OLD)
    calls: list[int] = []

    def another_writer_wins(path: Path) -> Existing:
        # moved aside, and another writer's copy lands under the name before our rename
        calls.append(1)
        os.rename(path, tmp_path / f"aside-{len(calls)}")
        _dir(path, **OLD)
        return Existing.MOVED

    with pytest.raises(RunnerError, match="another writer keeps replacing it"):
        publish_dir(staged, final, on_existing=another_writer_wins)
    assert len(calls) == ATTEMPTS
    assert _tree(final) == OLD and _tree(staged) == NEW


def test_an_empty_dir_under_the_final_name_is_replaced_by_the_rename(tmp_path: Path) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = tmp_path / "step_000001"
    final.mkdir()

    def never(path: Path) -> Existing:
        raise AssertionError("an empty dir is not a checkpoint: no policy needed")

    assert publish_dir(staged, final, on_existing=never) is True
    assert _tree(final) == NEW


def test_a_dangling_link_under_the_final_name_is_an_error_not_a_policy_case(
    tmp_path: Path,
) -> None:
    staged = _dir(tmp_path / "staged", **NEW)
    final = tmp_path / "step_000001"
    final.symlink_to(tmp_path / "nowhere")

    def never(path: Path) -> Existing:
        raise AssertionError("not asked: nothing exists there")

    with pytest.raises(OSError):
        publish_dir(staged, final, on_existing=never)
    assert final.is_symlink() and _tree(staged) == NEW
