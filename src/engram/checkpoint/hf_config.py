"""Hugging Face config keys to and from `EngramConfig`: DeepSeek-V4.1's `engram_*` keys and
Qwen4-Exp's `ple_*` / `ngram_*` keys.

Reading is `EngramConfig.from_hf_config`'s (engram.config); this module adds what needs the hash
layout: writing the keys as DeepSeek-V4.1-Flash's config.json has them (`engram_num_embeddings`:
one prime sum per Engram layer) and refusing a config whose
declared `engram_num_embeddings` contradicts its own primes. Knows nothing of tensors or files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engram.addressing.layout import Layout
from engram.config import EngramConfig, MultiplierScheme, Variant

__all__ = ["from_hf_dict", "to_hf_dict"]


def to_hf_dict(config: EngramConfig) -> dict[str, Any]:
    """The keys of a config.json: Qwen4-Exp's PLE keys for that variant, else `engram_*` keys
    (plus the backbone sizes they need)."""
    if config.variant is Variant.QWEN4_EXP_PLE:
        return _to_qwen4_exp_dict(config)
    declared = config.declared_num_embeddings
    bases = config.engram_vocab_size
    d = {
        "engram_variant": config.variant.value,
        "engram_layer_ids": list(config.layer_ids),
        # DeepSeek-V4.1-Flash's config.json: one row count per Engram layer (vLLM's layout iterates
        # over it). The scalar form (the largest layer's count, every table that long) is kept only
        # for a config read with it: its tables have that many rows.
        "engram_num_embeddings": declared
        if isinstance(declared, int)
        else list(Layout(config).num_embeddings),
        "engram_max_ngram_size": config.max_ngram_size,
        "engram_vocab_size": bases[0] if len(set(bases)) == 1 else list(bases),
        "engram_n_heads": config.n_heads,
        "engram_head_dim": config.head_dim,
        "engram_pad_token_id": config.pad_token_id,  # the published key (engram_pad_id is read too)
        "engram_compressed_vocab_size": config.compressed_vocab_size,
        "engram_seed": config.seed,
        "engram_kernel_size": config.kernel_size,
        "engram_norm_eps": config.norm_eps,
        "engram_gate_clamp": config.gate_clamp,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "hc_mult": config.hc_mult,
    }
    # keys beyond V4.1's, written only when set, so that a V4.1 config.json stays as it was
    if config.restart_after_id is not None:
        d["engram_restart_after_id"] = config.restart_after_id
    if config.multiplier_scheme is not MultiplierScheme.NUMPY_RNG:
        d["engram_multiplier_scheme"] = config.multiplier_scheme.value
    if config.table_rows_multiple != 1:
        d["engram_table_rows_multiple"] = config.table_rows_multiple
    return d


def _to_qwen4_exp_dict(config: EngramConfig) -> dict[str, Any]:
    """A Qwen4ExpTextConfig's PLE keys; refuses a config that Qwen4-Exp cannot express."""
    c = config
    bad = []
    if c.restart_after_id != c.pad_token_id:
        bad.append(
            f"restart_after_id={c.restart_after_id} (Qwen4-Exp restarts after its pad, EOS={c.pad_token_id})"
        )
    if c.multiplier_scheme is not MultiplierScheme.SPLITMIX64:
        bad.append(f"multiplier_scheme={c.multiplier_scheme.value!r} (Qwen4-Exp draws 'splitmix64')")
    if bad:
        raise ValueError(f"config {c.name!r} cannot be written as Qwen4-Exp keys: {'; '.join(bad)}")
    return {
        "ple_layer_ids": [i + 1 for i in c.layer_ids],
        "ple_embed_dim": c.engram_dim,
        "ple_conv_kernel_size": c.kernel_size,
        "ngram_size": c.max_ngram_size,
        "heads_per_ngram": c.n_heads,
        "ngram_vocab_size_base": c.engram_vocab_size[0],
        "make_ngram_vocab_size_divisible_by": c.table_rows_multiple,
        "seed": c.seed,
        "eos_token_id": c.pad_token_id,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "hc_count": c.hc_mult,
        "rms_norm_eps": c.norm_eps,
    }


def from_hf_dict(d: Mapping[str, Any], *, name: str = "hf", tokenizer: str | None = None) -> EngramConfig:
    """Read a config.json's keys (either family, see `EngramConfig.from_hf_config`); refuse one whose
    `engram_num_embeddings` contradicts its own primes."""
    if not isinstance(d, Mapping):
        raise TypeError(f"a config.json must hold a JSON object, got {type(d).__name__}")
    config = EngramConfig.from_hf_config(d, name=name, tokenizer=tokenizer)
    declared = config.declared_num_embeddings
    if declared is None:
        return config
    computed = Layout(config).num_embeddings
    if isinstance(declared, int):
        if declared != max(computed):
            raise ValueError(
                f"engram_num_embeddings={declared} but the prime sums of layers {config.layer_ids} are "
                f"{list(computed)} (largest {max(computed)}): the config's hash layout does not match its "
                "table; check engram_vocab_size, engram_n_heads, engram_max_ngram_size and engram_layer_ids"
            )
        return config
    if tuple(declared) != computed:
        raise ValueError(
            f"engram_num_embeddings={list(declared)} but the prime sums of layers "
            f"{config.layer_ids} are {list(computed)}: the config's hash layout does not match its table"
        )
    return dataclasses.replace(config, declared_num_embeddings=tuple(declared))
