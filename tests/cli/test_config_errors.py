"""Configuration mistakes end as exit 2 with one `runner: error:` line and no traceback, and a
user:password placed in the endpoint URL never shows in any output or log.

Every case runs the real `runner` as a subprocess with a clean AWS environment."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.aws_env import isolated_aws_env
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.s3 import SeaweedS3

CANARY = "canary-Secret-7f3a91"
# passwords that end a naive userinfo match early: the canary follows the '@', space,
# quote or ':' (a redaction stopping at the first '@' or at a space would show it)
CANARY_PASSWORDS = [CANARY, f"p@{CANARY}", f"se cret {CANARY}", f'pa"ss{CANARY}', f"a:b:{CANARY}"]


def clean_env(**aws: str) -> dict[str, str]:
    return isolated_aws_env(**aws)


def runner(
    *args: str | Path, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def assert_config_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit 2, no traceback, the error on one line that says each of `expected`."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("runner: error:")]
    assert len(errors) == 1, result.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- endpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "url"),
    [
        ("AWS_ENDPOINT_URL_S3", "not-a-url"),
        ("AWS_ENDPOINT_URL_S3", "ftp://127.0.0.1:9000"),
        ("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:99999"),
        ("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:port"),
        ("AWS_ENDPOINT_URL", "not-a-url"),
        ("AWS_ENDPOINT_URL", "gopher://127.0.0.1"),
        ("AWS_ENDPOINT_URL", "http://:9000"),
    ],
)
def test_invalid_endpoint_is_a_config_error(variable: str, url: str) -> None:
    result = runner("ls", "s3://bucket/run", env=clean_env(**{variable: url}))
    assert_config_error(result, variable, "http://HOST[:PORT]")


def test_invalid_endpoint_stops_runner_run_before_the_trainer(tmp_path: Path) -> None:
    marker = tmp_path / "trainer-ran"
    result = runner(
        "run",
        "--run-dir",
        tmp_path / "run",
        "--mirror",
        "s3://bucket/run",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        env=clean_env(AWS_ENDPOINT_URL_S3="http://127.0.0.1:70000"),
    )
    assert_config_error(result, "AWS_ENDPOINT_URL_S3")
    assert not marker.exists()


@pytest.mark.slow
def test_invalid_endpoint_stops_runner_demo(tmp_path: Path) -> None:
    result = runner(
        "demo",
        "--run-dir",
        tmp_path / "run",
        "--mirror",
        "s3://bucket/run",
        "--steps",
        "2",
        env=clean_env(AWS_ENDPOINT_URL="ftp://example.com"),
    )
    assert_config_error(result, "AWS_ENDPOINT_URL")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


# -- profiles, config files, regions --------------------------------------------------------


def test_missing_profile_is_a_config_error() -> None:
    result = runner("ls", "s3://bucket/run", env=clean_env(AWS_PROFILE="no-such-profile"))
    assert_config_error(result, "'no-such-profile' does not exist", "AWS_PROFILE")


@pytest.mark.parametrize("variable", ["AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"])
@pytest.mark.parametrize(
    "text",
    ["[default\nregion = us-east-1\n", "a line before any section\n[default]\n"],
    ids=["unclosed-section", "no-section"],
)
def test_malformed_aws_file_is_a_config_error(variable: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / "aws-file"
    path.write_text(text)
    result = runner("status", "s3://bucket/run", env=clean_env(**{variable: str(path)}))
    assert_config_error(result, str(path), "cannot parse")


def test_invalid_region_is_a_config_error(tmp_path: Path) -> None:
    """botocore reads AWS_DEFAULT_REGION (not AWS_REGION) and the profile's region."""
    result = runner("ls", "s3://bucket/run", env=clean_env(AWS_DEFAULT_REGION="not a region!"))
    assert_config_error(result, "'not a region!'", "AWS_DEFAULT_REGION")
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us_east 1\n")
    result = runner("ls", "s3://bucket/run", env=clean_env(AWS_CONFIG_FILE=str(config)))
    assert_config_error(result, "'us_east 1'", "region")


