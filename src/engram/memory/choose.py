"""Which Engram rows carry a fact: the design question of memory patches.

A fact is a token sequence, prompt then target; Engram adds to the hidden state at position t what
the rows of the n-grams ending at t hold. `RowChoice`:
- ANSWER: the rows at the positions that predict the target's tokens (the prompt's last token up to
  the target's second-to-last). Direct, but the last n-grams before an answer are often common
  ("the city of"), and other text reads their rows.
- SUBJECT: the rows of every n-gram that holds a token of the fact's subject (its entity: "Talven
  Orrik"), wherever it ends: the fact's own trigger, which the model must carry to the answer.
- BOTH: the union.
An n-gram that reaches before the sequence's start (pads, then its first tokens) is never chosen:
every text that starts with those tokens reads it. `common` rows (those a reference text reads: `rows_read`, or other facts: `shared_rows`) are left
out, so that text is untouched; `max_rows` keeps the answer's rows first, then the longest n-grams,
the latest first. Knows tokens and rows, nothing of models.
"""

from __future__ import annotations

import enum

import numpy as np

from engram.addressing.hashing import NgramHasher

__all__ = [
    "FactTokens",
    "RowChoice",
    "default_reference_tokens",
    "fact_rows",
    "hash_fact",
    "merge_rows",
    "rows_read",
    "shared_rows",
]


class RowChoice(enum.StrEnum):
    """Which Engram rows carry a fact (module docstring).

    Attributes:
        ANSWER: The rows at the positions that predict the target's tokens (the prompt's last token
            up to the target's second-to-last).
        SUBJECT: The rows of every n-gram that holds a token of the fact's subject; for a fact
            without a subject, ANSWER's.
        BOTH: The union of ANSWER's and SUBJECT's.
    """

    ANSWER = "answer"
    SUBJECT = "subject"
    BOTH = "both"


class FactTokens:
    """A fact as token ids: `ids` = prompt + target, `prompt_len`, and the subject's token positions
    [start, stop) in the prompt (None: no subject given)."""

    def __init__(self, ids: list[int], prompt_len: int, subject: tuple[int, int] | None = None) -> None:
        if not 0 < prompt_len < len(ids):
            raise ValueError(
                f"a fact needs >= 1 prompt and >= 1 target token, got {prompt_len} of {len(ids)}"
            )
        self.ids, self.prompt_len, self.subject = list(ids), int(prompt_len), subject

    @property
    def answer_positions(self) -> range:
        """The positions whose next token is a target token."""
        return range(self.prompt_len - 1, len(self.ids) - 1)


def rows_read(hasher: NgramHasher, sequences: list[list[int]] | list[np.ndarray]) -> dict[int, np.ndarray]:
    """{layer id: sorted unique rows} that the token sequences read (e.g. a reference text's), however
    they are cut into blocks: a block's first tokens read pads before its start, so each sequence is
    hashed again with a window start every k + 1 tokens, at each phase, for k = 0 .. max_ngram_size - 2
    (a block starting k tokens before a position: what that position reads)."""
    back = hasher.config.max_ngram_size - 1
    out: dict[int, list[np.ndarray]] = {lid: [] for lid in hasher.config.layer_ids}
    for seq in sequences:
        ids = np.asarray(seq, dtype=np.int64)
        if not ids.size:
            continue
        passes: list[np.ndarray | None] = [None]
        for k in range(back):
            for phase in range(min(k + 1, ids.size)):
                starts = np.zeros(ids.size, dtype=bool)
                starts[phase :: k + 1] = True
                passes.append(starts)
        for starts in passes:
            rows = np.asarray(hasher.hash(ids, starts=starts))  # (T, layers, heads)
            for i, lid in enumerate(hasher.config.layer_ids):
                out[lid].append(rows[:, i].reshape(-1))
    return {lid: np.unique(np.concatenate(v)) if v else np.empty(0, np.int64) for lid, v in out.items()}


def default_reference_tokens(hasher: NgramHasher) -> int:
    """How much of a reference text to leave out by default: a layer's rows per hash head (its fewest),
    rounded down to a power of two. Text of that length reads about as many rows as a head has, at
    most a share 1 - 1/e of each head's rows if its n-grams were all distinct (natural text repeats
    itself: 44 % of the rows of SmolLM2's study model), and most of the rows other text reads, since
    those are the frequent n-grams' (78 % of the held-out reads there): the rows common text would
    collide with, while leaving most rows to the facts."""
    c = hasher.config
    per_head = min(ly.table_rows for ly in hasher.layout.layers) // (c.n_heads * (c.max_ngram_size - 1))
    return 1 << (max(per_head, 1).bit_length() - 1)


