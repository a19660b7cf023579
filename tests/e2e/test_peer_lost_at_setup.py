"""A peer that dies while the ranks set up (inside DDP's construction: its parameter
broadcast) ends rank 0 of a real 2-rank `runner demo` with the one-line PeerLostError (exit 1),
not a gloo traceback. Rank 1 is a stand-in process that joins the gloo group as a torchrun rank
would and then exits at once, so the death lands in DDP's first collective deterministically
(under torchrun, its agent would SIGTERM rank 0 as soon as rank 1 exits, racing the error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.demo_process import demo_cmd
from tests.fixtures.multirank import PEER_LOST_END
from tests.fixtures.torchrun import free_port

pytestmark = pytest.mark.e2e

PEER_THAT_DIES = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
os._exit(0)
"""


def test_a_peer_that_dies_in_ddp_construction_is_the_one_line_peer_lost_error(
    tmp_path: Path,
) -> None:
    port = free_port()

    def env(rank: int) -> dict[str, str]:
        return {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "peer-lost-test",
        }  # fmt: skip

    rank0 = subprocess.Popen(
        demo_cmd(tmp_path / "run", steps=20, ckpt_every=10),
        env=env(0),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        peer = subprocess.run(
            [sys.executable, "-c", PEER_THAT_DIES], env=env(1), capture_output=True, timeout=120
        )
        assert peer.returncode == 0, peer.stderr
        _, err = rank0.communicate(timeout=120)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
    assert rank0.returncode == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "a collective " in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "runner: error: rank 0 of 2: a collective of the ranks' set-up (DDP/FSDP) failed: "
    ), err
    assert lines[0].endswith(PEER_LOST_END), err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
