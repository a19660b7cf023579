"""RankContext: read from torchrun's variables (rank 0 of 1 without them), checked, and
consulted by each consumer of the run's single-writer work (services, loss log, retention,
the seconds cadence). Real objects: a real metrics server port, file:// mirror, run dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from runner.checkpoint.listing import list_checkpoints
from runner.collective.group import SINGLE
from runner.config import RunConfig
from runner.errors import EXIT_USAGE, ConfigError
from runner.preemption.stop import StopController
from runner.runtime.rank import ENV_VARIABLES, SINGLE_PROCESS, RankContext, launch_context
from runner.runtime.services import run_services
from runner.session.train_session import TrainSession
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage

TORCHRUN_RANK_3_OF_8 = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
}
SECOND_OF_TWO = RankContext(
    rank=1, world_size=2, local_rank=1, local_world_size=2, coordinated=True
)


# -- the context ------------------------------------------------------------------------------


def test_no_torchrun_variables_is_rank_0_of_1() -> None:
    for environ in ({}, {"PATH": "/bin"}, dict.fromkeys(TORCHRUN_RANK_3_OF_8, "")):
        ctx = RankContext.from_env(environ)
        assert ctx == RankContext() == SINGLE_PROCESS
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (0, 1, 0, 1)
        assert ctx.node_rank == 0 and not ctx.coordinated
        assert ctx.is_primary and ctx.is_local_primary and ctx.acts_as_primary


def test_torchrun_variables_make_a_coordinated_rank() -> None:
    ctx = RankContext.from_env(TORCHRUN_RANK_3_OF_8)
    assert ctx == RankContext(
        rank=3, world_size=8, local_rank=1, local_world_size=2, node_rank=1, coordinated=True
    )
    assert not ctx.is_primary and not ctx.is_local_primary
    # rank 3 leaves the run's single-writer work to rank 0 and its node's to local rank 0
    assert not ctx.acts_as_primary and not ctx.acts_as_node_primary
    node_first = RankContext.from_env({**TORCHRUN_RANK_3_OF_8, "RANK": "2", "LOCAL_RANK": "0"})
    assert node_first.acts_as_node_primary and not node_first.acts_as_primary


def test_stray_variables_without_world_size_are_ignored() -> None:
    # torchrun always sets WORLD_SIZE; a lone RANK left by another tool must not stop a run
    for environ in ({"RANK": "1"}, {"RANK": "x", "LOCAL_RANK": "5"}, {"GROUP_RANK": "-3"}):
        assert RankContext.from_env(environ) == SINGLE_PROCESS, environ


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        # a launcher that sets the global variables and LOCAL_RANK, not LOCAL_WORLD_SIZE
        (
            {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"},
            RankContext(rank=1, world_size=4, local_rank=1, local_world_size=4, coordinated=True),
        ),
        (
            {"WORLD_SIZE": "8", "RANK": "7", "LOCAL_RANK": "7", "GROUP_RANK": "0"},
            RankContext(rank=7, world_size=8, local_rank=7, local_world_size=8, coordinated=True),
        ),
        (
            {"WORLD_SIZE": "4", "RANK": "3"},
            RankContext(rank=3, world_size=4, local_world_size=4, coordinated=True),
        ),
        ({"WORLD_SIZE": "1"}, SINGLE_PROCESS),
        (
            {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": ""},
            RankContext(world_size=3, local_world_size=3, coordinated=True),
        ),
    ],
)
def test_a_missing_local_world_size_is_the_world_size(
    environ: dict[str, str], expected: RankContext
) -> None:
    ctx = RankContext.from_env(environ)
    assert ctx == expected
    assert ctx.coordinated == (ctx.world_size > 1)
    assert ctx.acts_as_primary == (ctx.rank == 0)


def test_primary_and_local_primary() -> None:
    node_1_first = RankContext(rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1)
    assert not node_1_first.is_primary and node_1_first.is_local_primary
    assert RankContext(rank=0, world_size=4, local_world_size=2, coordinated=True).acts_as_primary
    assert not SECOND_OF_TWO.acts_as_primary


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"RANK": "2", "WORLD_SIZE": "2"},
            "RANK must be 0..WORLD_SIZE-1 (got RANK=2, WORLD_SIZE=2)",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "1"},
            "RANK must be 0..WORLD_SIZE-1 (got RANK=1, WORLD_SIZE=1)",
        ),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK must be 0..WORLD_SIZE-1 (got RANK=-1"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1 (got 0)"),
        (
            {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
            "LOCAL_WORLD_SIZE must be 1..WORLD_SIZE (got LOCAL_WORLD_SIZE=4, WORLD_SIZE=2)",
        ),
        (
            {"WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK must be 0..LOCAL_WORLD_SIZE-1 (got LOCAL_RANK=2, LOCAL_WORLD_SIZE=2)",
        ),
        ({"WORLD_SIZE": "2", "GROUP_RANK": "-3"}, "GROUP_RANK must be >= 0 (got -3)"),
        # without LOCAL_WORLD_SIZE, LOCAL_RANK is checked against WORLD_SIZE and named so
        (
            {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "4"},
            "LOCAL_RANK must be 0..WORLD_SIZE-1 (got LOCAL_RANK=4, WORLD_SIZE=4)",
        ),
        (
            {"WORLD_SIZE": "4", "LOCAL_RANK": "-1"},
            "LOCAL_RANK must be 0..WORLD_SIZE-1 (got LOCAL_RANK=-1, WORLD_SIZE=4)",
        ),
        # ... after WORLD_SIZE and RANK, as with every variable set
        (
            {"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "5"},
            "RANK must be 0..WORLD_SIZE-1 (got RANK=2, WORLD_SIZE=2)",
        ),
        ({"WORLD_SIZE": "0", "LOCAL_RANK": "3"}, "WORLD_SIZE must be >= 1 (got 0)"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' must be a whole number"),
        ({"WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' must be a whole number"),
    ],
)
def test_contradicting_or_malformed_variables_are_config_errors(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        RankContext.from_env(environ)
    assert str(refused.value).startswith(message), str(refused.value)
    assert refused.value.exit_code == EXIT_USAGE


def test_the_context_is_frozen() -> None:
    with pytest.raises(AttributeError):
        SINGLE_PROCESS.rank = 1  # type: ignore[misc]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stray", "why"),
    [
        (
            {"RANK": "2", "WORLD_SIZE": "2"},
            "RANK must be 0..WORLD_SIZE-1 (got RANK=2, WORLD_SIZE=2)",
        ),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be a whole number"),
    ],
)
def test_runner_demo_runs_alone_under_an_invalid_launch_environment(
    tmp_path: Path, stray: dict[str, str], why: str
) -> None:
    # a stray or malformed launch environment (not torchrun's) is warned about and the demo
    # runs as rank 0 of 1 (runner.runtime.rank.launch_context) instead of exiting 2
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "runner", "demo", "--run-dir", str(run_dir), *TINY_DEMO],
        env={**no_rank_env(), **stray},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    warning = (
        f"WARNING runner.runtime.rank: ignoring the launch variables ({why}): "
        "running as rank 0 of 1"
    )
    assert warning in result.stderr, result.stderr
    assert list_checkpoints(FileStorage(run_dir)) == [2]


def test_launch_context_is_from_env_when_valid() -> None:
    launched = {**TORCHRUN_RANK_3_OF_8, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert launch_context(launched) == RankContext.from_env(TORCHRUN_RANK_3_OF_8)
    assert launch_context({"RANK": "9", "WORLD_SIZE": "2"}) == SINGLE_PROCESS
    # valid rank variables without a rendezvous are not a launch: alone, as before
    assert launch_context(TORCHRUN_RANK_3_OF_8) == SINGLE_PROCESS
    assert launch_context({**launched, "MASTER_PORT": ""}) == SINGLE_PROCESS


TINY_DEMO = ["--steps", "2", "--device", "cpu", "--threads", "1", "--batch-size", "2"]


@pytest.mark.slow
def test_runner_demo_runs_without_local_world_size(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "runner", "demo", "--run-dir", str(run_dir), *TINY_DEMO],
        env={**no_rank_env(), "WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    # no MASTER_ADDR/MASTER_PORT: not a torchrun launch, so the variables are stray and the
    # demo runs alone (a real launch sets them; tests/e2e/test_multirank*.py)
    assert "not a torchrun launch" in result.stderr
    assert list_checkpoints(FileStorage(run_dir)) == [2]
    assert [json.loads(line)["step"] for line in (run_dir / "loss.jsonl").open()] == [1, 2]


REPO = Path(__file__).resolve().parents[2]
SEED_WRITER = REPO / "tests" / "trainers" / "seed_writer.py"
RANK_REPORT = "RANK=${RANK-unset} WORLD_SIZE=${WORLD_SIZE-unset} LOCAL_RANK=${LOCAL_RANK-unset}"


def no_rank_env() -> dict[str, str]:
    """This environment without torchrun's variables or RUNNER_* settings."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ENV_VARIABLES and not k.startswith("RUNNER_")
    }


