"""N-gram hashing (SPEC §4): tokenizer ids -> physical table rows, bit-exact to DeepSeek-V4.1.

Holds:
- `NgramHasher(config, compression)`: validates that the map fits the config, owns the layout's
  multipliers, primes and offsets as arrays, and hashes whole sequences with `hash()`.
- `NgramHasher.hash_compressed(...)`: the vectorised core on compressed ids with an optional
  carried look-back window; `engram.stream.HashStream` builds decode-time state on it.
- `check_token_ids`: the boundary check shared by every entry point.

For position t and look-back i, the token is x_{t-i}, or the pad id P when t-i < 0 or when a dead
(image) position lies in x_{t-i..t} (blocking is sticky: the first dead position, or the
sequence start, pads that look-back and every farther one).
    mix_2 = (x_t * m_0) ^ (x_{t-1} * m_1);   mix_{n+1} = mix_n ^ (x_{t-n} * m_n)
    row[n, k] = mix_n % p[n, k] + offset[n, k]
The multipliers keep every product below 2^63, so int64 arithmetic is exact and non-negative.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from engram.compression import TokenizerCompression
from engram.config import EngramConfig
from engram.layout import Layout

__all__ = ["NgramHasher", "check_token_ids"]


def _first_position(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def check_token_ids(token_ids: Any, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """`token_ids` as an int64 numpy array of shape [T] or [B, T], every id in [0, vocab_size).

    Raises TypeError for a non-integer dtype and ValueError for a bad shape, an empty input or an
    id out of range (naming the first such id and its position).
    """
    if hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):  # torch.Tensor, without importing torch
        if token_ids.is_floating_point() or token_ids.is_complex() or str(token_ids.dtype) == "torch.bool":
            raise TypeError(
                f"{name} must hold integer token ids, got a tensor of {token_ids.dtype}; cast with .long()"
            )
        token_ids = token_ids.detach().cpu().numpy()  # sync point on CUDA inputs
    arr = np.asarray(token_ids)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{name} must hold integer token ids, got dtype {arr.dtype}; convert with .astype(np.int64)"
        )
    if arr.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape [T] or [B, T], got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape}): there is nothing to hash")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = _first_position(bad)
        raise ValueError(
            f"{name} holds id {int(arr[pos])} at position {pos}, outside the tokenizer's ids [0, {vocab_size}); "
            "was the text tokenized with the tokenizer this config was made for?"
        )
    return arr.astype(np.int64, copy=False)


def _check_dead_mask(dead_mask: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    if dead_mask is None:
        return None
    if hasattr(dead_mask, "detach") and hasattr(dead_mask, "cpu"):
        dead_mask = dead_mask.detach().cpu().numpy()
    mask = np.asarray(dead_mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"dead_mask must be boolean (True = dead position), got dtype {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"dead_mask has shape {mask.shape} but token_ids has shape {shape}; they must match")
    return mask


class NgramHasher:
    """Hashes token ids into the physical rows of every Engram layer of a config.

    `hash(ids)` returns int64 rows of shape [B, T, n_layers, heads_per_layer] (or [T, ...] for
    1-D input), columns in (order, head) order, each head's table offset included.
    """

    def __init__(self, config: EngramConfig, compression: TokenizerCompression) -> None:
        if compression.vocab_size != config.vocab_size:
            raise ValueError(
                f"the compression map covers {compression.vocab_size} tokenizer ids but config {config.name!r} has "
                f"vocab_size={config.vocab_size}: the map and the config are for different tokenizers"
            )
        if compression.size != config.compressed_vocab_size:
            raise ValueError(
                f"the compression map has {compression.size} compressed ids but config {config.name!r} expects "
                f"compressed_vocab_size={config.compressed_vocab_size}; the multipliers depend on it, so every row "
                "would differ. Use the tokenizer the config was made for, or set compressed_vocab_size="
                f"{compression.size} for a new model"
            )
        self.config = config
        self.compression = compression
        self.layout = Layout(config)
        self.pad = int(compression.lookup[config.pad_token_id])  # compressed pad id P
        # (n_layers, max_ngram) multipliers; (n_layers, orders, K) primes and offsets
        self.multipliers = np.array([layer.multipliers for layer in self.layout.layers], dtype=np.int64)
        orders, k = config.max_ngram_size - 1, config.n_heads
        self.primes = np.stack([layer.flat_primes for layer in self.layout.layers]).reshape(-1, orders, k)
        self.offsets = np.stack([layer.offsets for layer in self.layout.layers]).reshape(-1, orders, k)

    @property
    def window_size(self) -> int:
        """Look-back tokens carried between chunks: max_ngram_size - 1."""
        return self.config.max_ngram_size - 1

    def output_shape(self, batch: tuple[int, ...]) -> tuple[int, ...]:
        return (*batch, self.config.n_layers, self.config.heads_per_layer)

    # ------------------------------------------------------------------ public entry
    def hash(self, token_ids: Any, dead_mask: Any = None) -> Any:
        """Physical rows for raw tokenizer ids ([T] or [B, T]; numpy, torch or a list).

        `dead_mask` (bool, same shape) marks dead (image) positions. A torch tensor input gives a
        torch int64 tensor on the same device; anything else gives a numpy array.
        """
        ids = check_token_ids(token_ids, self.config.vocab_size)
        dead = _check_dead_mask(dead_mask, ids.shape)
        one_d = ids.ndim == 1
        xc = self.compression.lookup[ids.reshape(1, -1) if one_d else ids]
        rows = self.hash_compressed(xc, None if dead is None else dead.reshape(xc.shape))
        if one_d:
            rows = rows[0]
        return _like_input(rows, token_ids)

    # ------------------------------------------------------------------ core
    def lookback(
        self, xc: np.ndarray, dead: np.ndarray | None, window: np.ndarray | None
    ) -> list[np.ndarray]:
        """The max_ngram look-back columns [B, T] each, pads and blocking applied.

        xc: (B, T) compressed ids; dead: (B, T) bool or None; window: (B, max_ngram-1) carried
        look-back of the position before xc[:, 0] (window[:, 0] is the most recent token), or
        None at a sequence start (all pads).
        """
        n, pad = self.config.max_ngram_size, self.pad
        b, t = xc.shape
        vals = xc if dead is None else np.where(dead, pad, xc)
        if window is None:
            window = np.full((b, n - 1), pad, dtype=np.int64)
        ext = np.concatenate([window[:, ::-1], vals], axis=1)  # (B, n-1+T): ext[:, n-1+t] is position t
        cols = [vals]
        if dead is None:
            for i in range(1, n):
                cols.append(ext[:, n - 1 - i : n - 1 - i + t])
            return cols
        ext_dead = np.concatenate([np.zeros((b, n - 1), dtype=bool), dead], axis=1)
        blocked = dead.copy()
        for i in range(1, n):
            blocked |= ext_dead[:, n - 1 - i : n - 1 - i + t]  # sticky: once blocked, farther is too
            cols.append(np.where(blocked, pad, ext[:, n - 1 - i : n - 1 - i + t]))
        return cols

    def hash_compressed(
        self, xc: np.ndarray, dead: np.ndarray | None = None, window: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows (B, T, n_layers, heads_per_layer) int64 for compressed ids xc (B, T); see `lookback`."""
        b, t = xc.shape
        cols = self.lookback(xc, dead, window)
        k = self.config.n_heads
        out = np.empty((b, t, self.config.n_layers, self.config.heads_per_layer), dtype=np.int64)
        for li in range(self.config.n_layers):
            for order, mix in enumerate(self.mixes(cols, li)):  # order index 0 is 2-grams
                dst = out[:, :, li, order * k : (order + 1) * k]
                np.remainder(mix[:, :, None], self.primes[li, order], out=dst)
                dst += self.offsets[li, order]
        return out

    def mixes(self, cols: list[np.ndarray], layer_index: int) -> Iterator[np.ndarray]:
        """mix_2, mix_3, ... (each like cols[0], int64) of one layer from `lookback` columns.

        Yields the same buffer, updated in place: copy a value to keep it past the next step.
        """
        m = self.multipliers[layer_index]
        mix = np.multiply(cols[0], m[0])
        prod = np.empty_like(mix)
        for i in range(1, self.config.max_ngram_size):
            np.multiply(cols[i], m[i], out=prod)
            np.bitwise_xor(mix, prod, out=mix)
            yield mix

    def next_window(
        self,
        xc: np.ndarray,
        dead: np.ndarray | None,
        window: np.ndarray | None,
        lengths: np.ndarray | None = None,
    ) -> np.ndarray:
        """The look-back window (B, max_ngram-1) of the position after the first `lengths[b]` tokens of
        each row of xc (all T tokens by default), given the window before xc."""
        n, pad = self.config.max_ngram_size, self.pad
        b, t = xc.shape
        vals = xc if dead is None else np.where(dead, pad, xc)
        if window is None:
            window = np.full((b, n - 1), pad, dtype=np.int64)
        ext = np.concatenate([window[:, ::-1], vals], axis=1)
        ext_dead = np.zeros_like(ext, dtype=bool)
        if dead is not None:
            ext_dead[:, n - 1 :] = dead
        end = np.full(b, t, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
        rows = np.arange(b)
        new = np.empty((b, n - 1), dtype=np.int64)
        blocked = np.zeros(b, dtype=bool)
        for j in range(n - 1):
            src = n - 2 + end - j  # ext index of the token j+1 back from the new position
            blocked |= ext_dead[rows, src]
            new[:, j] = np.where(blocked, pad, ext[rows, src])
        return new


def _like_input(rows: np.ndarray, like: Any) -> Any:
    """Return rows as a torch tensor on `like`'s device when `like` is a tensor."""
    if hasattr(like, "detach") and hasattr(like, "device"):
        import torch

        return torch.from_numpy(rows).to(like.device)
    return rows
