"""`runner run --mirror` resumed at more ranks (1 -> 2 under real torchrun): the step is
rescaled down (step x 1 / 2), the trainer re-bases its run dir, and the supervisor, which owns
the mirror, follows the run by progress (samples seen, not step numbers): the new lineage is
uploaded and the bucket's older 1-rank checkpoints numbered above it are de-committed. The
bucket alone then resumes the final state (the run dir deleted).

The stop during the rescaled run goes through SeaweedFS behind the fault proxy (a fake only
for the fault): the re-based checkpoint's manifest is refused (503) until its background upload
gave up, and the stop lands right after the 2-rank run committed a step above it, so the stop
always races the re-base, whatever the machine's speed. When it never lands (every manifest
refused), the stop exits 1, not 75, and the next attempt re-bases again."""

from __future__ import annotations

import functools
import json
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.layout import CHECKPOINTS_DIR, MANIFEST_NAME, step_dir_name
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.storage.base import Storage
from runner.storage.file import FileStorage
from runner.storage.s3 import S3Storage
from tests.fixtures.cli_process import runner as run_runner
from tests.fixtures.fault_proxy import SLOW_DOWN, FaultProxy, Request
from tests.fixtures.multirank import final_fingerprint
from tests.fixtures.s3 import SeaweedS3
from tests.fixtures.supervised import Supervised

pytestmark = pytest.mark.e2e

BATCH = 4


def _start(
    started: list[Supervised],
    run_dir: Path,
    mirror: Path | str,
    *,
    ranks: int,
    steps: int,
    env: dict[str, str] | None = None,
    keep: int = 3,
    grace: float = 60,
) -> Supervised:
    launcher = [sys.executable, "-m", "runner"]
    if ranks > 1:
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "-m", "runner",
        ]  # fmt: skip
    uri = mirror if isinstance(mirror, str) else mirror.as_uri()
    args = [
        "--run-dir", str(run_dir), "--mirror", uri, "--grace-seconds", str(grace), "--",
        *launcher, "demo", "--run-dir", str(run_dir), "--steps", str(steps),
        "--ckpt-every", "5", "--batch-size", str(BATCH), "--device", "cpu", "--threads", "1",
        "--no-progress", "--keep", str(keep),
    ]  # fmt: skip
    s = Supervised(args, env={"OMP_NUM_THREADS": "1", **(env or {})})
    started.append(s)
    return s


def _bucket(mirror: Path | Storage) -> dict[int, tuple[int, int]]:
    """step -> (samples_seen, world_size) of every checkpoint committed in the bucket."""
    store = FileStorage(mirror) if isinstance(mirror, Path) else mirror
    out = {}
    for step in list_checkpoints(store):
        m = read_manifest(store, step)
        out[step] = (m.samples_seen, m.world_size)
    return out


def _verify(mirror: Path | str) -> None:
    checked = run_runner("verify", mirror if isinstance(mirror, str) else mirror.as_uri())
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _aside(store: Storage) -> list[str]:
    """The steps whose manifests were set aside in the bucket (de-committed), with why."""
    return sorted({info.key.split("/")[1] for info in store.list("aside/")})


def _logged(s: Supervised, text: str) -> bool:
    return any(text in line for line in list(s.stderr))


def _wait(what: str, s: Supervised, ready: Callable[[], object], timeout: float = 240) -> None:
    """Until `ready()` (a condition on the log, the run dir or the proxy); never a guess."""
    end = time.monotonic() + timeout
    while not ready():
        assert s.proc.poll() is None, f"exited {s.proc.returncode} before {what}:\n{s.err}"
        assert time.monotonic() < end, f"no {what} in {timeout:g} s:\n{s.err}"
        time.sleep(0.05)


