"""runner.collective.Group in real processes: a world of 2 over gloo (tests/fixtures/torchrun.py,
`gloo_world`), each rank a process of its own. The `_worker_*` functions run in those processes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.collective import SINGLE, dedicated_group
from runner.errors import ConfigError, PeerLostError, exit_code_for
from tests.fixtures.torchrun import GlooWorld, Torchrun

HERE = "tests.collective.test_group"


def _worker_ops() -> None:
    group = dedicated_group(timeout_s=30)
    r = group.rank
    group.barrier()
    print(json.dumps({
        "single": group.single,
        "world_size": group.world_size,
        "agree": group.agree([r, 10 - r, -5 * r]),
        "agree_zeros": group.agree([0, 0]),
        "broadcast": group.broadcast({"from": r, "payload": [r] * 3}, src=1),
        "all_gather": group.all_gather(("rank", r)),
    }))  # fmt: skip


@pytest.mark.slow
def test_two_ranks_agree_on_the_max_broadcast_and_gather(
    gloo_world: Callable[..., GlooWorld],
) -> None:
    world = gloo_world(f"{HERE}:_worker_ops", 2)
    finished = world.wait(timeout=60)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    for rank, f in enumerate(finished):
        assert json.loads(f.stdout) == {
            "single": False,
            "world_size": 2,
            "agree": [1, 10, 0],
            "agree_zeros": [0, 0],
            "broadcast": {"from": 1, "payload": [1, 1, 1]},
            "all_gather": [["rank", 0], ["rank", 1]],
        }, rank


def test_single_is_the_identity_without_torch_distributed() -> None:
    payload = {"a": [1, 2]}
    assert (SINGLE.rank, SINGLE.world_size, SINGLE.single) == (0, 1, True)
    assert SINGLE.process_group is None
    assert SINGLE.agree([3, -1, 0]) == (3, -1, 0)
    assert SINGLE.agree([]) == ()
    assert SINGLE.broadcast(payload) is payload
    assert SINGLE.all_gather(payload) == [payload]
    assert SINGLE.all_gather(payload)[0] is payload
    SINGLE.barrier()  # returns at once: nobody to wait for


def test_a_dedicated_group_needs_torch_distributed_initialised() -> None:
    with pytest.raises(ConfigError, match=r"needs torch\.distributed initialised"):
        dedicated_group(timeout_s=5)


def _worker_until_lost(timeout_s: str) -> None:
    """Agree every millisecond until the channel fails; then report when, and exit as the
    runner's CLI would (exit_code_for)."""
    group = dedicated_group(timeout_s=float(timeout_s))
    group.agree([1])
    print("ready", flush=True)
    try:
        while True:
            group.agree([0])
            time.sleep(0.001)
    except PeerLostError as exc:
        print(json.dumps({"lost_at": time.time()}), flush=True)
        print(exc, file=sys.stderr, flush=True)
        os._exit(exit_code_for(exc))  # the world is broken: no orderly shutdown of the group


def _wait_ready(world: GlooWorld, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all("ready" in world.stdout(r) for r in world.procs):
        for rank, proc in world.procs.items():
            assert proc.poll() is None, (rank, world.stderr(rank))
        assert time.monotonic() < deadline, "the ranks never got ready"
        time.sleep(0.02)


# Measured here (2 cores, gloo on loopback): the survivor of a SIGKILL raises 15-20 ms later
# (gloo sees the closed connection); a peer that hangs (SIGSTOP) is noticed after the timeout.
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["rank 1 killed", "rank 0 (store host) killed"])
def test_a_sigkilled_peer_makes_the_survivor_raise_peer_lost(
    gloo_world: Callable[..., GlooWorld], victim: int
) -> None:
    world = gloo_world(f"{HERE}:_worker_until_lost", 2, "600")
    _wait_ready(world)
    killed_at = time.time()
    world.kill(victim, signal.SIGKILL)
    survivor = 1 - victim
    done = world.wait_rank(survivor, timeout=30)
    assert world.wait_rank(victim).returncode == -signal.SIGKILL
    assert done.returncode == 1, done.stderr
    waited = json.loads(done.stdout.splitlines()[-1])["lost_at"] - killed_at
    assert 0 <= waited < 30, waited
    assert f"rank {survivor} of 2: a collective (agree) with the other ranks failed" in done.stderr
    assert "A peer process died or hung" in done.stderr
    assert "The last committed checkpoint stands" in done.stderr


