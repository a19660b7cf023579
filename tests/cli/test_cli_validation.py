"""User mistakes on the command line end in exit 2 and a message that names the option or path,
never in a traceback, a silently ignored setting or a replaced checkpoint. Every test runs
`python -m runner` as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from runner.checkpoint.layout import checkpoint_key
from runner.cli.main import COMMANDS, cli
from runner.cli.options import FiniteFloat, FiniteFloatRange
from runner.config import RunConfig
from runner.errors import EXIT_OK, EXIT_USAGE, ConfigError
from runner.mirror import upload_checkpoint
from runner.preemption.clouds import GcpPreemptedNotice, MetadataUnavailable
from runner.storage import open_storage
from tests.fixtures.ckpt import SaveCheckpoint
from tests.fixtures.s3 import SeaweedS3

TINY_DEMO = ("--device", "cpu", "--threads", "1", "--batch-size", "2", "--ckpt-every", "0")


def runner(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        env={**os.environ, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def assert_usage_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == EXIT_USAGE, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def manifest_of(step_dir: Path) -> dict[str, object]:
    data = json.loads((step_dir / "manifest.json").read_text())
    assert isinstance(data, dict)
    return data


# 1. --version / --help are never read from the environment


@pytest.mark.slow
def test_runner_version_in_the_environment_does_not_hijack_demo(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = runner(
        "demo", "--run-dir", str(run_dir), "--steps", "5", *TINY_DEMO, env={"RUNNER_VERSION": "1"}
    )
    assert result.returncode == EXIT_OK, result.stderr
    assert "version" not in result.stdout
    assert (run_dir / checkpoint_key(5) / "manifest.json").is_file()


@pytest.mark.parametrize("variable", ["RUNNER_VERSION", "RUNNER_HELP"])
@pytest.mark.parametrize("value", ["2.311.0", "1", "true"])
def test_version_and_help_variables_are_ignored(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, variable: str, value: str
) -> None:
    run_dir = tmp_path / "run"
    save_checkpoint(3, run_dir=run_dir)
    result = runner("ls", str(run_dir), "--json", env={variable: value})
    assert result.returncode == EXIT_OK, result.stderr
    assert [row["step"] for row in json.loads(result.stdout)] == [3]


def test_the_version_flag_itself_still_works() -> None:
    result = runner("--version")
    assert result.returncode == EXIT_OK, result.stderr
    assert "spot-runner, version" in result.stdout
    assert "RUNNER_VERSION" not in runner("--help").stdout


# 2. nan / inf are rejected by every float option


@pytest.mark.parametrize(
    ("args", "option", "value"),
    [
        (("demo", "--grace-seconds", "nan"), "--grace-seconds", "nan"),
        (("demo", "--ckpt-every-seconds", "inf"), "--ckpt-every-seconds", "inf"),
        (("demo", "--notice-poll-seconds", "-inf"), "--notice-poll-seconds", "-inf"),
        (("run", "--restart-backoff", "nan", "--", "true"), "--restart-backoff", "nan"),
        (("run", "--grace-seconds", "NaN", "--", "true"), "--grace-seconds", "NaN"),
    ],
)
def test_run_options_reject_non_finite_floats(
    tmp_path: Path, args: tuple[str, ...], option: str, value: str
) -> None:
    command, *rest = args
    result = runner(command, "--run-dir", str(tmp_path / "run"), *rest)
    assert_usage_error(result, f"Invalid value for '{option}'", f"'{value}' is not a finite number")
    assert not (tmp_path / "run").exists()


def test_non_finite_float_from_the_environment(tmp_path: Path) -> None:
    result = runner("demo", "--run-dir", str(tmp_path / "run"), env={"RUNNER_GRACE_SECONDS": "nan"})
    assert_usage_error(result, "'--grace-seconds'", "RUNNER_GRACE_SECONDS", "not a finite number")
    assert not (tmp_path / "run").exists()


def test_prune_rejects_nan_orphan_age(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    run_dir = tmp_path / "run"
    save_checkpoint(3, run_dir=run_dir)
    result = runner("prune", str(run_dir), "--keep", "2", "--orphan-age-hours", "nan")
    assert_usage_error(result, "'--orphan-age-hours'", "'nan' is not a finite number")


def test_every_float_option_of_every_command_is_finite() -> None:
    ctx = click.Context(cli)
    seen = []
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None
        for param in [*cli.params, *command.params]:
            if isinstance(param.type, click.types.FloatParamType):
                assert isinstance(param.type, FiniteFloat | FiniteFloatRange), (name, param.name)
                seen.append(param.name)
    assert {"grace_seconds", "restart_backoff", "orphan_age_hours"} <= set(seen)


def test_run_config_rejects_non_finite_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--grace-seconds must be a finite number"):
        RunConfig(run_dir=tmp_path, grace_seconds=float("nan"))
    with pytest.raises(ConfigError, match="--ckpt-every-seconds must be a finite number"):
        RunConfig(run_dir=tmp_path, ckpt_every_seconds=float("inf"))


# 3. clear errors instead of tracebacks


def test_verify_rejects_a_negative_step(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    run_dir = tmp_path / "run"
    save_checkpoint(3, run_dir=run_dir)
    assert_usage_error(
        runner("verify", str(run_dir), "--step", "-1"),
        "Invalid value for '--step'",
        "-1 is not in the range x>=0",
    )
    assert_usage_error(
        runner("verify", str(run_dir), env={"RUNNER_STEP": "-1"}),
        "RUNNER_STEP",
        "-1 is not in the range x>=0",
    )


@pytest.mark.parametrize("command", ["fork", "pull", "push"])
def test_other_step_options_reject_a_negative_step(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, command: str
) -> None:
    run_dir = tmp_path / "run"
    save_checkpoint(3, run_dir=run_dir)
    result = runner(command, str(run_dir), str(tmp_path / "other"), "--step", "-1")
    assert_usage_error(result, "-1 is not in the range x>=0")


def test_demo_rejects_a_seed_torch_cannot_take(tmp_path: Path) -> None:
    result = runner("demo", "--run-dir", str(tmp_path / "run"), "--seed", str(1 << 64))
    assert_usage_error(result, f"--seed must fit in 64 bits (got {1 << 64})")
    assert not (tmp_path / "run").exists()


def test_convert_rejects_negative_samples_seen(tmp_path: Path) -> None:
    seed_bin = tmp_path / "step_000005.bin"
    seed_bin.write_bytes((5).to_bytes(4, "little") + (1).to_bytes(4, "little") + bytes(12))
    result = runner("convert", str(seed_bin), str(tmp_path / "run"), "--samples-seen", "-5")
    assert_usage_error(result, "Invalid value for '--samples-seen'", "-5 is not in the range x>=0")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("threads", ["-2", "0"])
def test_demo_rejects_a_thread_count_below_one(tmp_path: Path, threads: str) -> None:
    result = runner("demo", "--run-dir", str(tmp_path / "run"), "--threads", threads)
    assert_usage_error(result, "Invalid value for '--threads'", "is not in the range x>=1")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "endpoint", ["notaurl", "169.254.169.254", "ftp://host", "http://", "http://host:port"]
)
def test_demo_rejects_a_notice_endpoint_that_is_not_an_http_url(
    tmp_path: Path, endpoint: str
) -> None:
    result = runner(
        "demo",
        "--run-dir",
        str(tmp_path / "run"),
        "--steps",
        "5",
        *TINY_DEMO,
        "--notices",
        "gcp",
        "--notice-endpoint",
        endpoint,
    )
    assert_usage_error(result, f"--notice-endpoint {endpoint!r}", "http://HOST[:PORT]")
    assert not (tmp_path / "run").exists()


def test_a_malformed_metadata_url_is_an_unavailable_endpoint_not_a_crash() -> None:
    # the poller thread survives only MetadataUnavailable; anything else ended notices silently
    with pytest.raises(MetadataUnavailable, match="unknown url type"):
        GcpPreemptedNotice("notaurl", timeout=0.1).check()


# 4. status on a missing local directory


@pytest.mark.parametrize("form", ["path", "file-uri"])
@pytest.mark.parametrize("as_json", [False, True])
def test_status_of_a_missing_directory_is_a_usage_error(
    tmp_path: Path, form: str, as_json: bool
) -> None:
    missing = tmp_path / "nonexistent"
    location = str(missing) if form == "path" else f"file://{missing}"
    result = runner("status", location, *(["--json"] if as_json else []))
    assert_usage_error(result, f"{location}: no such directory")
    assert result.stdout == ""


def test_status_of_an_empty_existing_directory_is_no_checkpoints(tmp_path: Path) -> None:
    result = runner("status", f"file://{tmp_path}")
    assert result.returncode == EXIT_OK, result.stderr
    assert "no checkpoints" in result.stdout


@pytest.mark.e2e
def test_status_of_an_empty_s3_prefix_is_still_no_checkpoints(s3_server: SeaweedS3) -> None:
    # a bucket prefix has no directory to be missing: empty means "not checkpointed yet"
    location = f"s3://{s3_server.create_bucket()}/runs/not-started"
    result = runner("status", location, "--json", env=s3_server.env())
    assert result.returncode == EXIT_OK, result.stderr
    (summary,) = json.loads(result.stdout)
    assert summary["steps"] == [] and summary["newest"] is None


# 5. pull never replaces a different verified checkpoint


@pytest.fixture
def bucket_and_local(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> tuple[str, Path]:
    """A file:// bucket with step 5 of seed 0 and a run dir with step 5 of seed 1."""
    remote = save_checkpoint(5, run_dir=tmp_path / "origin", seed=0)
    bucket = f"file://{tmp_path / 'bucket'}"
    upload_checkpoint(open_storage(bucket), remote.path)
    save_checkpoint(5, run_dir=tmp_path / "local", seed=1)
    return bucket, tmp_path / "local"


