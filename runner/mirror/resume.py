"""Where to resume from: the newest checkpoint that verifies (and loads), local or in the
mirror — or a refusal to start at all.

Resume or refuse: when a run dir or its mirror holds checkpoints and none of them can be
used, starting again at step 0 would, step by step, replace the history a user may need (a
rolling downgrade, a torch upgrade, a damaged disk). So training refuses (exit 3) with the
list of every checkpoint and why it was refused, and writes nothing. `fresh_start` is the
explicit way past that: the unusable checkpoints are set aside (runner.checkpoint.aside),
never deleted, and training starts at step 0. It only acts when nothing usable exists: a
setting left on in a deploy file never discards a good checkpoint.

Long (about 320 lines): one resolution (newest first, local then mirror) and the refusal it
reports; downloading and loading live in runner.mirror.download and the caller's `load`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from runner.atomicity.temp import temp_name
from runner.checkpoint.aside import CORRUPT, FOREIGN, decommit_remote, set_aside_local
from runner.checkpoint.layout import (
    CHECKPOINTS_DIR,
    parse_seed_bin,
    parse_step_dir,
    step_dir_name,
)
from runner.checkpoint.listing import list_checkpoints, read_manifest_dir
from runner.checkpoint.load import read_beside_verify
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.newest import newest_first, read_manifests
from runner.checkpoint.resume_point import Refusal, ResumePoint
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import (
    IntegrityError,
    RunnerError,
    SchemaError,
    StorageNotFoundError,
    UnusableCheckpointsError,
)
from runner.mirror.download import download_checkpoint, replace_only_corrupt
from runner.preemption.startup import check_not_abandoned, publishing
from runner.storage.base import ProgressCallback, Storage

log = logging.getLogger(__name__)

SkipCallback = Callable[[int, str], None]
# Deserialise (and check) a verified local checkpoint; raises RunnerError when it cannot.
LoadFn = Callable[[Path, Manifest], Any]


def choose_resume(
    run_dir: Path,
    mirror: Storage | None,
    *,
    load: LoadFn | None = None,
    on_skip: SkipCallback | None = None,
    progress: ProgressCallback | None = None,
    fresh_start: bool = False,
    refusal_log_level: int = logging.WARNING,
) -> ResumePoint[Any] | None:
    """The newest checkpoint that verifies (and that `load` accepts), taken from the run dir
    or, when the mirror has a newer one, downloaded (and verified as it arrives) from it.
    Newest is by progress (runner.checkpoint.newest: every manifest is read to order them).
    Each checkpoint skipped goes to `on_skip(step, why)` and the next older one is tried;
    each is hashed once, and no file older than the chosen one is read.

    None when there is no checkpoint anywhere (or, with `fresh_start`, after the unusable
    ones were set aside). UnusableCheckpointsError when checkpoints exist and none can be
    used. A mirror that cannot be reached raises (after retries) rather than falling back:
    starting from scratch because the bucket was briefly unreachable would throw work away.
    Each refusal is logged once, at `refusal_log_level` (a trainer under `runner run` lowers
    it: its supervisor resolved the same run dir and already logged them).

    Long: one walk over the steps, newest first, trying the local copy then the mirror's,
    read top to bottom."""
    run_dir = Path(run_dir)
    local_steps, seed_files = _local_entries(run_dir)
    remote_steps = set(list_checkpoints(mirror)) if mirror is not None else set()
    refused: list[Refusal] = []

    def refuse(refusal: Refusal) -> None:
        refused.append(refusal)
        log.log(refusal_log_level, "not resuming from step %d: %s", refusal.step, refusal.why)
        if on_skip is not None:
            on_skip(refusal.step, refusal.why)

    # two locations' steps, each tried locally then in the mirror, whose copy may replace
    # only the local one just refused (two refusals a step), and a manifest-less local step_N
    # counted (list_checkpoints skips it)
    for step in _newest_first(local_steps, mirror, remote_steps):
        local_refusal: Refusal | None = None
        if step in local_steps:
            point = _try_local(step, local_steps[step], load=load, refuse=refuse)
            if point is not None:
                log.info("resuming from local checkpoint step %d", step)
                return replace(point, refused=tuple(refused))
            local_refusal = refused[-1]
        if mirror is not None and step in remote_steps:
            point = _try_remote(
                step, run_dir, mirror, load=load, refuse=refuse, progress=progress,
                replacing=local_refusal,
            )  # fmt: skip
            if point is not None:
                log.info("resuming from step %d, downloaded from %s", step, mirror.uri)
                return replace(point, refused=tuple(refused))
    refused.extend(_seed_refusals(seed_files))
    if not refused:
        return None
    if not fresh_start:
        raise UnusableCheckpointsError(_refusal_message(run_dir, mirror, refused))
    _set_aside(run_dir, refused)
    return None


def _newest_first(
    local_steps: dict[int, Path], mirror: Storage | None, remote_steps: set[int]
) -> list[int]:
    """Every step of the run dir and the mirror, newest first by progress: each ordered by
    its local manifest, or the mirror's when the local one is missing or unreadable."""
    known: dict[int, Manifest | None] = {}
    for step, step_dir in local_steps.items():
        try:
            known[step] = read_manifest_dir(step_dir)
        except (OSError, RunnerError, ValueError):
            known[step] = None
    if mirror is not None:
        known |= read_manifests(mirror, [s for s in remote_steps if known.get(s) is None])
    return newest_first(known)


