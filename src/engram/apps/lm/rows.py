"""Engram rows of a token stream, and the studies' controls that ignore the n-gram.

`stream_rows(config, compression, stream, how, split)` gives every token's rows (N, layers, heads)
int64: the Engram hash (`RowHash.NGRAM`), or a seeded random row per stream position, a row chosen
by the token's position in its document alone, or one fixed row per head (capacity 1). Each
control keeps every head inside its own table segment, so the model and the tables are unchanged;
only what the rows mean differs. `identity_compression` is the map that leaves ids as they are
(tokenizer compression off). Knows nothing of models or training.
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer

from engram.addressing.compression import TokenizerCompression, tokenizer_fingerprint
from engram.addressing.hashing import NgramHasher
from engram.apps.lm.data import TokenStream
from engram.apps.lm.train_config import RowHash
from engram.config import EngramConfig

__all__ = ["identity_compression", "stream_rows"]

# Salts of the random rows of each split: held-out positions get rows the training never saw.
_SPLIT_SALT = {"train": 0, "held_out": 1}


def identity_compression(tokenizer: Tokenizer) -> TokenizerCompression:
    """The compression map that changes nothing: compressed id = tokenizer id."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    return TokenizerCompression.identity(n, fingerprint=tokenizer_fingerprint(tokenizer))


def stream_rows(
    config: EngramConfig,
    compression: TokenizerCompression,
    stream: TokenStream,
    how: RowHash | str = RowHash.NGRAM,
    split: str = "train",
) -> torch.Tensor:
    """Rows (N, layers, heads) int64 of every token of `stream` (`split`: "train" or "held_out",
    which seeds the random rows)."""
    how = RowHash(how)
    if split not in _SPLIT_SALT:
        raise ValueError(f"split={split!r}: use 'train' or 'held_out'")
    hasher = NgramHasher(config, compression)
    if how is RowHash.NGRAM:
        return torch.from_numpy(hasher.hash(stream.ids))
    n = len(stream)
    primes = hasher.primes.reshape(hasher.primes.shape[0], -1)  # (layers, heads): each head's rows
    offsets = hasher.offsets.reshape(primes.shape)  # (layers, heads): where each head's rows start
    if how is RowHash.RANDOM:
        rng = np.random.default_rng([config.seed, _SPLIT_SALT[split], 0xA11])
        draw = rng.integers(0, np.iinfo(np.int64).max, size=(n, *primes.shape))
        rows = offsets + draw % primes
    elif how is RowHash.POSITION:
        doc = np.searchsorted(stream.doc_offsets, np.arange(n), side="right") - 1
        pos = np.arange(n) - stream.doc_offsets[doc]  # (N,) position in its document
        rows = offsets + pos[:, None, None] % primes
    else:  # CONSTANT: the first row of each head's segment, for every token
        rows = np.broadcast_to(offsets, (n, *primes.shape)).copy()
    return torch.from_numpy(rows.astype(np.int64))
