"""`runner run --adopt` with a trainer that keeps checkpoints of its own (real processes, real
signals, real files; tests/trainers/dir_trainer.py writes HF-style `out/checkpoint-N/` in
place): verified copies, mirrored, put back on an empty node, never half-written, and an exit
code that says what stands."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.verify import verify_checkpoint
from runner.storage.file import FileStorage
from tests.fixtures.supervised import REPO, Supervised

pytestmark = pytest.mark.slow

TRAINER = REPO / "tests" / "trainers" / "dir_trainer.py"


def _args(node: Path, *trainer: str, quiet: str = "0.3", mirror: Path | None = None) -> list[str]:
    args = ["--run-dir", str(node / "run"), "--adopt", "out/checkpoint-*"]
    args += ["--adopt-quiet-seconds", quiet, "--max-restarts", "0"]
    if mirror is not None:
        args += ["--mirror", str(mirror)]
    return [*args, "--", sys.executable, str(TRAINER), *trainer]


def _run(node: Path, *trainer: str, **kw: object) -> tuple[int, str]:
    node.mkdir(parents=True, exist_ok=True)
    sup = Supervised(_args(node, *trainer, **kw), cwd=node)  # type: ignore[arg-type]
    code = sup.wait(60)
    return code, sup.out + "\n" + sup.err


def _reference(tmp_path: Path, steps: int) -> str:
    """The final weights of an uninterrupted run without the runner (same session)."""
    ref = tmp_path / "reference"
    ref.mkdir()
    subprocess.run(
        [sys.executable, str(TRAINER), "--steps", str(steps), "--step-seconds", "0"],
        cwd=ref,
        check=True,
        capture_output=True,
    )
    return (ref / "out" / "final.txt").read_text()


def _steps(location: Path) -> list[int]:
    ckpts = location / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpts.iterdir() if (p / "manifest.json").is_file())


def test_a_stopped_run_resumes_on_an_empty_node_from_the_mirror_exactly(tmp_path: Path) -> None:
    reference = _reference(tmp_path, 40)
    bucket = tmp_path / "bucket"
    node = tmp_path / "node-a"
    node.mkdir()
    sup = Supervised(_args(node, "--steps", "40", "--step-seconds", "0.1", mirror=bucket), cwd=node)
    sup.expect(r"^saved checkpoint-15$", timeout=30)
    sup.expect(r"^step 17$", timeout=10)
    sup.proc.send_signal(signal.SIGTERM)
    code = sup.wait(30)
    # the trainer died of the forwarded SIGTERM without saving: the checkpoint that stands
    # was written before the stop, so not 75
    assert code == 1, sup.err
    stands = [line for line in sup.stderr if "the checkpoint that stands is step" in line]
    assert len(stands) == 1, sup.err
    standing = int(stands[0].split("the checkpoint that stands is step ")[1].split()[0])
    assert standing in (10, 15)
    assert standing in _steps(bucket)

    # a new node: no run dir, no out/
    shutil.rmtree(node)
    code, output = _run(tmp_path / "node-b", "--steps", "40", "--step-seconds", "0", mirror=bucket)
    assert code == 0, output
    node_b = tmp_path / "node-b"
    assert f"resumed from {node_b / 'out' / f'checkpoint-{standing}'} at step {standing}" in output
    assert (node_b / "out" / "final.txt").read_text() == reference
    store = FileStorage(bucket)
    for step in _steps(bucket):
        manifest = verify_checkpoint(store, step)
        assert manifest.format == "files" and manifest.extra["source"] == f"out/checkpoint-{step}"
    assert _steps(bucket)[-1] == 40


def test_a_checkpoint_written_after_sigterm_makes_the_stop_exit_75(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    node = tmp_path / "node"
    node.mkdir()
    sup = Supervised(
        _args(node, "--steps", "100", "--step-seconds", "0.1", "--save-on-term", mirror=bucket),
        cwd=node,
    )
    sup.expect(r"^saved checkpoint-5$", timeout=30)
    sup.expect(r"^step 7$", timeout=10)
    sup.proc.send_signal(signal.SIGTERM)
    saved = sup.expect(r"^saved step (\d+) after SIGTERM$", timeout=20)
    code = sup.wait(30)
    assert code == 75, sup.err
    step = int(saved.group(1))
    assert step >= 7
    assert _steps(node / "run")[-1] == step
    assert _steps(bucket)[-1] == step
    assert verify_checkpoint(FileStorage(bucket), step).extra["source"] == f"out/checkpoint-{step}"


def test_a_directory_written_in_place_is_never_adopted_half_written(tmp_path: Path) -> None:
    # a 0.6 s pause between the two files of each save, under a 1 s quiet period; then a
    # 1.5 s pause with the first file held open, under a 0.3 s one
    for trainer, quiet in (
        (["--pause", "0.6"], "1.0"),
        (["--pause", "1.5", "--hold-open"], "0.3"),
    ):
        node = tmp_path / f"node-{quiet}"
        code, output = _run(
            node,
            "--steps",
            "6",
            "--save-every",
            "2",
            "--step-seconds",
            "0.3",
            *trainer,
            quiet=quiet,
        )
        assert code == 0, output
        steps = _steps(node / "run")
        assert steps == [2, 4, 6]
        for step in steps:
            manifest = read_manifest_dir(node / "run" / "checkpoints" / f"step_{step:06d}")
            assert [f.path for f in manifest.files] == [
                f"checkpoint-{step}/state.json",
                f"checkpoint-{step}/weights.bin",
            ]


def test_a_finished_run_with_a_mirror_and_no_checkpoint_exits_1(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    options = ["--run-dir", str(node / "run"), "--adopt", "out/*", "--mirror", str(tmp_path / "b")]
    trainer = [sys.executable, str(TRAINER), "--steps", "3", "--save-every", "100"]
    sup = Supervised([*options, "--", *trainer], cwd=node)
    assert sup.wait(60) == 1, sup.err
    errors = [line.split(": ", 1)[1] for line in sup.stderr if " ERROR " in line]
    assert errors == [
        f"the trainer finished but committed no checkpoint, so none is in the mirror "
        f"{(tmp_path / 'b').as_uri()}; nothing matched --adopt out/* in {node}: the next start "
        "begins from scratch. Exiting 1: with --mirror, exit 0 means the final checkpoint is "
        "in the mirror"
    ]
    # out/final.txt has no step in its name: said once, never adopted
    told = [line for line in sup.stderr if "no step in it" in line]
    assert len(told) == 1 and "not adopting out/final.txt" in told[0], sup.err


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("/abs/out/*", "give a glob relative to the trainer's working directory"),
        ("../out/*", "give a glob relative to the trainer's working directory"),
        ("run/checkpoints/*", "reaches into the run dir"),
    ],
)
def test_a_bad_pattern_is_a_usage_error(tmp_path: Path, pattern: str, message: str) -> None:
    runner = [sys.executable, "-m", "runner", "run", "--run-dir", "run", "--adopt", pattern]
    proc = subprocess.run(
        [*runner, "--", sys.executable, "-c", "pass"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_checkpoints_the_trainer_left_are_adopted_before_it_starts(tmp_path: Path) -> None:
    """A trainer that ran unsupervised (or whose supervisor died) left out/checkpoint-10: it is
    adopted, verified and handed back before the trainer starts; the run ends exactly."""
    reference = _reference(tmp_path, 20)
    node = tmp_path / "node"
    node.mkdir()
    subprocess.run(
        [sys.executable, str(TRAINER), "--steps", "10", "--step-seconds", "0"],
        cwd=node,
        check=True,
        capture_output=True,
    )
    (node / "out" / "final.txt").unlink()
    code, output = _run(node, "--steps", "20", "--step-seconds", "0")
    assert code == 0, output
    adopted = output.index("adopted trainer checkpoint out/checkpoint-10 as step 10")
    assert adopted < output.index("started trainer pid")
    assert f"resumed from {node / 'out' / 'checkpoint-10'} at step 10" in output
    assert (node / "out" / "final.txt").read_text() == reference
    # a files checkpoint is listed and verified like any other; it is no train state to
    # convert to a seed file (exit 2, and why)
    runner = [sys.executable, "-m", "runner"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    verify = subprocess.run([*runner, "verify", "run"], cwd=node, env=env, capture_output=True)
    assert verify.returncode == 0 and b"step       20  ok" in verify.stdout, verify.stdout
    convert = subprocess.run(
        [*runner, "convert", "run", "x.bin"], cwd=node, env=env, capture_output=True, text=True
    )
    assert convert.returncode == 2 and "holds a trainer's own files" in convert.stderr


def test_a_directory_renamed_into_place_is_adopted_while_the_trainer_runs(tmp_path: Path) -> None:
    # a quiet period longer than the run: only the rename can make them finished earlier
    node = tmp_path / "node"
    code, output = _run(
        node, "--steps", "4", "--save-every", "2", "--step-seconds", "0", "--rename", quiet="60"
    )
    assert code == 0, output
    assert re.findall(r"^(?:NOT )?adopted checkpoint-\d+$", output, re.M) == [
        "adopted checkpoint-2",
        "adopted checkpoint-4",
    ], output
    assert _steps(node / "run") == [2, 4]


def test_the_readme_command_for_a_loop_saving_one_file_per_step(tmp_path: Path) -> None:
    section = (REPO / "README.md").read_text().split("## Your trainer's own checkpoints", 1)[1]
    line = next(x for x in section.splitlines() if "--adopt 'out/ckpt-*.pt'" in x)
    readme = shlex.split(line)
    split = readme.index("--")
    assert readme[:2] == ["runner", "run"] and readme[split + 1 :] == ["python", "train.py"]
    options = readme[2:split]
    bucket = tmp_path / "bucket"
    options[options.index("--mirror") + 1] = str(bucket)
    reference = _reference(tmp_path, 12)
    trainer = [sys.executable, str(TRAINER), "--file", "--step-seconds", "0", "--save-every", "4"]
    for node, steps in ((tmp_path / "a", "8"), (tmp_path / "b", "12")):
        node.mkdir()
        sup = Supervised(
            [*options, "--adopt-quiet-seconds", "0.2", "--", *trainer, "--steps", steps], cwd=node
        )
        assert sup.wait(60) == 0, sup.err
    # node b started empty: step 8 came from the bucket, back to out/ckpt-8.pt
    assert f"resumed from {tmp_path / 'b' / 'out' / 'ckpt-8.pt'} at step 8" in sup.out
    assert (tmp_path / "b" / "out" / "final.txt").read_text() == reference
    assert verify_checkpoint(FileStorage(bucket), 12).extra["source"] == "out/ckpt-12.pt"
