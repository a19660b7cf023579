"""One source of defaults and checks: the options of `runner demo` and `runner run` that set a
RunConfig field take its default, both commands build their config with one builder, and the
store timeout of a training run is a RunConfig field that reaches the mirror's S3 client."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click
import pytest

from runner.cli.demo_cmd import demo
from runner.cli.options import config_from_options
from runner.cli.run_cmd import run
from runner.config import RunConfig
from runner.errors import ConfigError
from runner.runtime.services import make_mirror
from runner.storage import open_storage, set_store_timeout
from runner.storage.limits import DEFAULT_STORE_TIMEOUT_S
from runner.storage.s3 import S3Storage
from tests.fixtures.aws_env import isolated_aws_env

FIELDS = {f.name for f in dataclasses.fields(RunConfig)}
# not user options of these commands: set by the CLI (run_dir's per-command default, writer_id)
# ckpt_every_seconds_auto is `--ckpt-every-seconds auto`
NOT_OPTIONS = {"run_dir", "writer_id", "ckpt_every_seconds_auto"}


def field_options(command: click.Command) -> dict[str, click.Option]:
    return {
        p.name: p
        for p in command.params
        if isinstance(p, click.Option) and p.name in FIELDS and p.name not in NOT_OPTIONS
    }


@pytest.mark.parametrize("command", [demo, run], ids=["demo", "run"])
def test_option_defaults_are_the_run_configs(command: click.Command) -> None:
    options = field_options(command)
    assert options  # the comparison below is not vacuous
    for name, option in options.items():
        assert option.default == RunConfig.default(name), name


def test_every_setting_of_a_run_is_an_option_of_one_of_the_commands() -> None:
    both = set(field_options(demo)) | set(field_options(run))
    assert both == FIELDS - NOT_OPTIONS
    # the trainer's own settings: `runner run` passes its trainer's command line as given
    assert set(field_options(run)) == FIELDS - NOT_OPTIONS - {"device", "collective_timeout"}
    run_only = {"max_restarts", "restart_backoff", "adopt", "adopt_quiet_seconds"}
    assert set(field_options(demo)) == FIELDS - NOT_OPTIONS - run_only


def test_the_builder_of_default_options_gives_the_default_config(tmp_path: Path) -> None:
    params = {name: option.default for name, option in field_options(run).items()}
    built = config_from_options(run_dir=tmp_path, writer_id="w", command=("true",), **params)
    assert built == RunConfig(run_dir=tmp_path, writer_id="w")


def test_a_field_without_a_plain_default_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match=r"RunConfig\.writer_id has no plain default"):
        RunConfig.default("writer_id")
    with pytest.raises(KeyError, match=r"RunConfig\.nonexistent has no plain default"):
        RunConfig.default("nonexistent")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"store_timeout": 0.5}, "--store-timeout must be >= 1 (got 0.5)"),
        ({"store_timeout": 1e10}, "--store-timeout must be <= 86400 (got 1e+10)"),
        ({"restart_backoff": -1.0}, "--restart-backoff must be >= 0 (got -1.0)"),
        ({"restart_backoff": 1e10}, "--restart-backoff must be <= 3600 (got 1e+10)"),
    ],
)
def test_run_config_checks_the_ranges_the_options_check_too(
    tmp_path: Path, settings: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig(run_dir=tmp_path, **settings)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_store_timeout_default_is_the_documented_one(tmp_path: Path) -> None:
    assert RunConfig(run_dir=tmp_path).store_timeout == DEFAULT_STORE_TIMEOUT_S == 60.0


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in isolated_aws_env(
        AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL="http://127.0.0.1:9"
    ).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("aws")
def test_a_training_runs_store_timeout_reaches_its_mirror_and_keeps_trying(tmp_path: Path) -> None:
    # a one-shot command's setting in this process must not leak into a training run's mirror
    set_store_timeout(2.0, give_up_once=True)
    try:
        config = RunConfig(run_dir=tmp_path, mirror="s3://bucket/run", store_timeout=7.0)
        mirror = make_mirror(config, None)
        assert mirror is not None
        try:
            storage = mirror.storage
            assert isinstance(storage, S3Storage)
            assert storage.retry.budget_s == 7.0
            assert storage._give_up_once is False
        finally:
            mirror.close()
    finally:
        set_store_timeout(None)


@pytest.mark.usefixtures("aws")
def test_a_one_shot_commands_store_timeout_still_applies_to_what_it_opens() -> None:
    set_store_timeout(3.0, give_up_once=True)
    try:
        storage = open_storage("s3://bucket/run")
        assert isinstance(storage, S3Storage)
        assert storage.retry.budget_s == 3.0
        assert storage._give_up_once is True
    finally:
        set_store_timeout(None)
    unset = open_storage("s3://bucket/run")
    assert isinstance(unset, S3Storage)
    assert unset.retry.budget_s == DEFAULT_STORE_TIMEOUT_S and unset._give_up_once is False
