"""Characters to tensors and fixed windows to training batches for the demo model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.errors import ConfigError


class CharVocab:
    """The sorted set of characters of a text; ids are positions in it."""

    def __init__(self, text: str) -> None:
        self.chars = "".join(sorted(set(text)))
        self._index = {ch: i for i, ch in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[ch] for ch in text], dtype=torch.long)
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from exc

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.chars[i] for i in values)


class WindowDataset:
    """Non-overlapping windows of ``context + 1`` tokens: sample i is input/target of window i.

    Non-overlapping windows keep an epoch short and every character seen once per epoch, which
    makes "where in the epoch are we" meaningful for the resume audit.
    """

    def __init__(self, tokens: torch.Tensor, *, context: int, limit: int | None = None) -> None:
        count = (len(tokens) - 1) // context
        if limit is not None:
            count = min(count, limit)
        if count < 1:
            raise ConfigError(f"a text of {len(tokens)} tokens has no window of {context + 1}")
        self.tokens = tokens
        self.context = context
        self._count = count
        self._offsets = torch.arange(context + 1)

    def __len__(self) -> int:
        return self._count

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[len(indices), context]``."""
        starts = torch.tensor(indices, dtype=torch.long) * self.context
        windows = self.tokens[starts[:, None] + self._offsets]
        return windows[:, :-1], windows[:, 1:]
