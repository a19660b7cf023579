"""Human-readable sizes and ages, and JSON output, one style for every command."""

from __future__ import annotations

import json
from typing import Any

import click


def echo_json(data: Any) -> None:
    """`--json` output: indented, keys sorted."""
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def human_size(size: int) -> str:
    """Binary units, as `du -h` and `ls -h` print them: 1.3 MiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_duration(seconds: float | None) -> str:
    """The two largest units: 45s, 3m12s, 2h05m -> '2h5m', 1d3h; '?' when unknown."""
    if seconds is None:
        return "?"
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        count, whole = divmod(whole, size)
        if count or parts:
            parts.append(f"{count}{unit}")
    return "".join(parts[:2])