def hash_fact(hasher: NgramHasher, fact: FactTokens) -> np.ndarray:
    """The rows every position of `fact` reads: `hasher.hash` of its ids, (T, layers, heads)."""
    return np.asarray(hasher.hash(np.asarray(fact.ids, dtype=np.int64)))


def fact_rows(
    hasher: NgramHasher,
    fact: FactTokens,
    choice: RowChoice | str = RowChoice.BOTH,
    *,
    common: dict[int, np.ndarray] | None = None,
    max_rows: int | None = None,
    hashed: np.ndarray | None = None,
) -> dict[int, np.ndarray]:
    """{layer id: sorted unique rows} that carry `fact` (module docstring). A SUBJECT choice for a
    fact without a subject falls back to ANSWER. `hashed`: `hash_fact(hasher, fact)`, where the caller
    has it already (a caller choosing twice hashes once)."""
    choice = RowChoice(choice)
    c = hasher.config
    rows = hash_fact(hasher, fact) if hashed is None else hashed  # (T, layers, heads)
    orders = 2 + np.arange(rows.shape[2]) // c.n_heads  # each head's n-gram order
    last = len(fact.ids) - 1  # the last target token predicts nothing
    picked: list[tuple[int, int, int, int]] = []  # (rank: the answer's first, -order, -position, head)
    answer = set(fact.answer_positions)
    for t in range(last):
        for h, n in enumerate(orders):
            if (
                t - n + 1 < 0
            ):  # the n-gram reaches before the start: pads and a first token any text may share
                continue
            by_answer = t in answer and choice in (RowChoice.ANSWER, RowChoice.BOTH)
            by_subject = False
            if fact.subject is not None and choice in (RowChoice.SUBJECT, RowChoice.BOTH):
                s0, s1 = fact.subject
                by_subject = t - n + 1 < s1 and t >= s0  # the n-gram [t-n+1, t] holds a subject token
            elif fact.subject is None and choice is RowChoice.SUBJECT:
                by_answer = t in answer
            if by_answer or by_subject:  # the answer's rows first, then the longest n-grams, the latest first
                picked.append((0 if by_answer else 1, -int(n), -t, h))
    picked.sort()
    out: dict[int, np.ndarray] = {}
    for i, lid in enumerate(c.layer_ids):
        chosen: list[int] = []
        seen: set[int] = set()
        skip = common.get(lid) if common else None
        for _, _, neg_t, h in picked:
            r = int(rows[-neg_t, i, h])
            if r in seen or (skip is not None and skip.size and _contains(skip, r)):
                continue
            seen.add(r)
            chosen.append(r)
            if max_rows is not None and len(chosen) >= max_rows:
                break
        out[lid] = np.array(sorted(chosen), dtype=np.int64)
    return out


def _contains(sorted_rows: np.ndarray, r: int) -> bool:
    i = int(np.searchsorted(sorted_rows, r))
    return i < sorted_rows.size and int(sorted_rows[i]) == r


def merge_rows(*parts: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """The union of {layer id: rows} maps, sorted and unique per layer."""
    keys = sorted({k for p in parts for k in p})
    empty = np.empty(0, np.int64)
    return {k: np.unique(np.concatenate([p.get(k, empty) for p in parts])) for k in keys}


def shared_rows(per_fact: list[dict[int, np.ndarray]], targets: list[str]) -> dict[int, np.ndarray]:
    """{layer id: rows} that facts with different targets both chose: a row can hold one answer, so
    such rows ("the city of", ending every fact of a template) are left to none of them."""
    out: dict[int, np.ndarray] = {}
    for lid in sorted({k for p in per_fact for k in p}):
        rows = np.concatenate([p[lid] for p in per_fact]) if per_fact else np.empty(0, np.int64)
        owner = (
            np.concatenate([np.full(p[lid].size, i) for i, p in enumerate(per_fact)]) if per_fact else rows
        )
        ids = np.array([targets[i] for i in owner.tolist()], dtype=object)
        order = np.argsort(rows, kind="stable")
        rows, ids = rows[order], ids[order]
        same_row = rows[1:] == rows[:-1]
        differs = same_row & (ids[1:] != ids[:-1])
        out[lid] = np.unique(rows[1:][differs])
    return out