@pytest.mark.slow
@pytest.mark.parametrize("step_args", [(), ("--step", "5")])
def test_pull_refuses_to_replace_a_different_verified_checkpoint(
    bucket_and_local: tuple[str, Path], step_args: tuple[str, ...]
) -> None:
    bucket, local = bucket_and_local
    step_dir = local / checkpoint_key(5)
    before = {p.name: p.read_bytes() for p in step_dir.iterdir()}
    remote_fp = manifest_of(Path(bucket.removeprefix("file://")) / checkpoint_key(5))["fingerprint"]
    local_fp = manifest_of(step_dir)["fingerprint"]
    assert remote_fp != local_fp

    result = runner("pull", bucket, str(local), *step_args)
    assert_usage_error(
        result,
        f"{step_dir} already holds a different checkpoint of step 5",
        f"fingerprint {local_fp}",
        f"{bucket} has {remote_fp}",
        "Pull into another directory, or delete the local step directory first",
    )
    assert {p.name: p.read_bytes() for p in step_dir.iterdir()} == before
    assert sorted(p.name for p in (local / "checkpoints").iterdir()) == ["step_000005"]


@pytest.mark.slow
def test_pull_of_an_identical_checkpoint_is_a_no_op(
    tmp_path: Path, bucket_and_local: tuple[str, Path]
) -> None:
    bucket, _ = bucket_and_local
    dest = tmp_path / "copy"
    first = runner("pull", bucket, str(dest))
    assert first.returncode == EXIT_OK, first.stderr
    manifest = (dest / checkpoint_key(5) / "manifest.json").read_bytes()
    again = runner("pull", bucket, str(dest))
    assert again.returncode == EXIT_OK, again.stderr
    assert "pulled step 5" in again.stdout
    assert (dest / checkpoint_key(5) / "manifest.json").read_bytes() == manifest


