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


@pytest.mark.parametrize("form", ["symlink", "file-uri-dotdot", "relative"])
def test_another_name_of_the_run_dir_is_not_its_mirror_either(
    form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    mirror = {
        "symlink": str(tmp_path / "link"),
        "file-uri-dotdot": f"file://{tmp_path}/other/../run",
        "relative": "./link/",
    }[form]
    with pytest.raises(ConfigError, match="is the run dir itself"):
        RunConfig(run_dir=Path("run"), mirror=mirror)


def test_demo_refuses_a_symlink_to_its_run_dir_as_mirror(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    args = ["--run-dir", tmp_path / "run", "--mirror", tmp_path / "link", "--steps", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "runner", "demo", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"--mirror file://{tmp_path}/link is the run dir itself" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
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