@pytest.mark.parametrize(
    "stray",
    [
        {"RANK": "2", "WORLD_SIZE": "2"},
        {"RANK": "one", "WORLD_SIZE": "0", "LOCAL_RANK": "9"},
        {"WORLD_SIZE": "2.0", "LOCAL_WORLD_SIZE": "5"},
    ],
    ids=["rank-outside-world", "malformed", "not-whole"],
)
def test_runner_run_does_not_read_the_rank_variables(tmp_path: Path, stray: dict[str, str]) -> None:
    """`runner run` is a supervisor, not a rank: under variables `runner demo` refuses it
    supervises, mirrors and exits as without them, and its trainer inherits them as set."""
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    trainer = f'echo "{RANK_REPORT}"; exec "{sys.executable}" "{SEED_WRITER}" rename 3'
    args = ["run", "--run-dir", str(run_dir), "--mirror", mirror.as_uri()]
    result = subprocess.run(
        [sys.executable, "-m", "runner", *args, "--", "sh", "-c", trainer],
        cwd=REPO,
        env={**no_rank_env(), "PYTHONPATH": str(REPO), "TEST_MIRROR_DIR": str(mirror), **stray},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # the trainer exits 5 unless the supervisor mirrored its checkpoint while it ran
    assert result.returncode == 0, result.stdout + result.stderr
    report = {k: stray.get(k, "unset") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    assert " ".join(f"{k}={v}" for k, v in report.items()) in result.stdout.splitlines()
    assert "error" not in result.stderr.lower(), result.stderr
    assert list_checkpoints(FileStorage(run_dir)) == [3]
    assert list_checkpoints(FileStorage(mirror)) == [3]


# -- the consumers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def services_config(tmp_path: Path, port: int) -> RunConfig:
    return RunConfig(
        run_dir=tmp_path / "run",
        mirror=f"file://{tmp_path / 'bucket'}",
        metrics_port=port,
        metrics_host="127.0.0.1",
        notices="gcp",
        notice_endpoint="http://127.0.0.1:9",  # nothing answers: the poller just keeps trying
        notice_poll_seconds=60.0,
    )


def test_run_services_of_the_primary_serve_poll_and_mirror(tmp_path: Path) -> None:
    port = free_port()
    stop = StopController()
    with run_services(services_config(tmp_path, port), stop, rank=SINGLE_PROCESS) as services:
        assert accepts(port)
        assert "runner-notice-poller" in {t.name for t in threading.enumerate()}
        assert services.mirror is not None
    assert not accepts(port)


def test_run_services_of_a_non_primary_rank_start_nothing(tmp_path: Path) -> None:
    port = free_port()
    stop = StopController()
    threads_before = set(threading.enumerate())
    with run_services(services_config(tmp_path, port), stop, rank=SECOND_OF_TWO) as services:
        assert not accepts(port)
        # no poller, no mirror worker (a thread of an earlier test may have ended meanwhile)
        assert set(threading.enumerate()) - threads_before == set()
        assert services.mirror is None
        assert services.metrics is not None
    assert not (tmp_path / "bucket").exists()


def new_state() -> ModuleTrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return ModuleTrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train(session: TrainSession, state: ModuleTrainState, steps: int) -> None:
    for _ in range(steps):
        loss = state.model(torch.ones(2, 3)).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.advance(loss=float(loss.detach()), samples=2)
        session.step_done()


def session_config(run_dir: Path) -> RunConfig:
    return RunConfig(run_dir=run_dir, ckpt_every=2, ckpt_every_seconds=0.001, keep=2, steps=8)


def test_a_primary_session_logs_losses_prunes_and_keeps_the_seconds_cadence(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    state = new_state()
    with TrainSession(session_config(run_dir), state=state) as session:
        assert session.policy.every_seconds == 0.001
        train(session, state, 8)
        assert session.finish() == 0
    lines = [json.loads(line) for line in (run_dir / "loss.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert len(list_checkpoints(FileStorage(run_dir))) == 2


def test_a_non_primary_session_leaves_loss_log_retention_and_seconds_to_the_primary(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    state = new_state()
    # the rank's decisions alone, without its peers: no process group (group=SINGLE)
    with TrainSession(
        session_config(run_dir), state=state, rank=SECOND_OF_TWO, group=SINGLE
    ) as session:
        assert session.policy.every_seconds is None
        assert session.policy.every_steps == 2
        train(session, state, 8)
        assert session.finish() == 0
    assert not (run_dir / "loss.jsonl").exists()
    # every step cadence point kept: nothing pruned on this rank
    assert list_checkpoints(FileStorage(run_dir)) == [2, 4, 6, 8]
