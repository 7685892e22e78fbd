"""Row ids for one forward call of an HF model with Engram: whole sequences, or incrementally from
the KV cache during generation.

`RowSource.begin(...)` (the model's pre-hook) turns the call's inputs into rows [B, T, n_layers,
heads] and a dead mask [B, T]: padding (attention_mask == 0) is dead, so it never enters an n-gram
window (V4.1's dead-token rule), whichever side it is on. Without a cache, or at the first call
on an empty cache, the whole input is hashed. With a cache that already holds tokens, only the new
tokens are hashed, by the `HashStream` kept for that cache (`DecodeState`, held in a weak map keyed
by the cache object): one token with `step()`, several (assisted decoding's candidates, a chunked
prefill) with `draft()`; the next call commits as many drafted tokens as the cache kept, and rolls
the rest back. A cache that moved back behind committed tokens (a cropped assistant cache), or was
reordered by beam search, is rebuilt from the last `max_ngram_size - 1` tokens of its history.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from engram.addressing.hashing import NgramHasher
from engram.addressing.stream import HashStream

__all__ = ["DecodeState", "RowSource", "dead_mask_from_attention"]


def dead_mask_from_attention(attention_mask: Any, t: int, past: int = 0) -> torch.Tensor | None:
    """Dead positions [B, t] (True = padding) of the t tokens after `past` cached ones; None when
    nothing is padded or there is no mask.

    A 2-D mask [B, past + t] (or [B, t]) marks padding with 0. A 4-D mask [B or 1, heads or 1, t,
    keys] (packed sequences, custom attention) is read as the attention implementations read it:
    bool True, or an additive float 0 (anything above the dtype's lowest half), means "attends"; a
    token no query attends to (its key column masked everywhere) is padding."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        found = (
            f"a {attention_mask.dim()}-D tensor of shape {tuple(attention_mask.shape)}"
            if isinstance(attention_mask, torch.Tensor)
            else type(attention_mask).__name__
        )
        raise ValueError(
            f"attention_mask must be a 2-D [batch, tokens] tensor (0 at padding) or a 4-D [batch, heads, "
            f"queries, keys] one, got {found}; pass the 2-D padding mask"
        )
    if attention_mask.dim() == 2:
        if attention_mask.shape[1] < t:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns but the input has {t} tokens; "
                "it must cover the cached tokens and the new ones"
            )
        dead = attention_mask[:, -t:] == 0
        return dead if bool(dead.any()) else None
    _, _, queries, keys = attention_mask.shape
    if queries != t or keys < past + t:
        raise ValueError(
            f"a 4-D attention_mask of shape {tuple(attention_mask.shape)} does not fit a call of {t} new "
            f"tokens after {past} cached ones (want [batch, heads, {t}, >= {past + t}]); pass the 2-D "
            "padding mask [batch, past + tokens] instead"
        )
    mask = attention_mask[..., past : past + t]  # (B, H, t, t): the new tokens' key columns
    if mask.dtype == torch.bool:
        attends = mask
    elif mask.is_floating_point():
        attends = mask > torch.finfo(mask.dtype).min / 2  # additive: 0 attends, the lowest value masks
    else:
        attends = mask != 0
    dead = ~attends.any(dim=2).any(dim=1)  # (B, t): no query of any head attends that token
    return dead if bool(dead.any()) else None


