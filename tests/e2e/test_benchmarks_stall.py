"""benchmarks/stall.py still runs against the current code and reports every figure the README
quotes (a tiny state: 15 Linear(115, 115) layers, 200,100 parameters; a warm-up round and one
counted round of 3-step training turns per mode). This checks that each section measures
what it says and that the checkpoints it made are real ones, not how fast anything is."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = REPO / "benchmarks" / "stall.py"
WIDTH, LAYERS = 115, 15  # isqrt(200_000 // 15) = 115
PARAMS = LAYERS * (WIDTH * WIDTH + WIDTH)
SAVES, SYNC_SAVES, DCP_SAVES, BACK_TO_BACK, EVERY, CYCLES = 4, 2, 2, 3, 3, 1
TINY = [
    *("--params", "200000", "--saves", str(SAVES), "--sync-saves", str(SYNC_SAVES)),
    *("--dcp-saves", str(DCP_SAVES), "--back-to-back", str(BACK_TO_BACK)),
    *("--every", str(EVERY), "--cycles", str(CYCLES), "--copies", "2", "--step-samples", "2"),
]


def test_the_stall_benchmark_measures_and_reports_every_figure(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), *TINY, "--json", "--dir", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout)
    assert list(tmp_path.iterdir()) == [], "the benchmark leaves its scratch files behind"

    state = results["state"]
    assert (state["params"], state["width"], state["layers"]) == (PARAMS, WIDTH, LAYERS)
    assert state["state_bytes"] == 12 * PARAMS  # fp32 weights + AdamW m and v
    assert state["torch_threads"] == 1

    # the copy floor copies what an async save copies: the same bytes as the host buffers
    copy, sync, background = results["copy"], results["sync"], results["async"]
    assert background["buffer_bytes"] == copy["bytes"]
    assert state["state_bytes"] < copy["bytes"] < 1.1 * state["state_bytes"]  # + RNG, steps
    assert len(copy["warm_seconds"]) == 2 and copy["first_seconds"] > 0
    assert len(sync["seconds"]) == SYNC_SAVES and all(t > 0 for t in sync["seconds"])
    assert len(background["stall_seconds"]) == SAVES
    assert len(background["persist_seconds"]) == SAVES
    # persist is timed from the save's start to its commit: it includes the stall
    for stall, persist in zip(
        background["stall_seconds"], background["persist_seconds"], strict=True
    ):
        assert 0 < stall <= persist
    assert len(background["back_to_back_stall_seconds"]) == BACK_TO_BACK - 1
    rss = background["rss_bytes"]
    assert sorted(rss) == ["after", "after_first", "before"] and all(v > 0 for v in rss.values())
    assert len(results["dcp"]["stall_seconds"]) == DCP_SAVES
    assert len(results["dcp"]["persist_seconds"]) == DCP_SAVES
    cached = results["dcp_cached"]
    assert ("unavailable" in cached) != ("stall_seconds" in cached), cached

    # the newest async and sync checkpoints verify and hold the live state
    assert results["checks"] == {
        "async_verifies": True,
        "sync_verifies": True,
        "async_fingerprint_is_live": True,
        "sync_fingerprint_is_live": True,
    }

    training = results["training"]
    assert (training["every"], training["every_from"], training["cycles"]) == (
        EVERY,
        "--every",
        CYCLES,
    )
    assert len(training["rounds"]) == CYCLES
    for one_round in (training["warmup"], *training["rounds"]):
        assert list(one_round) == ["none", "async", "async-normal", "sync"]
        for mode, turn in one_round.items():
            assert turn["steps"] == EVERY and turn["steps_per_second"] > 0, (mode, turn)
            # a turn begins with its mode's save; none saves nothing
            assert len(turn["stall_seconds"]) == (0 if mode == "none" else 1), (mode, turn)
            assert len(turn["step_seconds"]) == EVERY, (mode, turn)
        for background_turn in (one_round["async"], one_round["async-normal"]):
            assert isinstance(background_turn["persisted_in_turn"], bool)
            assert 0 <= background_turn["steps_while_saving"] <= EVERY
            # the turn's one save starts at its first step: in flight after a prefix of its
            # steps
            assert background_turn["persisted_in_turn"] == (
                background_turn["steps_while_saving"] < EVERY
            )

    summary = results["summary"]
    for key in (
        "warm_stall_over_copy",
        "warm_stall_over_sync",
        "first_stall_over_sync",
        "back_to_back_stall_over_sync",
        "dcp_warm_stall_over_copy",
        "async_warm_stall_over_dcp_warm_stall",
        "throughput_async_over_none",
        "throughput_sync_over_none",
        "throughput_async_over_none_total",
        "throughput_async-normal_over_none",
        "training_async_stall_seconds",
        "training_sync_first_stall_seconds",
        "steady_share_async_over_none",
        "steady_share_sync_over_none",
        "buffers_over_state",
    ):
        assert summary[key] > 0, (key, summary)

    # the table a plain run prints, from the same figures
    bench = runpy.run_path(str(BENCHMARK), run_name="bench_stall")
    lines = bench["report"](results)
    assert lines[0].startswith(f"stall: {PARAMS:,} parameters (15 Linear layers of 115)"), lines
    for prefix in (
        "copy into preallocated buffers",
        "sync save (whole save)",
        "async stall, first save",
        "async stall, warm (median)",
        "async persist (background)",
        "async stall, back-to-back saves",
        "DCP async_save stall, first",
        "DCP async_save stall, warm",
        "DCP async_save, cached",
        "ratio: async warm stall / copy ",
        "ratio: async warm stall / sync save ",
        "ratio: DCP warm stall / copy ",
        "ratio: async / DCP warm stall ",
        "memory: host buffers ",
        f"training: a checkpoint every {EVERY} steps (--every)",
        "  none ",
        "  async ",
        "  sync ",
        "ratio: throughput async / none ",
        "ratio: throughput sync / none ",
        "ratio: throughput async-normal / none ",
        "ratio: within-turn estimate async / none ",
        "ratio: within-turn estimate sync / none ",
    ):
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert lines[-1] == (
        "the newest async and sync checkpoints verify, both the live state's fingerprint"
    )


def test_n_is_chosen_so_that_a_sync_save_costs_a_tenth() -> None:
    choose_every = runpy.run_path(str(BENCHMARK), run_name="bench_stall")["choose_every"]
    assert choose_every(1.0, 0.5) == 20  # 1 s save / (0.1 x 0.5 s step)
    assert choose_every(0.4, 0.2) == 20
    assert choose_every(0.01, 0.5) == 1  # never less than every step
