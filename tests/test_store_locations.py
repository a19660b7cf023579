"""One rule for locations: `--mirror` takes a plain directory path like every other command's
LOCATION, meaning the same as file:///abs/path, resolved against the cwd once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.config import RunConfig
from runner.errors import ConfigError


def test_relative_mirror_is_resolved_once_at_config_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = RunConfig(run_dir=Path("run"), mirror="shared/../mirror")
    assert config.mirror == f"file://{tmp_path}/mirror"
    monkeypatch.chdir("/")
    assert config.mirror == f"file://{tmp_path}/mirror"  # a later chdir changes nothing


@pytest.mark.parametrize("given", ["/srv/ckpt", "file:///srv/ckpt"])
def test_absolute_path_and_file_uri_mean_the_same(given: str) -> None:
    assert RunConfig(run_dir=Path("run"), mirror=given).mirror == "file:///srv/ckpt"


@pytest.mark.parametrize("given", ["file:rel", "http://host/x", "file://host/x", ""])
def test_other_schemes_are_refused(given: str) -> None:
    with pytest.raises(ConfigError, match="--mirror"):
        RunConfig(run_dir=Path("run"), mirror=given)


def test_the_run_dir_is_not_its_own_mirror(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is the run dir itself"):
        RunConfig(run_dir=tmp_path / "run", mirror=str(tmp_path / "run"))


def test_demo_mirrors_to_a_relative_path_and_ls_reads_it_as_a_path(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")}

    def runner(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "runner", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=300,
        )

    result = runner(
        "demo", "--run-dir", "run", "--mirror", "mirror", "--steps", "4", "--ckpt-every", "2"
    )
    assert result.returncode == 0, result.stderr
    manifests = sorted(p.parent.name for p in (tmp_path / "mirror").rglob("manifest.json"))
    assert manifests == ["step_000002", "step_000004"]
    listed = runner("ls", "mirror", "--json")
    assert listed.returncode == 0, listed.stderr
    assert '"step": 4' in listed.stdout and '"step": 2' in listed.stdout
