"""`python -m runner.metrics.alerting`: print the alert rules with your thresholds.

python -m runner.metrics.alerting > deploy/prometheus/alerts.yml
python -m runner.metrics.alerting --format prometheusrule > k8s/base/prometheusrule.yaml
python -m runner.metrics.alerting --stale-after 3h --mirror-lag 1h > my-alerts.yml
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from runner.errors import RunnerError
from runner.metrics.alerting.render import render_prometheus_rule, render_rules_file
from runner.metrics.alerting.rules import Thresholds, format_duration, parse_duration

_DEFAULTS = Thresholds()


def _duration_option(flag: str, field: str, help: str) -> click.Option:
    return click.Option(
        [flag, field],
        default=None,
        metavar="DURATION",
        help=f"{help} (default {format_duration(getattr(_DEFAULTS, field))}).",
    )


@click.command(
    params=[
        click.Option(
            ["--format", "fmt"],
            type=click.Choice(["rules", "prometheusrule"]),
            default="rules",
            show_default=True,
            help="A Prometheus rules file, or a prometheus-operator PrometheusRule.",
        ),
        _duration_option("--stale-after", "stale_after", "No durable checkpoint for longer"),
        _duration_option("--stale-for", "stale_for", "... sustained this long"),
        _duration_option("--mirror-lag", "mirror_lag", "Remote older than local by more"),
        _duration_option("--mirror-lag-for", "mirror_lag_for", "... sustained this long"),
        _duration_option("--failures-window", "failures_window", "Any failure within"),
        _duration_option("--down-for", "down_for", "Target unscrapable this long"),
        click.Option(
            ["--goodput-below"],
            type=float,
            default=None,
            help=f"Goodput ratio under this (default {_DEFAULTS.goodput_below:g}) ...",
        ),
        _duration_option("--badput-over", "badput_over", "... with more badput than"),
        _duration_option("--goodput-for", "goodput_for", "... sustained this long"),
        click.Option(
            ["--job-matcher"],
            default=None,
            help=f"Label matcher for the runner's targets (default {_DEFAULTS.job_matcher}).",
        ),
    ]
)
def main(
    fmt: str, job_matcher: str | None, goodput_below: float | None, **durations: str | None
) -> None:
    """Print the spot-runner alert rules (RunnerCheckpointStale, ...MirrorLagging,
    ...Failures, RunnerDown, RunnerGoodputLow) with the given thresholds."""
    try:
        overrides: dict[str, Any] = {
            name: parse_duration(value) for name, value in durations.items() if value is not None
        }
        if job_matcher is not None:
            overrides["job_matcher"] = job_matcher
        if goodput_below is not None:
            overrides["goodput_below"] = goodput_below
        thresholds = dataclasses.replace(_DEFAULTS, **overrides)
    except RunnerError as exc:
        raise click.UsageError(str(exc)) from exc
    if fmt == "rules":
        click.echo(render_rules_file(thresholds), nl=False)
    else:
        click.echo(render_prometheus_rule(thresholds), nl=False)


if __name__ == "__main__":
    main()
