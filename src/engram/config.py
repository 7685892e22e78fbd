"""Engram configuration: one frozen, validated dataclass and the preset registry.

Holds `Variant` (which published module), `EngramConfig` (every number the hash layout and the
module need, validated on construction; derived values are properties) and `PRESETS`
(`deepseek-v4.1`, `demo-v1`, `tiny`). It imports nothing else of engram: primes are
`engram.addressing.layout`'s, the Hugging Face `engram_*` keys `engram.checkpoint.hf_config`'s.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "EngramConfig", "MultiplierScheme", "Variant"]


class Variant(enum.StrEnum):
    """The two published Engram modules (SPEC §1)."""

    V4_1 = "deepseek-v4.1"  # fused wkv, no short conv, FP8 + ue8m0 table
    DEMO_V1 = "demo-v1"  # the paper's demo: separate key projections, short causal conv
    # Qwen4-Exp's Per-Layer Embedding (transformers' `qwen4_exp`): raw ids, splitmix64 multipliers,
    # windows restarting after EOS, one fused key projection normed per stream, dilated conv.
    QWEN4_EXP_PLE = "qwen4-exp-ple"


class MultiplierScheme(enum.StrEnum):
    """How a layer's odd hash multipliers are drawn (both bounded so that x * m fits int64)."""

    NUMPY_RNG = "numpy-rng"  # V4.1 / demo: numpy default_rng(seed + 10007 * layer_id)
    SPLITMIX64 = "splitmix64"  # Qwen4-Exp: splitmix64 of seed + 10007 * (index in layer_ids)


