"""Alert rules for the runner's metrics, defined once and rendered for Prometheus and k8s."""

from runner.metrics.alerting.render import render_prometheus_rule, render_rules_file
from runner.metrics.alerting.rules import AlertRule, Thresholds, alert_rules

__all__ = [
    "AlertRule",
    "Thresholds",
    "alert_rules",
    "render_prometheus_rule",
    "render_rules_file",
]
