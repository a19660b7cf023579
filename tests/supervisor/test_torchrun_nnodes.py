"""`torchrun_nnodes`: the number of nodes a torchrun command asks for, read from the command
alone (runner run's multi-node mode, runner/supervisor/multinode.py), and `runner run` refusing
a job on several nodes without --mirror before it starts anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runner.supervisor.torchrun import torchrun_nnodes
from tests.fixtures.cli_process import runner

PY = sys.executable
DEMO = ["-m", "runner", "demo", "--steps", "4"]
# --nnodes among options with and without values, short ones with theirs attached
AMONG_OTHERS = [
    "torchrun", "--node-rank", "1", "--nproc-per-node", "4", "--master-addr", "10.0.0.1",
    "--master_port=29500", "-r3", "-t", "3", "--nnodes", "2", "--no-python", "--rdzv-conf",
    "timeout=900", "train.sh",
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "nnodes"),
    [
        (["torchrun", "--nnodes", "2", *DEMO], 2),
        (["torchrun", "--nnodes=2", *DEMO], 2),
        (["torchrun", "--nnodes", "1:4", *DEMO], 4),
        (["torchrun", "--nnodes=1:4", *DEMO], 4),
        (["torchrun", "--nnodes", "3:3", "train.py"], 3),
        (["torchrun", "--nnodes", "1", "train.py"], 1),
        (["/usr/local/bin/torchrun", "--nnodes=8", "train.py"], 8),
        ([PY, "-m", "torch.distributed.run", "--nnodes", "2", *DEMO], 2),
        ([PY, "-u", "-m", "torch.distributed.run", "--nnodes=2", *DEMO], 2),
        ([PY, "-m", "torch.distributed.launch", "--nnodes", "2", "train.py"], 2),
        (AMONG_OTHERS, 2),
        (["torchrun", "--nnodes", "2", "--nnodes", "5", "train.py"], 5),  # argparse: the last
        (["torchrun", "--nnode", "2", "train.py"], 2),  # a unique prefix, as argparse takes it
        (["torchrun", "--nno=3", "train.py"], 3),
        (["torchrun", "--standalone", "--nproc-per-node", "2", *DEMO], 1),
        (["torchrun", "--nnodes", "2", "--standalone", *DEMO], 1),
        # not given, or not torchrun's
        (["torchrun", "--nproc-per-node", "2", *DEMO], None),
        (["torchrun", "-m", "runner", "demo", "--nnodes", "2"], None),  # the script's option
        (["torchrun", "train.py", "--nnodes=2"], None),
        (["torchrun", "--", "train.py", "--nnodes", "2"], None),
        (["torchrun", "--n", "2", "train.py"], None),  # ambiguous prefix: not --nnodes
        ([PY, "train.py", "--nnodes", "2"], None),
        (["bash", "-c", "torchrun --nnodes 2 train.py"], None),
        ([PY, "-m", "runner", "demo", "--nnodes=2"], None),
        ([], None),
        # torchrun refuses these itself (its usage error): no mode is chosen from them
        (["torchrun", "--nnodes", "two", "train.py"], None),
        (["torchrun", "--nnodes=1:2:3", "train.py"], None),
        (["torchrun", "--nnodes"], None),
    ],
)
def test_nnodes_of_each_form(command: list[str], nnodes: int | None) -> None:
    assert torchrun_nnodes(command) == nnodes


def test_several_nodes_without_mirror_exit_2_before_anything_starts(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "started"
    trainer = [PY, "-c", f"open({str(marker)!r}, 'w')"]
    result = runner(
        "run", "--run-dir", str(run_dir), "--metrics-port", "0", "--",
        "torchrun", "--nnodes=2", "--node-rank", "0", "--no-python", *trainer,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "several nodes need --mirror: `torchrun --nnodes 2`" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not marker.exists() and not run_dir.exists()
