"""The packed decode state the device hash kernels update in place (`triton_hash.stream_hash`,
`triton_hash.stream_commit`, their torch twins in `reference`), and its error codes.

One int64 row per sequence, so that uploading or downloading a whole stream is one copy and the
kernels take one pointer. Columns (W = max_ngram - 1 look-back tokens, C = draft capacity):

    [0, W)            committed look-back window, most recent first, pads and blocking applied
    W                 committed tokens (position)
    W + 1             drafted tokens pending (n_draft)
    [W + 2, W + 2 + C)        drafted compressed ids (pad where dead)
    [W + 2 + C, W + 2 + 2C)   drafted flags: FLAG_DEAD | FLAG_START | FLAG_END
    [W + 2 + 2C, + 4)         the first error the kernels found: code, position, value, extra

Imports nothing; knows nothing of triton or of `HashStream` (addressing/stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ERR_BAD_ID",
    "ERR_COMMIT",
    "ERR_DRAFTS_PENDING",
    "ERR_DRAFT_FULL",
    "FLAG_DEAD",
    "FLAG_END",
    "FLAG_START",
    "StreamLayout",
]

# drafted-token flags (the host's draft_dead / draft_starts / draft_ends, one bit each)
FLAG_DEAD, FLAG_START, FLAG_END = 1, 2, 4

# error codes (column `err`): the call that found one left that sequence unchanged
ERR_BAD_ID = 1  # position: the token's position in its sequence; value: the id; extra: its index in the call
ERR_DRAFTS_PENDING = 2  # a step with drafts pending; position: committed tokens; value: n_draft
ERR_DRAFT_FULL = 3  # a draft past the capacity; value: n_draft; extra: tokens asked
ERR_COMMIT = 4  # commit(n) of more than drafted; value: n; extra: n_draft


@dataclass(frozen=True)
class StreamLayout:
    """Column offsets of the packed state for a window of `window` tokens and `max_draft` drafts."""

    window: int  # W
    max_draft: int  # C

    def __post_init__(self) -> None:
        if self.window < 1 or self.max_draft < 1:
            raise ValueError(f"window={self.window} and max_draft={self.max_draft} must both be >= 1")

    @property
    def position(self) -> int:
        return self.window

    @property
    def n_draft(self) -> int:
        return self.window + 1

    @property
    def vals(self) -> int:
        return self.window + 2

    @property
    def flags(self) -> int:
        return self.window + 2 + self.max_draft

    @property
    def err(self) -> int:
        return self.window + 2 + 2 * self.max_draft

    @property
    def columns(self) -> int:
        return self.err + 4
