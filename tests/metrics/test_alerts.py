"""Alert rules: one source (runner/metrics/alerting/rules.py) for deploy/prometheus/alerts.yml
and the k8s PrometheusRule, checked and unit-tested with the real promtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from runner.errors import ConfigError
from runner.metrics.alerting import (
    Thresholds,
    alert_rules,
    render_prometheus_rule,
    render_rules_file,
)
from runner.metrics.alerting.rules import format_duration, parse_duration
from runner.metrics.registry import RunnerMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
ALERTS_TEST = ROOT / "deploy/prometheus/alerts_test.yml"
PROMETHEUS_RULE = ROOT / "k8s/base/prometheusrule.yaml"
DESIGN_ALERTS = {
    "RunnerCheckpointStale",
    "RunnerCheckpointMirrorLagging",
    "RunnerCheckpointFailures",
    "RunnerDown",
    "RunnerGoodputLow",
}


def promtool_run(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_committed_rule_files_are_rendered_from_the_source():
    assert ALERTS.read_text() == render_rules_file(Thresholds()), (
        "deploy/prometheus/alerts.yml is out of date: "
        "python -m runner.metrics.alerting > deploy/prometheus/alerts.yml"
    )
    assert PROMETHEUS_RULE.read_text() == render_prometheus_rule(Thresholds()), (
        "k8s/base/prometheusrule.yaml is out of date: "
        "python -m runner.metrics.alerting --format prometheusrule > k8s/base/prometheusrule.yaml"
    )


def test_prometheus_rule_holds_exactly_the_rules_file():
    rules_file = yaml.safe_load(ALERTS.read_text())
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == rules_file


def test_every_design_alert_is_defined_with_actionable_annotations():
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    assert {rule["alert"] for rule in rules} == DESIGN_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning"}
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description"}
        assert "{{ $labels.instance }}" in annotations["summary"]
        # What it means, then what to check, then what to do.
        assert re.search(r"\nCheck: .+\nAct: .+", annotations["description"]), rule["alert"]


def test_rules_reference_only_metrics_the_runner_exports():
    exported = {
        family.name + suffix
        for family in RunnerMetrics(CollectorRegistry()).registry.collect()
        for suffix in ("", "_total", "_count", "_sum", "_bucket")
    }
    for rule in alert_rules(Thresholds()):
        names = set(re.findall(r"\b(runner_\w+)", rule.expr + rule.description))
        assert names - exported == set(), rule.name
        if rule.name != "RunnerDown":  # RunnerDown watches Prometheus' own `up`
            assert re.search(r"\brunner_\w+", rule.expr), rule.name


def test_promtool_check_rules_passes_on_both_files(promtool, tmp_path):
    result = promtool_run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout
    # The PrometheusRule's spec is a rules file too.
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]))
    result = promtool_run(promtool, "check", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


def test_promtool_check_rules_rejects_a_broken_rule(promtool, tmp_path):
    # Guards the check above against passing vacuously.
    broken = tmp_path / "broken.yml"
    broken.write_text(ALERTS.read_text().replace("> 3600", "> > 3600", 1))
    result = promtool_run(promtool, "check", "rules", str(broken))
    assert result.returncode != 0


def test_promtool_unit_tests_pass(promtool):
    result = promtool_run(promtool, "test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_unit_tests_cover_every_alert_firing_and_not_firing():
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    firing, quiet = set(), set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == DESIGN_ALERTS
    assert quiet == DESIGN_ALERTS


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stale_after", 7200),
        ("mirror_lag", 3600),
        ("failures_window", 60),
        ("down_for", 600),
        ("badput_over", 7200),
        ("goodput_for", 3600),
    ],
)
def test_unit_tests_fail_when_a_threshold_changes(promtool, tmp_path, field, value):
    # The unit tests pin the default thresholds: moving one must break them.
    (tmp_path / "alerts.yml").write_text(render_rules_file(Thresholds(**{field: value})))
    (tmp_path / "alerts_test.yml").write_text(ALERTS_TEST.read_text())
    result = promtool_run(promtool, "test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED" in result.stdout + result.stderr


def test_thresholds_render_into_exprs_and_descriptions():
    rules = {r.name: r for r in alert_rules(Thresholds(stale_after=5400, down_for=90))}
    assert "> 5400" in rules["RunnerCheckpointStale"].expr
    assert "older than 1h30m" in rules["RunnerCheckpointStale"].description
    assert rules["RunnerDown"].for_seconds == 90
    assert "for 1m30s" in rules["RunnerDown"].description


def test_cli_renders_custom_thresholds(tmp_path):
    result = subprocess.run(
        [
            "python",
            "-m",
            "runner.metrics.alerting",
            "--stale-after",
            "3h",
            "--job-matcher",
            'job="train"',
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    rules = {r["alert"]: r for r in yaml.safe_load(result.stdout)["groups"][0]["rules"]}
    assert (
        'runner_checkpoint_age_seconds{location="remote"} > 10800'
        in rules["RunnerCheckpointStale"]["expr"]
    )
    assert rules["RunnerDown"]["expr"] == 'up{job="train"} == 0'


def test_cli_refuses_a_bad_duration():
    result = subprocess.run(
        ["python", "-m", "runner.metrics.alerting", "--stale-after", "1hour"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "'1hour' is not a duration" in result.stderr


@pytest.mark.parametrize(
    ("text", "seconds"), [("45s", 45), ("30m", 1800), ("1h30m", 5400), ("2d", 172800)]
)
def test_durations_round_trip(text, seconds):
    assert parse_duration(text) == seconds
    assert format_duration(seconds) == text


@pytest.mark.parametrize("text", ["", "1", "1x", "h", "1h 30m", "-5m"])
def test_bad_durations_are_config_errors(text):
    with pytest.raises(ConfigError, match="is not a duration"):
        parse_duration(text)


def test_bad_thresholds_are_config_errors():
    with pytest.raises(ConfigError, match="stale_after must be > 0"):
        Thresholds(stale_after=0)
    with pytest.raises(ConfigError, match="not a PromQL label matcher"):
        Thresholds(job_matcher="spot-runner")


def test_example_prometheus_config_is_valid(promtool):
    # `check config` also checks the rule files the config names (alerts.yml).
    result = promtool_run(
        promtool, "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout
