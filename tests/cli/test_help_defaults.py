"""`--help` of `runner demo`, `runner run` and `runner ls` shows the options, defaults, env vars,
choices and ranges it showed at 9fce004 (before the one-source-of-defaults change), and the
click-level types behind them are back: click's usual error for a bad choice or an out-of-range
number, shell completion of `--notices`. Every test runs `python -m runner` as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from runner.cli.demo_cmd import demo
from runner.cli.run_cmd import run
from runner.config import MAXIMA, NOTICE_SOURCES
from runner.errors import EXIT_USAGE
from runner.storage.limits import MIN_STORE_TIMEOUT_S

# (declaration, the bracket click appends to the help), as `--help` printed them at 9fce004;
# --ckpt-every-seconds takes `auto` and --mtbf is its prior since the goodput issue
SHARED_RUN_OPTIONS = [
    ("--mirror TEXT", "env var: RUNNER_MIRROR"),
    ("--steps INTEGER", "env var: RUNNER_STEPS"),
    ("--ckpt-every INTEGER", "env var: RUNNER_CKPT_EVERY; default: 100"),
    ("--ckpt-every-seconds SECONDS|auto", "env var: RUNNER_CKPT_EVERY_SECONDS"),
    ("--mtbf FLOAT RANGE", "env var: RUNNER_MTBF; default: 86400.0; 0<x<=315360000.0"),
    ("--keep INTEGER", "env var: RUNNER_KEEP; default: 3"),
    ("--grace-seconds FLOAT", "env var: RUNNER_GRACE_SECONDS; default: 110.0"),
    ("--save-mode [async|sync]", "env var: RUNNER_SAVE_MODE; default: async"),
    ("--metrics-port INTEGER", "env var: RUNNER_METRICS_PORT; default: 0"),
    ("--metrics-host TEXT", "env var: RUNNER_METRICS_HOST; default: 0.0.0.0"),
    ("--notices [off|auto|aws|gcp|azure]", "env var: RUNNER_NOTICES; default: off"),
    ("--notice-poll-seconds FLOAT", "env var: RUNNER_NOTICE_POLL_SECONDS; default: 5.0"),
    ("--notice-endpoint TEXT", "env var: RUNNER_NOTICE_ENDPOINT"),
    ("--seed INTEGER", "env var: RUNNER_SEED; default: 0"),
    ("--fresh-start", "env var: RUNNER_FRESH_START"),
    (
        "--store-timeout SECONDS",
        "env var: RUNNER_STORE_TIMEOUT; default: 60.0; 1.0<=x<=86400.0",
    ),
]
EXPECTED_OPTIONS = {
    "demo": [
        ("--run-dir DIRECTORY", "env var: RUNNER_RUN_DIR; default: runs/demo"),
        *SHARED_RUN_OPTIONS,
        ("--collective-timeout FLOAT", "env var: RUNNER_COLLECTIVE_TIMEOUT; default: 300.0"),
        ("--batch-size INTEGER", "env var: RUNNER_BATCH_SIZE; default: 16"),
        ("--device TEXT", "env var: RUNNER_DEVICE; default: auto"),
        ("--threads INTEGER RANGE", "env var: RUNNER_THREADS; default: 1; x>=1"),
        ("--progress / --no-progress", "env var: RUNNER_PROGRESS"),
        ("--sample-log FILE", "env var: RUNNER_SAMPLE_LOG"),
        ("--parallel [ddp|fsdp]", "env var: RUNNER_PARALLEL; default: ddp"),
        ("-h, --help", ""),
    ],
    "run": [
        ("--run-dir DIRECTORY", "env var: RUNNER_RUN_DIR; default: runs/run"),
        *SHARED_RUN_OPTIONS,
        # added by `runner run --adopt` (issue "runner run protects any trainer's own
        # checkpoints"), after 9fce004
        ("--adopt PATTERN", "env var: RUNNER_ADOPT"),
        (
            "--adopt-quiet-seconds FLOAT RANGE",
            "env var: RUNNER_ADOPT_QUIET_SECONDS; default: 5.0; 0<=x<=86400.0",
        ),
        ("--max-restarts INTEGER", "env var: RUNNER_MAX_RESTARTS; default: 3"),
        (
            "--restart-backoff FLOAT RANGE",
            "env var: RUNNER_RESTART_BACKOFF; default: 1.0; x<=3600.0",
        ),
        ("-h, --help", ""),
    ],
    "ls": [
        (
            "--store-timeout SECONDS",
            "env var: RUNNER_STORE_TIMEOUT; default: 60.0; 1.0<=x<=86400.0",
        ),
        ("--verify", "env var: RUNNER_VERIFY"),
        ("--json", "env var: RUNNER_JSON"),
        ("-h, --help", ""),
    ],
}


def user_env(**extra: str) -> dict[str, str]:
    """This environment without RUNNER_* settings (they would change defaults and checks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")}
    return {**env, **extra}


def runner(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        env=env or user_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def option_rows(help_text: str) -> list[tuple[str, str]]:
    """(declaration, bracket) of each option on a click help page, whatever the wrapping: an
    entry starts at a line indented two spaces and continues on the more indented lines."""
    lines = help_text.splitlines()
    entries: list[list[str]] = []
    for line in lines[lines.index("Options:") + 1 :]:
        if re.match(r"^  -", line):
            entries.append([line.strip()])
        elif line.strip():
            entries[-1].append(line.strip())
    rows = []
    for first, *rest in entries:
        declaration, *help_start = re.split(r"\s{2,}", first, maxsplit=1)
        extra = re.search(r"\[([^\[\]]*)\]$", " ".join([*help_start, *rest]))
        rows.append((declaration, extra.group(1) if extra else ""))
    return rows


def test_the_parser_reads_wrapped_entries() -> None:
    page = (
        "Options:\n"
        "  --notices [off|auto|aws|gcp|azure]\n"
        "                    Poll cuda[:N] a cloud.\n"
        "                    [env var: RUNNER_NOTICES;\n"
        "                    default: off]\n"
        "  --x INTEGER       Some help.  [default:\n"
        "                    3; x>=1]\n"
        "  -h, --help        Show this message and exit.\n"
    )
    assert option_rows(page) == [
        ("--notices [off|auto|aws|gcp|azure]", "env var: RUNNER_NOTICES; default: off"),
        ("--x INTEGER", "default: 3; x>=1"),
        ("-h, --help", ""),
    ]


@pytest.mark.parametrize("command", sorted(EXPECTED_OPTIONS))
def test_help_shows_the_defaults_and_ranges_it_showed_before(command: str) -> None:
    # click wraps at 78 columns at most; far narrower it breaks words (RUNNER_CKPT _EVERY)
    result = runner(command, "--help", env=user_env(COLUMNS="80"))
    assert result.returncode == 0, result.stderr
    assert option_rows(result.stdout) == EXPECTED_OPTIONS[command]


@pytest.mark.parametrize("command", [demo, run], ids=["demo", "run"])
def test_the_click_types_come_from_run_configs_constants(command: click.Command) -> None:
    params = {p.name: p for p in command.params}
    notices = params["notices"].type
    assert isinstance(notices, click.Choice)
    assert tuple(notices.choices) == NOTICE_SOURCES
    timeout = params["store_timeout"].type
    assert isinstance(timeout, click.FloatRange)
    assert (timeout.min, timeout.max) == (MIN_STORE_TIMEOUT_S, MAXIMA["store_timeout"])
    if command is run:
        backoff = params["restart_backoff"].type
        assert isinstance(backoff, click.FloatRange)
        assert (backoff.min, backoff.max) == (None, MAXIMA["restart_backoff"])


INVALID = "Error: Invalid value for"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--notices", "bogus"],
            {},
            f"{INVALID} '--notices' (env var: 'RUNNER_NOTICES'): "
            "'bogus' is not one of 'off', 'auto', 'aws', 'gcp', 'azure'.",
        ),
        (
            [],
            {"RUNNER_NOTICES": "AWS"},
            f"{INVALID} '--notices' (env var: 'RUNNER_NOTICES'): "
            "'AWS' is not one of 'off', 'auto', 'aws', 'gcp', 'azure'.",
        ),
        (
            ["--store-timeout", "0"],
            {},
            f"{INVALID} '--store-timeout' (env var: 'RUNNER_STORE_TIMEOUT'): "
            "0.0 is not in the range 1.0<=x<=86400.0.",
        ),
        (
            [],
            {"RUNNER_STORE_TIMEOUT": "1e10"},
            f"{INVALID} '--store-timeout' (env var: 'RUNNER_STORE_TIMEOUT'): "
            "10000000000.0 is not in the range 1.0<=x<=86400.0.",
        ),
    ],
    ids=["notices", "notices-env", "store-timeout-low", "store-timeout-env-high"],
)
@pytest.mark.parametrize("command", ["demo", "run"])
def test_a_bad_choice_or_range_is_clicks_usual_error(
    tmp_path: Path, command: str, args: list[str], env: dict[str, str], message: str
) -> None:
    marker = tmp_path / "trainer-ran"
    trainer = (
        ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"] if command == "run" else []
    )
    result = runner(
        command, "--run-dir", str(tmp_path / "run"), *args, *trainer, env=user_env(**env)
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.splitlines()[-1] == message
    assert f"Usage: runner {command} [OPTIONS]" in result.stderr
    assert not (tmp_path / "run").exists() and not marker.exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "1e10",
            f"{INVALID} '--restart-backoff' (env var: 'RUNNER_RESTART_BACKOFF'): "
            "10000000000.0 is not in the range x<=3600.0.",
        ),
        # no lower bound in the range (its help shows none): RunConfig's check, as before
        ("-1", "runner: error: --restart-backoff must be >= 0 (got -1.0)"),
    ],
)
def test_restart_backoff_out_of_range(tmp_path: Path, value: str, message: str) -> None:
    marker = tmp_path / "trainer-ran"
    result = runner(
        "run",
        "--run-dir",
        str(tmp_path / "run"),
        "--restart-backoff",
        value,
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.splitlines()[-1] == message
    assert not marker.exists()


@pytest.mark.parametrize("command", ["demo", "run"])
def test_the_shell_completes_notice_sources(command: str) -> None:
    result = runner(
        env=user_env(
            _RUNNER_COMPLETE="bash_complete",
            COMP_WORDS=f"runner {command} --notices a",
            COMP_CWORD="3",
        )
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["plain,auto", "plain,aws", "plain,azure"]
