"""The torch-dcp payload with real ranks: 2 gloo processes on CPU save and load through
runner.checkpoint.formats.dcp; hashes checked against the bytes on disk; resharding 2 -> 1
and 1 -> 2; the file-to-rank table; schema 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runner.atomicity.files import sha256_file
from runner.checkpoint.formats.dcp import (
    DCP_METADATA,
    TRAIN_STATE_FILE,
    load_dcp,
    rank_file_name,
    rank_of_file,
    rank_totals,
    read_dcp_full,
    save_dcp,
)
from runner.checkpoint.manifest import FORMAT_DCP, FileEntry, Manifest, schema_for
from runner.errors import CheckpointWriteError, PayloadNotLoadableError, SchemaError
from tests.fixtures.dcp_ranks import (
    dcp_state,
    load_worker,
    save_worker,
    saved_entries,
    spawn_ranks,
    tensors,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_two_ranks_save_hashed_files_that_one_process_loads(tmp_path: Path) -> None:
    stage, out = tmp_path / "step_000001", tmp_path / "out"
    stage.mkdir()
    spawn_ranks(save_worker, 2, stage, out, seed=3)

    by_rank = {rank: saved_entries(out, rank) for rank in (0, 1)}
    names = {rank: [e.path for e in entries] for rank, entries in by_rank.items()}
    assert names == {0: [DCP_METADATA, "__0_0.distcp"], 1: ["__1_0.distcp"]}
    assert sorted(p.name for p in stage.iterdir()) == sorted(names[0] + names[1])
    for entry in by_rank[0] + by_rank[1]:
        assert sha256_file(stage / entry.path) == (entry.size, entry.sha256), entry.path
    assert by_rank[1][0].size > 1000  # rank 1 wrote its share of the replicated tensors

    want = tensors(dcp_state(seed=3))
    full = read_dcp_full(stage)
    assert sorted(full) == ["model", "optimizer"]
    _assert_equal_tensors(tensors(full), want)
    template = dcp_state(seed=99)
    load_dcp(stage, template)  # no process group: one process reads what two wrote
    _assert_equal_tensors(tensors(template), want)


@pytest.mark.slow
def test_one_process_save_loads_at_two_ranks(tmp_path: Path) -> None:
    stage, out = tmp_path / "step_000001", tmp_path / "out"
    stage.mkdir()
    entries = save_dcp(stage, dcp_state(seed=5))
    assert [e.path for e in entries] == [DCP_METADATA, "__0_0.distcp"]
    assert [sha256_file(stage / e.path) for e in entries] == [(e.size, e.sha256) for e in entries]
    assert sorted(p.name for p in stage.iterdir()) == [DCP_METADATA, "__0_0.distcp"]

    spawn_ranks(load_worker, 2, stage, out, seed=5)
    want = tensors(dcp_state(seed=5))
    assert len(want) == 4 + 3 * 4  # 4 parameters; exp_avg, exp_avg_sq and step of each
    for rank in (0, 1):
        _assert_equal_tensors(torch.load(out / f"loaded_{rank}.pt", weights_only=True), want)


def test_a_second_save_into_the_same_directory_is_refused(tmp_path: Path) -> None:
    stage = tmp_path / "step_000001"
    stage.mkdir()
    save_dcp(stage, dcp_state(seed=5))
    with pytest.raises(
        CheckpointWriteError,
        match=r"saving with DCP failed: rank 0: RuntimeError: Checkpoint already exists",
    ) as caught:
        save_dcp(stage, dcp_state(seed=6))
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_rank_totals_group_files_by_the_rank_that_wrote_them() -> None:
    files = [
        FileEntry(path=name, size=size, sha256="0" * 64)
        for name, size in [
            (DCP_METADATA, 10),
            ("__0_0.distcp", 100),
            ("__1_0.distcp", 200),
            (TRAIN_STATE_FILE, 5),
            ("rank_00001.pt", 7),
            ("stray.bin", 1),
        ]
    ]
    assert rank_totals(files) == [(0, 3, 115), (1, 2, 207), (None, 1, 1)]


def test_rank_of_file() -> None:
    table = {
        "__3_0.distcp": 3,
        "__0_12.distcp": 0,
        "__17_1.distcp": 17,
        rank_file_name(3): 3,
        "rank_00000.pt": 0,
        DCP_METADATA: 0,
        TRAIN_STATE_FILE: 0,
        "state.pt": None,
        "__3.distcp": None,
        "rank_3.pt": None,
        ".metadata.tmp": None,
        "sub/__1_0.distcp": None,
    }
    assert {name: rank_of_file(name) for name in table} == table
    assert rank_file_name(12) == "rank_00012.pt"


def test_schema_4_manifest_round_trips_and_names_dot_metadata() -> None:
    assert schema_for(FORMAT_DCP) == "4"
    manifest = Manifest(
        schema=schema_for(FORMAT_DCP),
        step=100,
        samples_seen=800,
        world_size=2,
        run_id="r",
        writer="w",
        format=FORMAT_DCP,
        fingerprint="f" * 64,
        files=[
            FileEntry(path=DCP_METADATA, size=10, sha256="a" * 64),
            FileEntry(path="__1_0.distcp", size=20, sha256="b" * 64),
        ],
    )
    raw = manifest.to_json()
    assert json.loads(raw)["schema"] == "4"
    again = Manifest.from_json(raw)
    assert again == manifest
    assert again.to_json() == raw


def test_schema_4_names_torch_dcp_only() -> None:
    """A torch-dcp manifest claiming an older schema is refused as unreadable (those schemas
    have no such format); a torch-chunked one claiming 4 is read as the schema 3 it needs."""
    base = json.loads(
        Manifest(
            schema="4",
            step=1,
            samples_seen=8,
            world_size=2,
            run_id="r",
            writer="w",
            format=FORMAT_DCP,
            fingerprint="",
            files=[FileEntry(path=DCP_METADATA, size=1, sha256="a" * 64)],
        ).to_json()
    )
    for old in ("2", "3"):
        with pytest.raises(SchemaError, match=rf"schema '{old}' for format 'torch-dcp'"):
            Manifest.from_json(json.dumps({**base, "schema": old}).encode())
    chunked = Manifest.from_json(
        json.dumps({**base, "format": "torch-chunked", "world_size": 1}).encode()
    )
    assert (chunked.schema, chunked.format) == ("3", "torch-chunked")
    state = Manifest.from_json(json.dumps({**base, "format": "torch-state"}).encode())
    assert state.schema == "2"  # as every torch-state manifest is stated
    with pytest.raises(SchemaError, match=r"schema '4' for format 'torch-future'"):
        Manifest.from_json(json.dumps({**base, "format": "torch-future"}).encode())


def test_a_template_of_other_shapes_is_a_typed_error(tmp_path: Path) -> None:
    save_dcp(tmp_path, {"model": {"w": torch.zeros(4, 8)}})
    with pytest.raises(PayloadNotLoadableError, match=r"do not load into this state: rank 0: "):
        load_dcp(tmp_path, {"model": {"w": torch.zeros(4, 9)}})