def _seed_refusals(seed_files: list[Path]) -> list[Refusal]:
    """Seed-format files waiting in the checkpoint directory: not resumable from here."""
    return [
        Refusal(
            step=parse_seed_bin(path.name) or 0,
            why=(
                f"{path}: a seed-format file waiting in the checkpoint directory; only "
                "`runner run` adopts those (or convert it: `runner convert`)"
            ),
            foreign=True,
            local_path=path,
        )
        for path in seed_files
    ]


def resolve_resume(
    run_dir: Path,
    mirror: Storage | None,
    *,
    on_skip: SkipCallback | None = None,
    progress: ProgressCallback | None = None,
    fresh_start: bool = False,
) -> Path | None:
    """The local directory of the checkpoint `choose_resume` picks (verified, not loaded).
    It was hashed moments ago: `load_state(..., verified=True)` skips a second pass."""
    point = choose_resume(
        run_dir, mirror, on_skip=on_skip, progress=progress, fresh_start=fresh_start
    )
    return point.step_dir if point is not None else None


def _local_entries(run_dir: Path) -> tuple[dict[int, Path], list[Path]]:
    """Every `step_N` entry of the checkpoint directory (a committed checkpoint or what
    looks like one: with or without a manifest, even a file) and every seed `.bin` there."""
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    steps: dict[int, Path] = {}
    seeds: list[Path] = []
    if ckpt_dir.is_symlink():  # the rule every other reader applies (runner.storage.file)
        raise IntegrityError(
            f"{ckpt_dir} is a symlink; refusing to follow it. Point --run-dir at the real "
            "directory (the run dir itself may be a link)"
        )
    if not ckpt_dir.is_dir():
        return steps, seeds
    for entry in ckpt_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None:
            steps[step] = entry
        elif parse_seed_bin(entry.name) is not None:
            seeds.append(entry)
    return steps, sorted(seeds)


def _try_local(
    step: int,
    step_dir: Path,
    *,
    load: LoadFn | None,
    refuse: Callable[[Refusal], None],
) -> ResumePoint[Any] | None:
    try:
        # the local-directory check: symlinks refused, files hashed in parallel; the load
        # (its own path and size checks first) deserialises beside the hashing, and what it
        # read is used only if every byte verified
        if load is None:
            return _point(step_dir, verify_dir(step_dir), loaded=None)
        listed = read_manifest_dir(step_dir)
        manifest, loading = read_beside_verify(
            lambda: verify_dir(step_dir, manifest=listed), lambda: load(step_dir, listed)
        )
    except RunnerError as exc:
        refuse(
            Refusal(
                step=step,
                why=f"local: {exc}",
                foreign=isinstance(exc, SchemaError),
                local_path=step_dir,
            )
        )
        return None
    try:
        loaded = loading.result()
    except RunnerError as exc:
        # it verified: the bytes are what was written, this runner just cannot use them
        refuse(
            Refusal(
                step=step,
                why=f"{step_dir}: verifies but cannot be loaded: {exc}",
                foreign=True,
                local_path=step_dir,
            )
        )
        return None
    return _point(step_dir, manifest, loaded=loaded)