@pytest.mark.e2e
def test_no_region_is_not_needed_for_s3(s3_server: SeaweedS3) -> None:
    """botocore signs S3 requests for us-east-1 when no region is configured (it never raises
    NoRegionError for S3), so a missing region is no error: the command works."""
    bucket = s3_server.create_bucket()
    env = clean_env(**s3_server.env())
    env.pop("AWS_DEFAULT_REGION")
    result = runner("ls", f"s3://{bucket}/run", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"no checkpoints at s3://{bucket}/run"


# -- numbers beyond what the platform supports ---------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--grace-seconds", "1e10", "--grace-seconds must be <= 86400"),
        ("--ckpt-every-seconds", "1e12", "--ckpt-every-seconds must be <= 2.592e+06"),
        ("--notice-poll-seconds", "1e300", "--notice-poll-seconds must be <= 3600"),
        ("--steps", str(1 << 64), "--steps must be <= 9223372036854775807"),
        ("--ckpt-every", str(1 << 70), "--ckpt-every must be <= 9223372036854775807"),
        ("--keep", "10000000000", "--keep must be <= 1000000"),
        ("--max-restarts", "100000", "--max-restarts must be <= 1000"),
        ("--seed", str(1 << 64), "--seed must fit in 64 bits"),
    ],
)
def test_number_beyond_its_maximum_is_refused(
    option: str, value: str, says: str, tmp_path: Path
) -> None:
    marker = tmp_path / "trainer-ran"
    result = runner(
        "run",
        "--run-dir",
        tmp_path / "run",
        option,
        value,
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        env=clean_env(),
    )
    assert_config_error(result, says)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [
        ("run", "--metrics-port", "70000"),
        ("run", "--restart-backoff", "1e10"),
        ("ls", "--store-timeout", "1e10"),
        ("ls", "--store-timeout", "0"),
    ],
)
def test_option_range_is_checked_by_the_cli(
    command: str, option: str, value: str, tmp_path: Path
) -> None:
    args: list[str | Path] = [command]
    if command == "run":
        args += ["--run-dir", tmp_path / "run", option, value, "--", "true"]
    else:
        args += [tmp_path, option, value]
    result = runner(*args, env=clean_env())
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert option in output


def test_grace_seconds_from_the_environment_is_bounded_too(tmp_path: Path) -> None:
    result = runner(
        "run",
        "--run-dir",
        tmp_path / "run",
        "--",
        "true",
        env=clean_env(RUNNER_GRACE_SECONDS="1e10"),
    )
    assert_config_error(result, "--grace-seconds must be <= 86400")


# -- secrets in the endpoint URL -----------------------------------------------------------


@pytest.mark.parametrize("password", CANARY_PASSWORDS)
def test_credentials_in_an_invalid_endpoint_are_never_shown(password: str) -> None:
    url = f"http://admin:{password}@127.0.0.1:99999"
    result = runner("ls", "s3://bucket/run", env=clean_env(AWS_ENDPOINT_URL_S3=url))
    line = assert_config_error(result, "http://***@127.0.0.1:99999")
    assert CANARY not in result.stdout + result.stderr
    assert "admin" not in line


@pytest.mark.parametrize("password", CANARY_PASSWORDS)
def test_credentials_in_an_invalid_notice_endpoint_are_never_shown(
    password: str, tmp_path: Path
) -> None:
    url = f"http://admin:{password}@169.254.169.254:0"
    result = runner(
        "run",
        "--run-dir",
        tmp_path / "run",
        "--notice-endpoint",
        url,
        "--",
        "true",
        env=clean_env(),
    )
    line = assert_config_error(result, "--notice-endpoint", "http://***@169.254.169.254:0")
    assert CANARY not in result.stdout + result.stderr
    assert "admin" not in line


@pytest.mark.slow
def test_credentials_in_the_endpoint_never_appear_in_any_output_or_log(tmp_path: Path) -> None:
    """Every store command, plus `runner run` and `runner demo` with an s3:// mirror, against
    an endpoint with a user:password that refuses connections: each fails, and the secret is
    in none of stdout, stderr or any file the run wrote."""
    # a space, '@', a quote and ':' in one password (botocore still connects with it)
    endpoint = f'http://admin:se cret@p"w:{CANARY}@127.0.0.1:{closed_port()}'
    env = clean_env(AWS_ENDPOINT_URL_S3=endpoint, RUNNER_STORE_TIMEOUT="5")
    run_dir = tmp_path / "local"
    make_checkpoint(run_dir, 10)
    location = "s3://bucket/run"
    commands: list[list[str | Path]] = [
        ["ls", location],
        ["ls", "--verify", location],
        ["verify", location],
        ["status", location],
        ["pull", location, tmp_path / "pulled"],
        ["push", run_dir, location],
        ["prune", location, "--keep", "2"],
        ["fork", location, tmp_path / "forked"],
        ["repair", location],
        ["-vv", "ls", location],
        ["run", "--run-dir", tmp_path / "supervised", "--mirror", location, "--", "true"],
        ["demo", "--run-dir", tmp_path / "demo", "--mirror", location, "--steps", "2"],
    ]
    for args in commands:
        result = runner(*args, env=env, timeout=180)
        output = result.stdout + result.stderr
        assert result.returncode != 0, (args, output)
        # -vv: botocore's own debug log includes the tracebacks of the requests it retries
        assert "-vv" in args or "Traceback" not in output, (args, output)
        assert CANARY not in output, (args, output)
        assert "admin:" not in output, (args, output)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), path