@pytest.mark.slow
def test_every_survivor_of_four_ranks_raises_peer_lost(
    gloo_world: Callable[..., GlooWorld],
) -> None:
    """Rank 2's neighbours see its connection close; the others see theirs exit in turn."""
    world = gloo_world(f"{HERE}:_worker_until_lost", 4, "600")
    _wait_ready(world)
    killed_at = time.time()
    world.kill(2, signal.SIGKILL)
    for rank in (0, 1, 3):
        # within 60 s of the kill, far from the group's 600 s timeout: ended by the death
        done = world.wait_rank(rank, timeout=60)
        assert done.returncode == 1, (rank, done.stderr)
        assert f"rank {rank} of 4: a collective (agree) with the other ranks failed" in (
            done.stderr
        )
        assert json.loads(done.stdout.splitlines()[-1])["lost_at"] - killed_at < 60


@pytest.mark.slow
def test_a_hung_peer_makes_the_survivor_raise_after_the_timeout(
    gloo_world: Callable[..., GlooWorld],
) -> None:
    world = gloo_world(f"{HERE}:_worker_until_lost", 2, "2")
    _wait_ready(world)
    stopped_at = time.time()
    world.kill(1, signal.SIGSTOP)  # alive, connection open, never answers: only the timeout
    done = world.wait_rank(0, timeout=30)
    assert done.returncode == 1, done.stderr
    waited = json.loads(done.stdout.splitlines()[-1])["lost_at"] - stopped_at
    assert 1.5 <= waited < 20, waited
    assert "rank 0 of 2: a collective (agree) with the other ranks failed (timeout 2 s)" in (
        done.stderr
    )


@pytest.mark.slow
def test_the_torchrun_harness_finds_ranks_and_their_logs(
    torchrun: Callable[..., Torchrun], tmp_path: Path
) -> None:
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "print('rank', os.environ['RANK'], 'pid', os.getpid(), flush=True)\n"
        "print('err of', os.environ['RANK'], file=sys.stderr, flush=True)\n"
        "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(40 + int(os.environ['RANK'])))\n"
        "time.sleep(120)\n"
    )
    launch = torchrun(2, [str(script)])
    pids = launch.worker_pids()
    assert sorted(pids) == [0, 1]
    deadline = time.monotonic() + 30
    while not all(f"pid {pids[r]}" in launch.rank_stdout(r) for r in (0, 1)):
        assert time.monotonic() < deadline, launch.output()
        time.sleep(0.05)
    assert launch.rank_stdout(1) == f"rank 1 pid {pids[1]}\n"
    launch.signal_rank(1, signal.SIGUSR1)
    rc = launch.wait(timeout=60)
    assert rc == 1  # a worker failed: torchrun stops the others and exits 1
    assert "err of 1" in launch.rank_stderr(1)
    assert "exitcode  : 41" in launch.output()


@pytest.mark.slow
def test_the_torchrun_harness_signals_the_agent_which_forwards_to_every_rank(
    torchrun: Callable[..., Torchrun], tmp_path: Path
) -> None:
    """What the runner builds on: SIGTERM to torchrun reaches every rank, and torchrun itself
    then exits 1 whatever the ranks exit (here 75), so `runner run` cannot read the outcome
    from torchrun's exit status alone."""
    script = tmp_path / "term.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        "    print('rank', os.environ['RANK'], 'got SIGTERM', flush=True)\n"
        "    sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(120)\n"
    )
    launch = torchrun(2, [str(script)])
    launch.worker_pids()
    deadline = time.monotonic() + 30
    while not all("up" in launch.rank_stdout(r) for r in (0, 1)):
        assert time.monotonic() < deadline, launch.output()
        time.sleep(0.05)
    launch.signal(signal.SIGTERM)
    assert launch.wait(timeout=60) == 1
    for rank in (0, 1):
        assert launch.rank_stdout(rank) == f"up\nrank {rank} got SIGTERM\n"
    assert "Received 15 death signal, shutting down workers" in launch.output()