def _try_remote(
    step: int,
    run_dir: Path,
    mirror: Storage,
    *,
    load: LoadFn | None,
    refuse: Callable[[Refusal], None],
    progress: ProgressCallback | None,
    replacing: Refusal | None,
) -> ResumePoint[Any] | None:
    """Download a mirror's checkpoint into a staging dir, load it there, and only then put
    it in the run dir (setting aside the unusable local copy of that step, if any): a
    refusal leaves the run dir as it was. Long: download, load and publish share one staging
    directory and its cleanup."""
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # a writer-style temp name: cleanup_partial removes what a crash leaves
    incoming = ckpt_dir / temp_name("incoming")
    try:
        try:
            staged = download_checkpoint(mirror, step, incoming, progress=progress)
        except (IntegrityError, StorageNotFoundError) as exc:  # corrupt or incomplete there
            refuse(
                Refusal(
                    step=step,
                    why=f"{mirror.uri}: {exc}",
                    foreign=isinstance(exc, SchemaError),
                    remote=mirror,
                )
            )
            return None
        manifest = read_manifest_dir(staged)  # hashed as it arrived
        loaded = None
        if load is not None:
            try:
                loaded = load(staged, manifest)
            except RunnerError as exc:
                refuse(
                    Refusal(
                        step=step,
                        why=f"{mirror.uri}: verifies but cannot be loaded: {exc}",
                        foreign=True,
                        remote=mirror,
                    )
                )
                return None
        final = ckpt_dir / step_dir_name(step)
        refused = None
        if replacing is not None and replacing.local_path is not None:
            # the walk refused the local copy: it goes aside as judged, not hashed again
            refused = (replacing.local_path, FOREIGN if replacing.foreign else CORRUPT)
        with publishing():  # never once a stop has given start-up up (runner.preemption.startup)
            manifest = replace_only_corrupt(manifest, refused=refused).publish(staged, final)
        return _point(final, manifest, loaded=loaded, from_mirror=True)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def _point(
    step_dir: Path, manifest: Manifest, *, loaded: Any, from_mirror: bool = False
) -> ResumePoint[Any]:
    checkpoint = CommittedCheckpoint(step=manifest.step, path=step_dir, manifest=manifest)
    return ResumePoint(checkpoint=checkpoint, loaded=loaded, from_mirror=from_mirror)


def _refusal_message(run_dir: Path, mirror: Storage | None, refused: list[Refusal]) -> str:
    where = f"{run_dir}" + (f" and {mirror.uri}" if mirror is not None else "")
    lines = [
        f"refusing to start: {len(refused)} checkpoint(s) in {where} and none of them can be "
        "resumed from; nothing was written, replaced or deleted:"
    ]
    lines += [f"  - step {r.step}: {r.why}" for r in refused]
    lines.append(
        "What to do: a newer schema or format needs the spot-runner/trainer version that wrote "
        "it; a damaged copy can be restored from another location (`runner pull`, `runner "
        "repair`). To start again at step 0 anyway, pass --fresh-start (RUNNER_FRESH_START=1): "
        f"these checkpoints are then moved to {run_dir}/aside/"
        + (" (and de-committed to aside/ in the mirror)" if mirror is not None else "")
        + ", kept and never deleted; or use a new --run-dir."
    )
    return "\n".join(lines)


def _set_aside(run_dir: Path, refused: list[Refusal]) -> None:
    """--fresh-start: move every unusable checkpoint out of the way, keeping its bytes."""
    for r in refused:
        reason = FOREIGN if r.foreign else CORRUPT
        if r.local_path is not None and r.local_path.exists():
            with publishing():
                set_aside_local(run_dir, r.local_path, reason=reason)
        elif r.remote is not None:
            check_not_abandoned()  # a store call may hang: not under the gate's lock
            decommit_remote(r.remote, r.step, reason=reason)
    log.warning(
        "--fresh-start: %d unusable checkpoint(s) set aside (listed above); starting at step 0",
        len(refused),
    )