def _wait_2rank_past(s: Supervised, run_dir: Path, step: int, timeout: float = 180) -> int:
    """Until the 2-rank run committed a checkpoint numbered above `step`; its step."""
    end = time.monotonic() + timeout
    while True:
        for path in sorted((run_dir / "checkpoints").glob("step_*/manifest.json")):
            try:
                with_step = json.loads(path.read_text())
            except FileNotFoundError:  # set aside (the re-base) or pruned since the glob
                continue
            if with_step["world_size"] == 2 and with_step["step"] > step:
                return int(with_step["step"])
        assert s.proc.poll() is None, f"exited {s.proc.returncode}:\n{s.err}"
        assert time.monotonic() < end, f"no 2-rank checkpoint past {step}:\n{s.err}"
        time.sleep(0.05)


def test_resumed_at_2_ranks_the_bucket_follows_the_rebase_and_resumes_alone(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """The reviewer's reproduction: a finished 1-rank run (step 20, 80 samples) resumed at 2
    ranks is the same state at step 10; it must become the bucket's newest."""
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    first = _start(supervised_launches, run_dir, mirror, ranks=1, steps=20)
    assert first.wait(300) == 0, first.err
    assert max(_bucket(mirror)) == 20 and _bucket(mirror)[20] == (80, 1)

    resized = _start(supervised_launches, run_dir, mirror, ranks=2, steps=20)
    assert resized.wait(300) == 0, resized.err
    bucket = _bucket(mirror)
    assert max(bucket) == 10 and bucket[10] == (80, 2), bucket
    assert all(step <= 10 for step in bucket), bucket  # the 1-rank 15 and 20 de-committed
    assert "mirror: de-committing step 20 (80 samples)" in resized.err, resized.err
    assert "holds a different checkpoint" not in resized.err, resized.err
    ended = final_fingerprint(resized.err)
    assert ended[0] == 10
    _verify(mirror)

    shutil.rmtree(run_dir)  # the bucket alone
    again = _start(supervised_launches, run_dir, mirror, ranks=2, steps=20)
    assert again.wait(300) == 0, again.err
    assert f"resuming from step 10, downloaded from {mirror.as_uri()}" in again.err, again.err
    assert final_fingerprint(again.err) == ended  # the final state, nothing trained
    assert "world size changed" not in again.err, again.err  # a 2-rank checkpoint
    # loss.jsonl holds only the history restored from the checkpoint: no step was trained
    records = [json.loads(line) for line in (run_dir / "loss.jsonl").read_text().splitlines()]
    assert records and all(r.get("restored_from") == "checkpoint step 10" for r in records)
    assert list_checkpoints(FileStorage(run_dir)) == [10]
    assert _bucket(mirror) == bucket


# Where the 1-rank run is stopped (N) before the resize: the re-based step is N // 2, and the
# rescaled run, stopped a checkpoint past it, must stay below N. Its slack, N // 2 steps, is
# far more than the 2-rank demo trains between that checkpoint and its stop, even on an idle
# machine (up to about 25 steps seen at 30 steps/s: the supervisor's scan, the upload start,
# the stop agreed at a step boundary).
FIRST_STOP = 80
STEPS = 400  # the run's length at 1 rank: 200 steps at 2, far past any stop

# A trainer defect (runner/runtime/lifecycle.py backfill_loss_log, not the supervisor's): a
# resume rescaled down restores the checkpoint's 1-rank loss history past the new step
# (loss.jsonl logs steps 11..N after step 10), so a final checkpoint below N looks as if
# steps were logged past it, and the stop exits 1.
LOSS_BACKFILL_DEFECT = "steps up to {stopped} it logged after it are lost"


@pytest.mark.parametrize(
    "past", [False, True], ids=["final-below-the-1-rank-steps", "final-past-them"]
)
def test_a_stop_during_the_rescaled_run_exits_75_with_its_final_checkpoint_the_buckets_newest(
    supervised_launches: list[Supervised],
    tmp_path: Path,
    past: bool,
    s3_server: SeaweedS3,
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1-rank run stopped at N (>= FIRST_STOP), resumed at 2 ranks (step N // 2) and stopped
    again after a 2-rank checkpoint numbered above N // 2 (`past`: above N): 75, the final
    checkpoint is the bucket's newest by step, the re-based checkpoint N // 2 is committed
    (below N), the 1-rank steps from it up are de-committed (kept aside), and every
    checkpoint numbered above N // 2 is a 2-rank one.

    Below N, the stop races the re-base: the re-based checkpoint's manifest is refused (503)
    until its first upload gave up, and the stop lands as soon as the 2-rank run committed a
    step above it, so the re-based checkpoint is still not in the bucket when the trainer
    stops: it must land before the final one, and the stale 1-rank steps must go."""
    location = f"s3://{s3_server.create_bucket()}/run"
    through_proxy = {**s3_server.env(), "AWS_ENDPOINT_URL_S3": fault_proxy.endpoint}
    for name, value in s3_server.env().items():  # the test reads the server directly
        monkeypatch.setenv(name, value)
    remote = S3Storage.from_uri(location)
    run_dir = tmp_path / "run"
    # the trainer's own retention keeps the re-based checkpoint however far the bucket lags
    start = functools.partial(
        _start, supervised_launches, run_dir, location, steps=STEPS, env=through_proxy, keep=40
    )
    first = start(ranks=1)
    manifest = run_dir / "checkpoints" / step_dir_name(FIRST_STOP) / "manifest.json"
    end = time.monotonic() + 180
    while not manifest.exists():
        assert first.proc.poll() is None and time.monotonic() < end, first.err
        time.sleep(0.05)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(120) == 75, first.err
    stopped = max(_bucket(remote))
    assert stopped >= FIRST_STOP and _bucket(remote)[stopped] == (stopped * BATCH, 1)
    rescaled = stopped // 2
    old_lineage = set(_bucket(remote))

    refusing, uploading = threading.Event(), threading.Event()
    base_dir = f"/{CHECKPOINTS_DIR}/{step_dir_name(rescaled)}/"

    def plan(request: Request) -> str | None:
        if request.method == "PUT" and base_dir in request.path:
            uploading.set()  # the re-based checkpoint's upload has begun
        held = request.operation == "PutManifest" and request.path.endswith(MANIFEST_NAME)
        return SLOW_DOWN if held and base_dir in request.path and refusing.is_set() else None

    if not past:
        refusing.set()
        fault_proxy.plan = plan
    resized = start(ranks=2)
    if past:
        _wait_2rank_past(resized, run_dir, stopped)
        resized.proc.send_signal(signal.SIGTERM)
    else:
        # the re-based checkpoint's upload has begun (it cannot land: its manifest is
        # refused) and the 2-rank run committed a step above it: stop now
        _wait("the re-based checkpoint's upload", resized, uploading.is_set)
        _wait_2rank_past(resized, run_dir, rescaled)
        resized.proc.send_signal(signal.SIGTERM)
        # the refusal lasts until the first upload of the re-based step gave up, then the
        # store is healthy again
        gave_up = f"mirror: upload of step {rescaled} to {location} failed"
        _wait("the re-based upload to give up", resized, lambda: _logged(resized, gave_up))
        refusing.clear()
        assert fault_proxy.injected_faults()[SLOW_DOWN] >= 1
    code = resized.wait(240)
    bucket = _bucket(remote)
    final = max(bucket)
    said = f"bucket {bucket}:\n{resized.err}"
    assert (final > stopped) if past else (final < stopped), said
    if not past:  # (past them, the bucket's retention may have pruned it since)
        assert bucket.get(rescaled) == (stopped * BATCH, 2), said
    # (a 1-rank step numbered N // 2 itself may stay: older by both number and samples)
    for step, (samples, world) in bucket.items():
        if step > rescaled:
            expected = (stopped * BATCH + (step - rescaled) * 2 * BATCH, 2)
            assert (samples, world) == expected, f"step {step}: {said}"
    # de-committed, not deleted: every 1-rank step from the re-based one up is kept aside
    aside = _aside(remote)
    for step in (s for s in old_lineage if s >= rescaled):
        assert any(a.startswith(f"{step_dir_name(step)}-") for a in aside), (step, aside)
    assert "holds a different checkpoint" not in resized.err, resized.err
    _verify(location)
    # the trainer does not backfill loss.jsonl past the rescaled step (it would make the
    # final checkpoint look as if steps logged after it were lost)
    assert LOSS_BACKFILL_DEFECT.format(stopped=stopped) not in resized.err, resized.err
    assert code == 75, resized.err
    assert f"final checkpoint step {final} is in the mirror" in resized.err, resized.err


def test_a_stop_whose_rebased_step_never_reaches_the_bucket_exits_1_and_the_next_attempt_rebases(
    supervised_launches: list[Supervised],
    tmp_path: Path,
    s3_server: SeaweedS3,
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, but the bucket refuses every manifest (503) for the whole rescaled attempt:
    the re-based checkpoint never lands, nor anything after it, so the stop exits 1, not 75,
    and the bucket keeps the older lineage's newest (the rest of it from the re-based step up
    kept aside). The same command again, the bucket healthy, resumes the run dir's newest work
    (the re-based lineage's, newer by samples seen than the bucket's older step) and ends
    with the new lineage above the re-based step."""
    location = f"s3://{s3_server.create_bucket()}/run"
    through_proxy = {**s3_server.env(), "AWS_ENDPOINT_URL_S3": fault_proxy.endpoint}
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    remote = S3Storage.from_uri(location)
    run_dir = tmp_path / "run"
    start = functools.partial(
        _start, supervised_launches, run_dir, location, steps=STEPS, env=through_proxy, keep=40
    )
    first = start(ranks=1)
    manifest = run_dir / "checkpoints" / step_dir_name(FIRST_STOP) / "manifest.json"
    _wait(f"step {FIRST_STOP}", first, manifest.exists)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(120) == 75, first.err
    stopped = max(_bucket(remote))
    rescaled = stopped // 2

    refusing = threading.Event()
    refusing.set()
    fault_proxy.plan = lambda r: (
        SLOW_DOWN if refusing.is_set() and r.operation == "PutManifest" else None
    )
    refused = start(ranks=2, grace=15)
    _wait_2rank_past(refused, run_dir, rescaled)
    refused.proc.send_signal(signal.SIGTERM)
    assert refused.wait(240) == 1, refused.err
    said = f"bucket {_bucket(remote)}:\n{refused.err}"
    assert f"exiting 1, not 75: the re-based checkpoint step {rescaled} did not reach" in said
    # the older lineage's newest holds the state; from the re-based step up nothing else
    kept = {step: ckpt for step, ckpt in _bucket(remote).items() if step >= rescaled}
    assert kept == {stopped: (stopped * BATCH, 1)}, said
    assert all(world == 1 for _, world in _bucket(remote).values()), said

    # the run dir holds the re-based lineage's newer work, which never reached the bucket:
    # newest by progress (samples seen), it is resumed, not the bucket's older step
    local = _bucket(run_dir)
    newest = max(local, key=lambda step: local[step])
    assert local[newest][1] == 2 and local[newest][0] > stopped * BATCH, local
    refusing.clear()
    again = start(ranks=2)
    assert again.wait(300) == 0, again.err
    assert f"resuming from local checkpoint step {newest}" in again.err, again.err
    assert "re-basing the run" not in again.err, again.err
    bucket = _bucket(remote)
    said = f"bucket {bucket}:\n{again.err}"
    # the run's length in samples, at 2 * BATCH a step from the re-based one (rounded up)
    assert max(bucket) == rescaled - (stopped * BATCH - STEPS * BATCH) // (2 * BATCH), said
    for step, (samples, world) in bucket.items():
        # above the re-based step: the new lineage, and at most the older one's step kept
        # (retention by progress takes it first; it is never resumed over newer work)
        assert step <= rescaled or world == 2 or step == stopped, said
        if step > rescaled and world == 2:
            assert samples == stopped * BATCH + (step - rescaled) * 2 * BATCH, said
    _verify(location)
