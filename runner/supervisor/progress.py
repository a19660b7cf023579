"""Which committed checkpoint is newer: by progress (samples seen), not by number.

A run resumed at more ranks rescales its step down (step x N / M), so a newer state can carry
a lower number than an older one. Checkpoints without counters (seed-bin files adopted with
samples_seen 0) are ordered by step, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.checkpoint.writer import CommittedCheckpoint


@dataclass(frozen=True)
class Progress:
    step: int
    samples: int  # 0: unknown (no counters)

    @classmethod
    def of(cls, ckpt: CommittedCheckpoint) -> Progress:
        return cls(step=ckpt.step, samples=ckpt.manifest.samples_seen)

    def newer_than(self, other: Progress | None) -> bool:
        """More samples (same samples: a larger step); by step when either has no counters."""
        if other is None:
            return True
        if self.samples == 0 or other.samples == 0:
            return self.step > other.step
        return (self.samples, self.step) > (other.samples, other.step)


def newer(ckpt: CommittedCheckpoint, than: CommittedCheckpoint | None) -> bool:
    """Whether `ckpt` supersedes `than`: newer by progress, or the same state re-based at a
    lower step (the trainer set `than`'s directory aside: its state now lives at `ckpt`)."""
    if than is None:
        return True
    mine, theirs = Progress.of(ckpt), Progress.of(than)
    if mine.newer_than(theirs):
        return True
    rebased = mine.samples == theirs.samples != 0 and ckpt.step < than.step
    return rebased and not than.path.is_dir()


def newest_of(progress: list[Progress]) -> Progress | None:
    best: Progress | None = None
    for p in progress:
        if p.newer_than(best):
            best = p
    return best
