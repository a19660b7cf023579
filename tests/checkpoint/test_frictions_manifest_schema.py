"""A manifest with no `schema` is malformed (corrupt, exit 3, said so), not "a newer one":
only a schema this runner cannot read is foreign, kept and never deleted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.checkpoint.manifest import Manifest
from runner.errors import IntegrityError, SchemaError
from tests.fixtures.ckpt import SaveCheckpoint


def runner(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _rewrite(step_dir: Path, edit: dict[str, object], *, drop: str | None = None) -> None:
    path = step_dir / "manifest.json"
    data = json.loads(path.read_bytes())
    data.update(edit)
    if drop is not None:
        del data[drop]
    path.write_text(json.dumps(data))


def test_a_manifest_without_schema_is_corrupt_and_an_unknown_one_is_foreign(
    save_checkpoint: SaveCheckpoint,
) -> None:
    path = save_checkpoint(1).path / "manifest.json"
    data = json.loads(path.read_bytes())
    del data["schema"]
    with pytest.raises(IntegrityError) as missing:
        Manifest.from_json(json.dumps(data).encode(), source="m.json")
    assert type(missing.value) is IntegrityError  # not SchemaError, the "foreign" category
    assert "m.json: has no 'schema' field: not a manifest spot-runner writes" in str(missing.value)
    assert "upgrade" not in str(missing.value)
    for bad in ("", None, True, [2]):
        with pytest.raises(IntegrityError) as malformed:
            Manifest.from_json(json.dumps({**data, "schema": bad}).encode(), source="m.json")
        assert type(malformed.value) is IntegrityError
        assert "has a malformed 'schema' field" in str(malformed.value)
    with pytest.raises(SchemaError, match=r"unknown schema version '99'.*newer spot-runner wrote"):
        Manifest.from_json(json.dumps({**data, "schema": "99"}).encode())
    with pytest.raises(SchemaError, match=r"'x7'.*not written by any spot-runner this one knows"):
        Manifest.from_json(json.dumps({**data, "schema": "x7"}).encode())


def test_verify_names_the_missing_schema_and_exits_3(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    step_dir = save_checkpoint(1).path
    _rewrite(step_dir, {}, drop="schema")
    result = runner("verify", tmp_path / "run")
    assert result.returncode == 3, result
    assert "Traceback" not in result.stderr
    expected = f"{step_dir}/manifest.json: has no 'schema' field: not a manifest spot-runner writes"
    assert f"step        1  CORRUPT: {expected}" in result.stdout
    assert "upgrade" not in result.stdout + result.stderr
    assert "step 1 at file://" in result.stderr and "is corrupt" in result.stderr


@pytest.mark.slow
def test_retention_deletes_a_schemaless_checkpoint_but_keeps_a_foreign_one(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    """prune --keep 2 over 1 (no schema), 2 (schema 99), 3, 4, 5: 5 and 4 are kept, 3 is
    deleted as usual, 2 is kept (a newer runner may read it), 1 is deleted like any corrupt
    one. Before, a missing schema counted as foreign and step 1 stayed forever."""
    for step in range(1, 6):
        save_checkpoint(step)
    ckpts = tmp_path / "run/checkpoints"
    _rewrite(ckpts / "step_000001", {}, drop="schema")
    _rewrite(ckpts / "step_000002", {"schema": "99"})
    result = runner("prune", tmp_path / "run", "--keep", "2")
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[0] == "deleted steps 3, 1"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004", "step_000005"]
