"""runner.collective.step: the one collective step, in a real world of 2 over gloo (each rank a
process of its own; `_worker_steps` runs in them) and in the world of one.

Every failure is raised alike on every rank, naming the rank that failed; rank 0's own
exception of a kept type is raised there as it is; an `undo` is done before any rank hears
of the failure; no rank is left waiting (the ranks still meet at a barrier after each)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.collective import SINGLE
from runner.collective.failures import RankFailure, describe
from runner.collective.step import RanksFailed, Step
from runner.errors import CheckpointWriteError, ConfigError
from tests.fixtures.torchrun import GlooWorld

HERE = "tests.collective.test_step"


def _fail(failures: list[RankFailure], rank: int) -> CheckpointWriteError:
    return CheckpointWriteError(f"not done: {describe(failures, rank=rank)}")


def _outcome(run: Callable[[], object]) -> dict[str, object]:
    try:
        return {"value": run()}
    except Exception as exc:  # what this rank raised, as the test compares it
        return {"error": type(exc).__name__, "message": str(exc)}


def _worker_steps(marker: str) -> None:
    from runner.collective.group import dedicated_group

    group = dedicated_group(timeout_s=30)
    r = group.rank
    step = Step(group, fail=_fail, own=(ConfigError,))
    flag = Path(marker)
    flag.write_text("staged")

    def local_fails() -> int:
        if r == 1:
            raise OSError("disk gone (injected)")
        return r

    def rank_1_reports() -> RankFailure | int:
        return RankFailure(1, "said so (injected)") if r == 1 else r

    def decide_refuses() -> int:
        raise ConfigError("rank 0 refuses (injected)")

    def total(values: list[int]) -> int:
        return sum(values)

    def decide_finds_rank_1(values: list[int]) -> int:
        raise RanksFailed([RankFailure(1, f"sent {values[1]}, not 0 (injected)")])

    scenarios: dict[str, Callable[[], object]] = {
        "ok": lambda: step.run(lambda: r * 10, lambda values: sum(values) + 1),
        "gather": lambda: step.gather(lambda: ("rank", r)),
        "local_fails": lambda: step.run(local_fails, total, what="writing"),
        "local_reports": lambda: step.gather(rank_1_reports),
        "decide_own": lambda: step.decide(decide_refuses),
        "decide_other": lambda: step.run(lambda: r, decide_finds_rank_1),
        "undo": lambda: step.run(local_fails, total, undo=flag.unlink),
    }
    out = {}
    for name, scenario in scenarios.items():
        out[name] = _outcome(scenario)
        if name == "undo":  # asked right after this rank raised: rank 0 undid it before
            out[name]["flag_there"] = flag.exists()
        group.barrier()
    print(json.dumps(out))


@pytest.mark.slow
def test_every_failure_is_raised_alike_on_every_rank(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path
) -> None:
    world = gloo_world(f"{HERE}:_worker_steps", 2, str(tmp_path / "staged"))
    finished = world.wait(timeout=90)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    outcomes = [json.loads(f.stdout) for f in finished]
    for rank, out in enumerate(outcomes):
        mine = " (this one)" if rank == 1 else ""
        assert out["ok"] == {"value": 11}, rank
        assert out["gather"] == {"value": [["rank", 0], ["rank", 1]]}, rank
        err = "CheckpointWriteError"
        assert out["local_fails"] == {
            "error": err, "message": f"not done: rank 1: writing: disk gone (injected){mine}"
        }, rank  # fmt: skip
        assert out["local_reports"] == {
            "error": err, "message": f"not done: rank 1: said so (injected){mine}"
        }, rank  # fmt: skip
        # rank 0's own refusal stays what it is there (its exit code is its caller's)
        refused = (
            {"error": "ConfigError", "message": "rank 0 refuses (injected)"}
            if rank == 0
            else {"error": err, "message": "not done: rank 0: rank 0 refuses (injected)"}
        )
        assert out["decide_own"] == refused, rank
        assert out["decide_other"] == {
            "error": err, "message": f"not done: rank 1: sent 1, not 0 (injected){mine}"
        }, rank  # fmt: skip
        assert out["undo"] == {
            "error": err, "message": f"not done: rank 1: disk gone (injected){mine}",
            "flag_there": False,
        }, rank  # fmt: skip


def test_the_world_of_one_raises_its_own_failure_the_same_way() -> None:
    step = Step(SINGLE, fail=_fail, own=(ConfigError,))
    assert step.run(lambda: 4, lambda values: values[0] * 2) == 8
    with pytest.raises(CheckpointWriteError, match=r"^not done: rank 0: x: boom \(this one\)$"):
        step.gather(lambda: (_ for _ in ()).throw(OSError("boom")), what="x")
    with pytest.raises(ConfigError, match=r"^kept$"):
        step.decide(lambda: (_ for _ in ()).throw(ConfigError("kept")))
    with pytest.raises(CheckpointWriteError) as wrapped:
        step.decide(lambda: (_ for _ in ()).throw(ValueError("bad")), what="deciding")
    assert str(wrapped.value) == "not done: rank 0: deciding: bad (this one)"
    assert isinstance(wrapped.value.__cause__, ValueError)