def _tuple_of_ints(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int | str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {value!r}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{i}] must be an int, got {v!r} ({type(v).__name__})")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class EngramConfig:
    """Everything that fixes Engram's addressing and module shapes.

    `engram_vocab_size` is the prime-search base per n-gram order (orders 2..max_ngram_size);
    V4.1 uses 16000000 for every order, the paper's demo 129280*5.
    """

    name: str = "custom"
    variant: Variant = Variant.V4_1
    # --- addressing (must match the checkpoint and the tokenizer bit for bit) ---
    layer_ids: tuple[int, ...] = (1, 14)
    max_ngram_size: int = 4
    n_heads: int = 8  # K hash heads per order
    engram_vocab_size: tuple[int, ...] = (16_000_000, 16_000_000, 16_000_000)
    vocab_size: int = 129_280  # tokenizer ids, added tokens included
    compressed_vocab_size: int = 99_092
    pad_token_id: int = 2
    seed: int = 0
    tokenizer: str | None = "deepseek-v4"  # a known name or a tokenizer.json path, or None
    # --- module shapes ---
    head_dim: int = 256  # width of one table row
    hidden_size: int = 5120  # backbone residual width (dim)
    hc_mult: int = 4  # residual streams (mHC); 1 = plain residual
    kernel_size: int = 4  # demo-v1 short conv only
    norm_eps: float = 1e-6
    gate_clamp: float = 1e-6  # |dot| floor before the signed square root
    # --- variants beyond V4.1 ---
    # Windows restart after this tokenizer id (Qwen4-Exp: EOS): the token after it looks back at
    # nothing before it (pads), as if a new sequence began. None: no automatic restarts (V4.1).
    restart_after_id: int | None = None
    multiplier_scheme: MultiplierScheme = MultiplierScheme.NUMPY_RNG
    table_rows_multiple: int = 1  # each layer's table padded up to a multiple of this many rows
    # What a loaded config.json declared for `engram_num_embeddings` (int or per layer), kept for
    # the round trip and checked against the prime sums by `from_hf_dict`.
    declared_num_embeddings: int | tuple[int, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "variant", Variant(self.variant))
        try:
            set_(self, "multiplier_scheme", MultiplierScheme(self.multiplier_scheme))
        except ValueError:
            raise ValueError(
                f"multiplier_scheme={self.multiplier_scheme!r} is not one of "
                f"{', '.join(repr(m.value) for m in MultiplierScheme)}"
            ) from None
        set_(self, "layer_ids", _tuple_of_ints("layer_ids", self.layer_ids))
        if isinstance(self.engram_vocab_size, int):
            set_(self, "engram_vocab_size", (self.engram_vocab_size,) * max(self.max_ngram_size - 1, 0))
        set_(self, "engram_vocab_size", _tuple_of_ints("engram_vocab_size", self.engram_vocab_size))
        for name in (
            "max_ngram_size",
            "n_heads",
            "vocab_size",
            "compressed_vocab_size",
            "pad_token_id",
            "seed",
            "head_dim",
            "hidden_size",
            "hc_mult",
            "kernel_size",
            "table_rows_multiple",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"EngramConfig.{name} must be an int, got {v!r}")

        if not self.layer_ids:
            raise ValueError("layer_ids is empty: give at least one layer, e.g. (1,)")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids {self.layer_ids} repeats a layer; each layer has one table")
        if min(self.layer_ids) < 0:
            raise ValueError(f"layer_ids {self.layer_ids} has a negative layer; layers count from 0")
        if self.max_ngram_size < 2:
            raise ValueError(
                f"max_ngram_size={self.max_ngram_size}: Engram needs at least 2-grams (use >= 2)"
            )
        if len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise ValueError(
                f"engram_vocab_size has {len(self.engram_vocab_size)} entries but orders 2..{self.max_ngram_size} "
                f"need {self.max_ngram_size - 1} (one prime-search base per order)"
            )
        if min(self.engram_vocab_size) < 2:
            raise ValueError(f"engram_vocab_size {self.engram_vocab_size} must be >= 2 (prime-search bases)")
        if self.n_heads < 1:
            raise ValueError(f"n_heads={self.n_heads} must be >= 1")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1")
        if not 1 <= self.compressed_vocab_size <= self.vocab_size:
            raise ValueError(
                f"compressed_vocab_size={self.compressed_vocab_size} must be in [1, vocab_size={self.vocab_size}]"
            )
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id={self.pad_token_id} is outside the tokenizer's ids [0, {self.vocab_size})"
            )
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0 (it seeds numpy.random.default_rng)")
        for name in ("head_dim", "hidden_size", "hc_mult", "kernel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.norm_eps <= 0 or self.gate_clamp <= 0:
            raise ValueError(f"norm_eps={self.norm_eps} and gate_clamp={self.gate_clamp} must be > 0")
        if self.table_rows_multiple < 1:
            raise ValueError(f"table_rows_multiple={self.table_rows_multiple} must be >= 1 (1 = no padding)")
        rid = self.restart_after_id
        if rid is not None:
            if isinstance(rid, bool) or not isinstance(rid, int):
                raise TypeError(f"EngramConfig.restart_after_id must be an int or None, got {rid!r}")
            if not 0 <= rid < self.vocab_size:
                raise ValueError(
                    f"restart_after_id={rid} is outside the tokenizer's ids [0, {self.vocab_size}); "
                    "give the id of the token after which windows restart (e.g. EOS), or None"
                )
        if self.variant is Variant.QWEN4_EXP_PLE:
            if self.compressed_vocab_size != self.vocab_size:
                raise ValueError(
                    f"variant {self.variant.value!r} hashes raw token ids: compressed_vocab_size="
                    f"{self.compressed_vocab_size} must equal vocab_size={self.vocab_size}"
                )
            if len(set(self.engram_vocab_size)) != 1:
                raise ValueError(
                    f"variant {self.variant.value!r} counts primes up from one base "
                    f"(ngram_vocab_size_base), got per-order bases {self.engram_vocab_size}"
                )

    # ------------------------------------------------------------------ derived values
    @property
    def orders(self) -> tuple[int, ...]:
        """N-gram orders, e.g. (2, 3, 4)."""
        return tuple(range(2, self.max_ngram_size + 1))

    @property
    def rows_per_token(self) -> int:
        """Rows fetched per token per layer: (max_ngram_size - 1) * n_heads (24 for V4.1)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def engram_dim(self) -> int:
        """Width of the concatenated lookup per token: rows_per_token * head_dim (6144 for V4.1)."""
        return self.rows_per_token * self.head_dim

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    def layer_index(self, layer_id: int) -> int:
        """Position of `layer_id` in `layer_ids` (the hasher's layer axis)."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} has no Engram module; this config's layers are {self.layer_ids}"
            ) from None

    def replace(self, **changes: Any) -> EngramConfig:
        """A copy with some fields changed (validated again)."""
        if "engram_vocab_size" not in changes and "max_ngram_size" in changes:
            base = self.engram_vocab_size[0]
            changes["engram_vocab_size"] = (base,) * (changes["max_ngram_size"] - 1)
        changes.setdefault("declared_num_embeddings", None)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset(name: str) -> EngramConfig:
        """One of `PRESETS`: 'deepseek-v4.1', 'demo-v1', 'tiny'."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            ) from None

    # ------------------------------------------------------------------ plain round trip
    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values (the Hugging Face `engram_*` keys are `engram.checkpoint.hf_config`'s)."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngramConfig:
        """The inverse of `to_dict`; refuses unknown keys (a dict of another format or version)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"an EngramConfig dict has unknown keys {unknown}; known keys: {sorted(known)} "
                "(a Hugging Face config.json is read with engram.checkpoint.hf_config.from_hf_dict)"
            )
        kw = dict(d)
        for key in ("layer_ids", "engram_vocab_size"):
            if isinstance(kw.get(key), list):
                kw[key] = tuple(kw[key])
        if isinstance(kw.get("declared_num_embeddings"), list):
            kw["declared_num_embeddings"] = tuple(kw["declared_num_embeddings"])
        return cls(**kw)


PRESETS: dict[str, EngramConfig] = {
    # DeepSeek-V4.1: layers 1 and 14, orders 2-4, 8 heads, 256-wide FP8 rows, base 16M per order.
    "deepseek-v4.1": EngramConfig(name="deepseek-v4.1"),
    # The Engram paper's demo (engram_demo_v1): orders 2-3, 8 heads of 64 (512 per n-gram),
    # layers [1, 15], base 129280*5 per order, short conv of kernel 4. The demo used the
    # DeepSeek-V3 tokenizer (also 129280 ids); we pair it with the DeepSeek-V4 tokenizer we ship.
    "demo-v1": EngramConfig(
        name="demo-v1",
        variant=Variant.DEMO_V1,
        layer_ids=(1, 15),
        max_ngram_size=3,
        n_heads=8,
        engram_vocab_size=(129280 * 5, 129280 * 5),
        head_dim=64,
        hidden_size=1024,
        hc_mult=4,
        kernel_size=4,
    ),
    # CPU-sized: one layer, orders 2-3, 4 heads of 32 rows of a few thousand; runs in seconds.
    "tiny": EngramConfig(
        name="tiny",
        layer_ids=(1,),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(4096, 4096),
        head_dim=32,
        hidden_size=64,
        hc_mult=2,
    ),
}
