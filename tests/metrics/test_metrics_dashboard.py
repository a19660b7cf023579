"""The Grafana dashboard parses, lays out cleanly, covers what on-call needs, and queries only
metrics the runner exports, in PromQL that the real promtool accepts."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from runner.metrics.registry import RunnerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/runner-dashboard.json"
GRID_WIDTH = 24


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def exported_names() -> set[str]:
    names = set()
    for family in RunnerMetrics(CollectorRegistry()).registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_identity_and_variables(dashboard):
    assert dashboard["uid"] == "spot-runner"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)


def test_every_panel_uses_the_datasource_variable(dashboard):
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])


def test_panels_do_not_overlap(dashboard):
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= GRID_WIDTH, panel["title"]
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells


def test_queries_reference_only_exported_metrics(dashboard):
    exported = exported_names()
    referenced = {name for expr in exprs(dashboard) for name in re.findall(r"\brunner_\w+", expr)}
    assert referenced - exported == set()


def test_dashboard_covers_what_the_issue_asks_for(dashboard):
    text = "\n".join(exprs(dashboard))
    for needed in (
        "runner_checkpoint_age_seconds",  # age per location
        "runner_checkpoint_save_duration_seconds_bucket",
        "runner_checkpoint_upload_duration_seconds_bucket",
        "deriv(runner_train_step",  # steps/s
        "runner_checkpoint_failures_total",
        "runner_preemption_notices_total",
    ):
        assert needed in text, needed
    age_panel = next(p for p in dashboard["panels"] if p["title"] == "Checkpoint age per location")
    assert "{{location}}" in age_panel["targets"][0]["legendFormat"]


def test_every_query_is_valid_promql(dashboard, promtool, tmp_path):
    # promtool parses each query as a recording rule, with Grafana's variables filled in.
    rules = [
        {
            "record": f"dashboard:query_{i}",
            "expr": expr.replace("$__rate_interval", "5m")
            .replace("$job", ".*")
            .replace("$instance", ".*"),
        }
        for i, expr in enumerate(exprs(dashboard))
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
