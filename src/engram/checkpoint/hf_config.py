"""The `engram_*` keys of a Hugging Face config.json (DeepSeek-V4.1's), to and from `EngramConfig`.

Knows the key names and checks a declared `engram_num_embeddings` against the prime sums that
`engram.addressing.layout` computes; knows nothing of tensors or files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engram.addressing.layout import Layout
from engram.config import EngramConfig, Variant

__all__ = ["from_hf_dict", "to_hf_dict"]

_REQUIRED = (
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
)
# EngramConfig field -> config.json key, for the optional keys
_OPTIONAL = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("hc_mult", "hc_mult"),
    ("kernel_size", "engram_kernel_size"),
    ("norm_eps", "engram_norm_eps"),
    ("gate_clamp", "engram_gate_clamp"),
)


def to_hf_dict(config: EngramConfig) -> dict[str, Any]:
    """The `engram_*` keys of a config.json (plus the backbone sizes they need)."""
    declared = config.declared_num_embeddings
    if declared is None:
        # V4.1's config.json holds one number: the largest layer's row count.
        declared = max(Layout(config).num_embeddings)
    bases = config.engram_vocab_size
    return {
        "engram_variant": config.variant.value,
        "engram_layer_ids": list(config.layer_ids),
        "engram_num_embeddings": list(declared) if isinstance(declared, tuple) else declared,
        "engram_max_ngram_size": config.max_ngram_size,
        "engram_vocab_size": bases[0] if len(set(bases)) == 1 else list(bases),
        "engram_n_heads": config.n_heads,
        "engram_head_dim": config.head_dim,
        "engram_pad_token_id": config.pad_token_id,
        "engram_compressed_vocab_size": config.compressed_vocab_size,
        "engram_seed": config.seed,
        "engram_kernel_size": config.kernel_size,
        "engram_norm_eps": config.norm_eps,
        "engram_gate_clamp": config.gate_clamp,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "hc_mult": config.hc_mult,
    }


def from_hf_dict(d: Mapping[str, Any], *, name: str = "hf", tokenizer: str | None = None) -> EngramConfig:
    """Read the `engram_*` keys of a config.json; refuse one that contradicts its own primes."""
    if not isinstance(d, Mapping):
        raise TypeError(f"a config.json must hold a JSON object, got {type(d).__name__}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"config dict lacks {', '.join(missing)}: not an Engram config (keys: {sorted(d)})")
    bases = d["engram_vocab_size"]
    layer_ids = d["engram_layer_ids"]
    if not isinstance(layer_ids, list | tuple):
        raise TypeError(f"engram_layer_ids must be a list of ints, got {layer_ids!r}")
    kw: dict[str, Any] = {
        "name": name,
        "variant": Variant(d.get("engram_variant", Variant.V4_1.value)),
        "layer_ids": tuple(layer_ids),
        "max_ngram_size": d["engram_max_ngram_size"],
        "n_heads": d["engram_n_heads"],
        "engram_vocab_size": tuple(bases) if isinstance(bases, list) else bases,
        "head_dim": d["engram_head_dim"],
        "pad_token_id": d["engram_pad_token_id"],
        "compressed_vocab_size": d["engram_compressed_vocab_size"],
        "seed": d.get("engram_seed", 0),
        "tokenizer": tokenizer,
    }
    for key, hf_key in _OPTIONAL:
        if hf_key in d:
            kw[key] = d[hf_key]
    config = EngramConfig(**kw)

    declared = d.get("engram_num_embeddings")
    if declared is None:
        return config
    computed = Layout(config).num_embeddings
    if isinstance(declared, int) and not isinstance(declared, bool):
        if declared != max(computed):
            raise ValueError(
                f"engram_num_embeddings={declared} but the prime sums of layers {config.layer_ids} are "
                f"{list(computed)} (largest {max(computed)}): the config's hash layout does not match its "
                "table; check engram_vocab_size, engram_n_heads, engram_max_ngram_size and engram_layer_ids"
            )
        return dataclasses.replace(config, declared_num_embeddings=declared)
    if not isinstance(declared, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in declared
    ):
        raise TypeError(f"engram_num_embeddings must be an int or a list of ints, got {declared!r}")
    if tuple(declared) != computed:
        raise ValueError(
            f"engram_num_embeddings={list(declared)} but the prime sums of layers "
            f"{config.layer_ids} are {list(computed)}: the config's hash layout does not match its table"
        )
    return dataclasses.replace(config, declared_num_embeddings=tuple(declared))