@pytest.mark.slow
def test_pull_repairs_a_corrupt_local_checkpoint(bucket_and_local: tuple[str, Path]) -> None:
    bucket, local = bucket_and_local
    state = local / checkpoint_key(5) / "state.pt"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))

    result = runner("pull", bucket, str(local))
    assert result.returncode == EXIT_OK, result.stderr
    remote_fp = manifest_of(Path(bucket.removeprefix("file://")) / checkpoint_key(5))["fingerprint"]
    assert manifest_of(local / checkpoint_key(5))["fingerprint"] == remote_fp
    assert runner("verify", str(local)).returncode == EXIT_OK


# 6. pivot quotes its argument as typed


def test_pivot_names_a_missing_file_uri_as_typed(tmp_path: Path) -> None:
    location = f"file://{tmp_path / 'bucket'}"
    assert_usage_error(runner("pivot", location), f"{location}: no such run directory")


def test_pivot_refuses_a_mirror_uri() -> None:
    assert_usage_error(
        runner("pivot", "s3://bucket/runs/a"), "s3://bucket/runs/a: pivot works on the local"
    )


def test_pivot_accepts_a_file_uri_of_a_run_dir(tmp_path: Path) -> None:
    (tmp_path / "samples.json").write_text("[]")
    result = runner("pivot", f"file://{tmp_path}", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    (archived,) = json.loads(result.stdout)["archived"]
    assert Path(archived).name == "samples.json" and not (tmp_path / "samples.json").exists()