class DecodeState:
    """The hash state that goes with one KV cache: a HashStream and the tokens the cache holds."""

    def __init__(
        self, hasher: NgramHasher, ids: np.ndarray, dead: np.ndarray | None, starts: np.ndarray | None = None
    ) -> None:
        self.hasher = hasher
        b, t = ids.shape
        self.batch_size = b
        cap = max(64, 2 * t)
        self.ids = np.zeros((b, cap), dtype=np.int64)  # (B, cap) tokenizer ids, history
        self.dead = np.zeros((b, cap), dtype=bool)
        self.starts = np.zeros((b, cap), dtype=bool)  # window restarts (boundaries='position_ids')
        self.length = 0  # tokens in the history (drafts included)
        self.committed = 0  # tokens committed in the stream
        self.drafted = False  # whether the stream may hold drafts (set by a multi-token call)
        self.stream: HashStream | None = None  # built lazily from the history (`_rebuild`)
        self.record(ids, dead, starts, 0)

    def record(self, ids: np.ndarray, dead: np.ndarray | None, starts: np.ndarray | None, at: int) -> None:
        """Store tokens [B, T] at positions at..at+T of the history."""
        t = ids.shape[1]
        need = at + t
        if need > self.ids.shape[1]:
            grow = max(need, 2 * self.ids.shape[1]) - self.ids.shape[1]
            self.ids = np.pad(self.ids, ((0, 0), (0, grow)))
            self.dead = np.pad(self.dead, ((0, 0), (0, grow)))
            self.starts = np.pad(self.starts, ((0, 0), (0, grow)))
        self.ids[:, at:need] = ids
        self.dead[:, at:need] = False if dead is None else dead
        self.starts[:, at:need] = False if starts is None else starts
        self.length = need

    def _rebuild(self, position: int) -> None:
        """A fresh stream whose committed window is the one after `position` tokens of the history."""
        stream = HashStream(self.hasher, self.batch_size)
        lo = max(0, position - self.hasher.window_size)
        if position > lo:
            dead, starts = self.dead[:, lo:position], self.starts[:, lo:position]
            stream.feed(
                self.ids[:, lo:position],
                dead if dead.any() else None,
                starts=starts if starts.any() else None,
            )
        self.stream, self.committed = stream, position

    def sync(self, position: int) -> HashStream:
        """Bring the stream to `position` committed tokens (the cache's length) and return it."""
        if position > self.length:
            raise ValueError(
                f"the cache holds {position} tokens but Engram saw only {self.length}: a cache given to an "
                "Engram model must have been filled by that model's own forward calls"
            )
        stream = self.stream
        if stream is not None and position == self.committed and not self.drafted:
            return stream  # a plain decode step: the stream is where the cache is
        if stream is not None:
            self.drafted = False
            pending = stream.n_draft
            if pending.any():
                k = position - self.committed
                if 0 <= k <= int(pending.min()):
                    stream.commit(k)
                    self.committed = position
                else:
                    stream.rollback()
        if stream is None or self.committed != position:
            self._rebuild(position)
        assert self.stream is not None
        return self.stream

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search picked sequences `index` [B] of the batch: reorder the history with them."""
        idx = index.detach().cpu().numpy()
        self.ids, self.dead, self.starts = self.ids[idx], self.dead[idx], self.starts[idx]
        self.stream = None  # rebuilt from the reordered history at the next call


class RowSource:
    """Turns a forward call's inputs into Engram rows; holds the current call's rows for the layer hooks."""

    def __init__(
        self, hasher: NgramHasher, *, boundaries: str | None = None, eos_token_id: int | None = None
    ) -> None:
        self.hasher = hasher
        self.boundaries, self.eos_token_id = boundaries, eos_token_id
        self.states: weakref.WeakKeyDictionary[Any, DecodeState] = weakref.WeakKeyDictionary()
        self.current: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.given: torch.Tensor | None = None  # a collator's rows, from the outer model's hook
        # (ids, dead, starts) of a call without a cache, for the cache the model may return
        self._fresh: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> RowSource:
        """A copy (of a copied model) starts without decode states: they belong to the original's caches."""
        hasher = memo.get(id(self.hasher), self.hasher)
        return RowSource(hasher, boundaries=self.boundaries, eos_token_id=self.eos_token_id)

    # ------------------------------------------------------------------ one call
    def begin(
        self,
        *,
        input_ids: Any,
        attention_mask: Any,
        position_ids: Any,
        cache: Any,
        inputs_embeds: Any,
        rows: Any,
    ) -> None:
        """This call's rows and dead mask into `current`, where they are made (the CPU for hashed rows;
        the layer hooks move them to the hidden states' device)."""
        self.current = self._fresh = None
        if input_ids is None:
            if rows is None:
                raise ValueError(
                    "a model with Engram needs input_ids (its rows are hashed from them): inputs_embeds alone "
                    "cannot be hashed. Pass input_ids, or engram_rows from engram.hf.EngramCollator"
                    + (" together with inputs_embeds" if inputs_embeds is not None else "")
                )
            t = rows.shape[1]
        elif not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a [batch, tokens] tensor, got "
                f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
            )
        else:
            t = input_ids.shape[1]
        past = _cache_length(cache)
        dead = dead_mask_from_attention(attention_mask, t, past)
        if rows is not None:
            rows = self._check_rows(rows, input_ids, t, past)
        elif past:
            rows = self._step(cache, input_ids, dead, position_ids, past)
        if past == 0 and input_ids is not None:
            ids_cpu = input_ids.detach().cpu()
            dead_cpu = None if dead is None else dead.cpu()
            given = rows is not None  # a collator's rows: position_ids only matter for a continued cache
            starts = self.starts(ids_cpu, position_ids, generating=cache is not None or given)
            if rows is None:
                rows = self.hasher.hash(ids_cpu, dead_cpu, starts=starts)
            if cache is not None:  # the first call of a generation: the cache's state starts here
                self.states[cache] = DecodeState(self.hasher, ids_cpu.numpy(), _np(dead_cpu), _np(starts))
            else:  # the model may make a cache itself: `end` gives it this state
                self._fresh = (ids_cpu, dead_cpu, starts)
        self.current = (rows, dead)

    def end(self, output: Any) -> None:
        """After the call: a cache the model made itself (cache=None, use_cache) gets its state."""
        self.current = None
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            return
        cache = getattr(output, "cache", None)  # transformers 5 outputs name the KV cache `cache`
        if cache is not None and _weakrefable(cache) and cache not in self.states:
            ids, dead, starts = fresh
            self.states[cache] = DecodeState(self.hasher, ids.numpy(), _np(dead), _np(starts))

    # ------------------------------------------------------------------ pieces
    def starts(
        self, ids: torch.Tensor, position_ids: Any, *, generating: bool = False
    ) -> torch.Tensor | None:
        """Window restarts [B, T] (True where a token's look-back begins afresh): where position_ids == 0
        with boundaries='position_ids', else None (restarts after EOS are the hasher's own, through
        `config.restart_after_id`). `generating` (a call with a KV cache): without position_ids the
        positions simply continue, so nothing restarts."""
        if self.boundaries != "position_ids" or (generating and position_ids is None):
            return None
        if not isinstance(position_ids, torch.Tensor):
            raise ValueError(
                "boundaries='position_ids' needs position_ids [B, T] in every call (0 where a packed document begins)"
            )
        pos = position_ids.detach().cpu()
        if pos.dim() == 1:
            pos = pos[None]
        if pos.shape[-1] != ids.shape[1] or pos.shape[0] not in (1, ids.shape[0]):
            raise ValueError(f"position_ids has shape {tuple(pos.shape)}, input_ids {tuple(ids.shape)}")
        return (pos == 0).expand(ids.shape).contiguous()

    def _step(
        self, cache: Any, input_ids: torch.Tensor, dead: torch.Tensor | None, position_ids: Any, past: int
    ) -> torch.Tensor:
        state = self.states.get(cache) if _weakrefable(cache) else None
        if state is None:
            raise ValueError(
                f"the cache holds {past} tokens that Engram did not hash: continue a cache only with the model "
                "that filled it (from its first call on), or call without a cache"
            )
        b, t = input_ids.shape
        if b != state.batch_size:
            raise ValueError(
                f"the cache's Engram state has {state.batch_size} sequences but this call has {b}; generation "
                "modes that reshape the batch of a running cache are not supported"
            )
        ids = input_ids.detach().cpu().numpy()  # token ids: a view on the CPU
        dead_np = None if dead is None else dead.cpu().numpy()
        starts = self.starts(input_ids, position_ids, generating=True)
        st = None if starts is None or not bool(starts.any()) else starts.numpy()
        stream = state.sync(past)
        if t == 1:
            rows = stream.step(
                ids[:, 0], None if dead_np is None else dead_np[:, 0], starts=None if st is None else st[:, 0]
            )[:, None]
            state.committed += 1
        else:
            rows = stream.draft(ids, dead_np, starts=st)
            state.drafted = True
        state.record(ids, dead_np, st, past)
        return torch.from_numpy(rows)

    def _check_rows(self, rows: Any, input_ids: Any, t: int, past: int) -> torch.Tensor:
        cfg = self.hasher.config
        if past:
            raise ValueError(
                "engram_rows (precomputed rows) cannot be used with a filled KV cache; pass input_ids"
            )
        want = (cfg.n_layers, cfg.rows_per_token)
        if (
            not isinstance(rows, torch.Tensor)
            or rows.dim() != 4
            or tuple(rows.shape[2:]) != want
            or rows.shape[1] != t
        ):
            found = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"engram_rows must be a [B, {t}, {want[0]}, {want[1]}] tensor, got {found}")
        if isinstance(input_ids, torch.Tensor) and rows.shape[0] != input_ids.shape[0]:
            raise ValueError(f"engram_rows has batch {rows.shape[0]} but input_ids has {input_ids.shape[0]}")
        return rows

    def reorder(self, cache: Any, index: torch.Tensor) -> None:
        state = self.states.get(cache) if _weakrefable(cache) else None
        if state is not None:
            state.reorder(index)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy()


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _cache_length(cache: Any) -> int:
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    if get is None:
        raise TypeError(f"cannot read the length of a cache of type {type(cache).__name__}")
    return int(get())
