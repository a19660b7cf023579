"""Goodput of the demo under a replayed failure trace, for fixed checkpoint cadences and `auto`.

A trace (benchmarks/traces/*.json) lists failures in hours: `kill` (SIGKILL of the trainer, no
notice: `runner run` restarts it) and `notice` (SIGTERM to the supervisor: it stops with a
final checkpoint, exits 75, and a new `runner run` starts at once, as a new node would).
Time is scaled: one trace hour lasts --hour-seconds real seconds, so a day runs in minutes.
Each cadence replays the same trace against `runner run -- runner demo` in sync save mode (the
loop waits for each save: its whole cost is the checkpoint's), one after the other in this
process; at the trace's end the run is stopped (SIGTERM) and `runner goodput --json` reads the
bucket. `auto` gets the trace's mean time between failures without notice, scaled, as its
--mtbf prior.

Then our own part of one preemption with notice, on the same demo: SIGTERM to the
supervisor's exit (final checkpoint in the bucket), and a new `runner run`'s start to the
trainer's first step, and the goodput that leaves at one notice preemption per 30 minutes.

Usage: python benchmarks/goodput.py [--trace benchmarks/traces/published.json]
       [--hour-seconds 5] [--cadences 1,2,4,8] [--json] [--quick] [--dir PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIG = 10_000_000  # steps: the run never finishes on its own; the trace's end stops it


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "RUNNER_NOTICES": "off"}


def _supervisor(run_dir: Path, bucket: Path, cadence: str, mtbf: float) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir),
        "--mirror", bucket.as_uri(), "--max-restarts", "1000", "--restart-backoff", "0.05",
        "--steps", str(BIG), "--ckpt-every", "0", "--ckpt-every-seconds", cadence,
        "--mtbf", f"{mtbf:.3f}", "--save-mode", "sync", "--keep", "2",
        "--", sys.executable, "-m", "runner", "demo", "--device", "cpu", "--threads", "1",
        "--no-progress",
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )


def _trainer(supervisor: int, timeout: float = 60.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
        except FileNotFoundError:
            return None
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    return None


def _stop(proc: subprocess.Popen[str]) -> float:
    """SIGTERM to the supervisor; seconds until it exited."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - sent


def _goodput(bucket: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "goodput", bucket.as_uri(), "--json"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def replay(trace: dict[str, Any], cadence: str, *, hour: float, work: Path) -> dict[str, Any]:
    """One run of the whole trace at one cadence; the goodput account of its bucket."""
    run_dir, bucket = work / f"run-{cadence}", work / f"bucket-{cadence}"
    mtbf = float(trace["mtbf_hours"]) * hour
    proc = _supervisor(run_dir, bucket, cadence, mtbf)
    began = time.monotonic()
    for event in trace["events"]:
        time.sleep(max(0.0, began + float(event["at_hours"]) * hour - time.monotonic()))
        if event["kind"] == "kill":
            pid = _trainer(proc.pid)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        else:
            _stop(proc)
            proc = _supervisor(run_dir, bucket, cadence, mtbf)
    time.sleep(max(0.0, began + float(trace["hours"]) * hour - time.monotonic()))
    _stop(proc)
    result = _goodput(bucket)
    result["cadence"] = cadence
    result["steps"] = max((a["last_step"] for a in result["attempts"]), default=0)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(bucket, ignore_errors=True)
    return result


def preemption(work: Path, *, train_seconds: float) -> dict[str, float]:
    """Our part of one notice preemption: SIGTERM to exit, then a new start to its first step."""
    run_dir, bucket = work / "run-preemption", work / "bucket-preemption"
    proc = _supervisor(run_dir, bucket, "2", 3600.0)
    time.sleep(train_seconds)  # trained for a while, a checkpoint or more behind it
    to_exit = _stop(proc)
    shutil.rmtree(run_dir)  # a new node: its disk is empty, the bucket holds the run
    started = time.time()
    proc = _supervisor(run_dir, bucket, "2", 3600.0)
    first_step = None
    loss = run_dir / "loss.jsonl"
    deadline = time.monotonic() + 120
    while first_step is None and time.monotonic() < deadline:
        if loss.exists():
            for line in loss.read_text().splitlines():
                record = json.loads(line) if line.startswith("{") else {}
                trained = "loss" in record and "restored_from" not in record  # not a backfill
                if trained and float(record.get("t", 0)) >= started:
                    first_step = float(record["t"]) - started
                    break
        time.sleep(0.01)
    _stop(proc)
    shutil.rmtree(work / "run-preemption", ignore_errors=True)
    shutil.rmtree(bucket, ignore_errors=True)
    if first_step is None:
        raise SystemExit("the resumed run trained no step within 120 s")
    return {"sigterm_to_exit_s": to_exit, "start_to_first_step_s": first_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=REPO / "benchmarks/traces/published.json")
    parser.add_argument("--hour-seconds", type=float, default=5.0)
    parser.add_argument("--cadences", default="1,2,4,8", help="fixed cadences, scaled seconds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a short preemption run (tests)")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    trace = json.loads(args.trace.read_text())
    work = Path(tempfile.mkdtemp(prefix="goodput-bench-", dir=args.dir))
    try:
        cadences = [c.strip() for c in args.cadences.split(",") if c.strip()] + ["auto"]
        runs = [replay(trace, c, hour=args.hour_seconds, work=work) for c in cadences]
        ours = preemption(work, train_seconds=3.0 if args.quick else 10.0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"trace": trace["name"], "runs": runs, "preemption": ours}, indent=2))
        return
    _report(trace, runs, ours, hour=args.hour_seconds)


def _report(
    trace: dict[str, Any], runs: list[dict[str, Any]], ours: dict[str, float], *, hour: float
) -> None:
    kills = sum(1 for e in trace["events"] if e["kind"] == "kill")
    notices = len(trace["events"]) - kills
    print(
        f"trace {trace['name']}: {trace['hours']} h, {kills} failures without notice, "
        f"{notices} with notice; 1 h = {hour:g} s; demo, sync saves"
    )
    kinds = list(runs[0]["badput_seconds"])
    print(f"{'cadence':>8} {'goodput':>8} {'steps':>7} " + " ".join(f"{k[:12]:>12}" for k in kinds))
    for run in runs:
        print(
            f"{run['cadence']:>8} {run['goodput_ratio']:>8.2%} {run['steps']:>7} "
            + " ".join(f"{run['badput_seconds'][k]:>11.1f}s" for k in kinds)
        )
    fixed = [r for r in runs if r["cadence"] != "auto"]
    best = max(fixed, key=lambda r: r["goodput_ratio"])
    auto = next(r for r in runs if r["cadence"] == "auto")
    print(
        f"auto - best fixed ({best['cadence']} s): "
        f"{(auto['goodput_ratio'] - best['goodput_ratio']) * 100:+.2f} points of goodput"
    )
    per_preemption = ours["sigterm_to_exit_s"] + ours["start_to_first_step_s"]
    print(
        f"one preemption with notice: SIGTERM to exit {ours['sigterm_to_exit_s']:.2f} s, "
        f"new start to first step {ours['start_to_first_step_s']:.2f} s; at one per 30 "
        f"minutes that leaves {1 - per_preemption / 1800:.2%} goodput (between_attempts aside)"
    )


if __name__ == "__main__":
    main()
