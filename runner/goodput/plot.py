"""`runner goodput --plot FILE.svg`: the run's timeline, one row per attempt (startup and
restore, training, checkpoints, the end: finished, preempted or failed). SVG written here,
so no plotting library is needed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from runner.goodput.account import Goodput, parse_events

_COLOURS = {"finished": "#2e7d32", "preempted": "#f9a825", "failed": "#c62828"}
_ROW = 28
_LEFT = 230
_WIDTH = 900


def timeline_svg(result: Goodput, records: Mapping[str, bytes]) -> str:
    attempts = result.attempts
    if not attempts:
        return _svg(["<text x='10' y='20'>no attempt records</text>"], height=40)
    t0 = min(a.started_at for a in attempts)
    span = max(max(a.ended_at for a in attempts) - t0, 1e-9)

    def x(t: float) -> float:
        return _LEFT + (t - t0) / span * (_WIDTH - _LEFT - 20)

    parts = [
        f"<text x='10' y='18' font-weight='bold'>goodput {result.goodput_ratio:.1%} of "
        f"{result.wall_seconds:.0f} s</text>"
    ]
    for row, attempt in enumerate(attempts):
        y = 30 + row * _ROW
        events = parse_events(records.get(attempt.attempt, b""))
        ready = next((e for e in events if e.get("event") in ("ready", "spawn")), None)
        train_from = float(ready["t"]) if ready else attempt.ended_at
        label = f"{attempt.attempt[:26]} steps {attempt.first_step}-{attempt.last_step}"
        parts.append(f"<text x='10' y='{y + 15}' font-size='11'>{escape(label)}</text>")
        parts.append(_bar(x(attempt.started_at), x(train_from), y, "#9e9e9e", "startup/restore"))
        parts.append(_bar(x(train_from), x(attempt.ended_at), y, "#64b5f6", "training"))
        for event in _checkpoints(events):
            cx = x(float(event["t"]))
            parts.append(
                f"<line x1='{cx:.1f}' x2='{cx:.1f}' y1='{y}' y2='{y + 20}' stroke='#1a237e'>"
                f"<title>checkpoint step {event.get('step')}</title></line>"
            )
        colour = _COLOURS.get(attempt.end, "#000")
        ex = x(attempt.ended_at)
        parts.append(
            f"<circle cx='{ex:.1f}' cy='{y + 10}' r='5' fill='{colour}'>"
            f"<title>{attempt.end} (exit {attempt.exit_code})</title></circle>"
        )
    return _svg(parts, height=40 + len(attempts) * _ROW)


def _checkpoints(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "checkpoint"]


def _bar(x0: float, x1: float, y: int, colour: str, title: str) -> str:
    return (
        f"<rect x='{x0:.1f}' y='{y}' width='{max(x1 - x0, 0.5):.1f}' height='20' "
        f"fill='{colour}'><title>{title}</title></rect>"
    )


def _svg(parts: list[str], *, height: int) -> str:
    body = "\n".join(parts)
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{_WIDTH}' height='{height}' "
        f"font-family='sans-serif'>\n{body}\n</svg>\n"
    )
