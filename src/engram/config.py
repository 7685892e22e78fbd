"""Engram configuration: one frozen, validated dataclass and the preset registry.

Holds `Variant` (which published module), `EngramConfig` (every number the hash layout and the
module need, validated on construction; derived values are properties) and `PRESETS`
(`deepseek-v4.1`, `demo-v1`, `tiny`, `qwen4-exp-tiny`). `EngramConfig.from_hf_config` reads the
keys of a Hugging Face config (DeepSeek-V4.1's `engram_*`, Qwen4-Exp's `ple_*` / `ngram_*`). It
imports nothing else of engram: primes are `engram.addressing.layout`'s, and the check of a declared
`engram_num_embeddings` against them (and the writing of `engram_*` keys) is
`engram.checkpoint.hf_config`'s.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_ENGRAM_DIM",
    "MAX_HC_MULT",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_HIDDEN_SIZE",
    "MAX_KERNEL_SIZE",
    "MAX_LAYER_ID",
    "MAX_LAYER_ROWS",
    "MAX_NGRAM_SIZE",
    "MAX_PRIMES",
    "MAX_TABLE_ROWS_MULTIPLE",
    "MAX_VOCAB_SIZE",
    "PRESETS",
    "EngramConfig",
    "MultiplierScheme",
    "Variant",
    "check_eps",
]

# ------------------------------------------------------------------------------------------- bounds
# Every size a config holds is checked against one of these before any work: generous for real models
# (V4.1: orders 2-4, 8 heads, rows 256 wide, ~384M rows a layer, 48 primes) but a mistyped size (10^9
# heads, 10^6-grams) is refused at once instead of running for minutes or exhausting memory.
MAX_NGRAM_SIZE = 16  # orders 2..16 (V4.1: 4; the paper's demo and Qwen4-Exp: 3)
MAX_HEADS = 64  # hash heads per order (V4.1: 8)
MAX_LAYER_ID = 1023  # layer ids 0..1023 (V4.1: 1 and 14; the deepest models have a few hundred)
MAX_HEAD_DIM = 4096  # width of a table row (V4.1: 256)
MAX_ENGRAM_DIM = 65536  # rows_per_token * head_dim, one token's lookup (V4.1: 24 * 256 = 6144)
MAX_HIDDEN_SIZE = 65536  # backbone width (V4.1: 5120; the widest open models ~16K)
MAX_HC_MULT = 64  # residual streams (V4.1: 4)
MAX_KERNEL_SIZE = 64  # the short conv's kernel (the demo and Qwen4-Exp: 4)
MAX_VOCAB_SIZE = 1 << 24  # tokenizer ids, 16,777,216 (DeepSeek-V4: 129,280; the largest ~262K)
MAX_TABLE_ROWS_MULTIPLE = 1 << 20  # padding multiple of a table's rows (Qwen4-Exp: 128)
# rows of one layer's table, estimated before any prime is searched as n_heads * sum(engram_vocab_size)
# (2^36 = 68.7 billion, 179x V4.1's 384M: 18 TB a layer as FP8 rows); also bounds each prime-search base
MAX_LAYER_ROWS = 1 << 36
# primes a layout searches, n_layers * (max_ngram_size - 1) * n_heads (V4.1: 48), each ~25-100 us of
# sympy.nextprime: 16384 take about a second
MAX_PRIMES = 16384


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_eps(name: str, value: Any, hi: float = 1.0) -> float:
    """Check that a config value is a finite number in (0, hi] and return it as a float.

    NaN is refused too (it passes `<= 0`).

    Args:
        name: The field's name, quoted in the error.
        value: The value to check.
        hi: The upper bound of the range, included.

    Returns:
        `value` as a float.

    Raises:
        TypeError: `value` is not a number (bools are refused).
        ValueError: `value` is not finite or lies outside (0, hi]; the message names the field,
            the value and the range.
    """
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and 0 < value <= hi):
        raise ValueError(f"{name}={value!r} is out of range: give a finite number in (0, {hi:g}], e.g. 1e-6")
    return float(value)


class Variant(enum.StrEnum):
    """The published Engram modules: SPEC §1's two, and Qwen4-Exp's PLE.

    Attributes:
        V4_1: DeepSeek-V4.1's: fused wkv, no short conv, FP8 + ue8m0 table.
        DEMO_V1: The paper's demo: separate key projections, short causal conv.
        QWEN4_EXP_PLE: Qwen4-Exp's Per-Layer Embedding (transformers' `qwen4_exp`): raw ids,
            splitmix64 multipliers, windows restarting after EOS, one fused key projection normed per
            stream, dilated conv.
    """

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

    A frozen dataclass, validated on construction (`__post_init__`): every size is checked against
    the `MAX_*` bounds of this module before any work, and derived values (`orders`,
    `rows_per_token`, `engram_dim`, `n_layers`) are properties. The addressing fields must match the
    checkpoint and the tokenizer bit for bit. Presets live in `PRESETS` (`EngramConfig.preset`).

    Args:
        name: A label for the config (a preset's name, or "custom").
        variant: Which published module (`Variant`); a string value is converted.
        layer_ids: The backbone layers (0-based) that get an Engram module, each once.
        max_ngram_size: The largest n-gram order hashed; orders run 2..max_ngram_size.
        n_heads: K, the hash heads per order.
        engram_vocab_size: The prime-search base per n-gram order (orders 2..max_ngram_size);
            V4.1 uses 16000000 for every order, the paper's demo 129280*5. One int is spread
            over all orders.
        vocab_size: The tokenizer's ids, added tokens included.
        compressed_vocab_size: The ids after tokenizer compression (`TokenizerCompression`).
        pad_token_id: The id that pads windows at a sequence's start.
        seed: Seeds the hash multipliers (numpy `default_rng` or splitmix64, by `multiplier_scheme`).
        tokenizer: A known tokenizer name or a tokenizer.json path, or None.
        head_dim: The width of one table row.
        hidden_size: The backbone's residual width (dim).
        hc_mult: Residual streams (mHC); 1 is a plain residual.
        kernel_size: The short conv's kernel (demo-v1 and Qwen4-Exp only).
        norm_eps: The RMSNorm epsilon, in (0, 1].
        gate_clamp: The |dot| floor before the gate's signed square root, in (0, 1].
        restart_after_id: Windows restart after this tokenizer id (Qwen4-Exp: EOS): the token after
            it looks back at nothing before it (pads), as if a new sequence began. None: no
            automatic restarts (V4.1).
        multiplier_scheme: How a layer's odd hash multipliers are drawn (`MultiplierScheme`).
        table_rows_multiple: Each layer's table is padded up to a multiple of this many rows.
        declared_num_embeddings: What a loaded config.json declared for `engram_num_embeddings`
            (an int or one per layer), kept for the round trip and checked against the prime sums
            by `engram.checkpoint.hf_config.from_hf_dict`; not compared by `==`.

    Raises:
        TypeError: A field has the wrong type (e.g. a float where an int belongs).
        ValueError: A field is out of range or the fields disagree; the message names the field,
            the value and the fix.

    Examples:
        >>> from engram import EngramConfig
        >>> config = EngramConfig.preset("tiny")
        >>> config.orders, config.rows_per_token, config.engram_dim
        ((2, 3), 8, 256)
        >>> config.replace(n_heads=2).rows_per_token
        4
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
        # before engram_vocab_size is expanded to one base per order (max_ngram_size 10^9: 10^9 bases)
        if not 2 <= self.max_ngram_size <= MAX_NGRAM_SIZE:
            raise ValueError(
                f"max_ngram_size={self.max_ngram_size}: Engram needs at least 2-grams and hashes at most "
                f"{MAX_NGRAM_SIZE}-grams; give 2 to {MAX_NGRAM_SIZE} (MAX_NGRAM_SIZE; V4.1 uses 4)"
            )
        if isinstance(self.engram_vocab_size, int):
            set_(self, "engram_vocab_size", (self.engram_vocab_size,) * (self.max_ngram_size - 1))
        set_(self, "engram_vocab_size", _tuple_of_ints("engram_vocab_size", self.engram_vocab_size))
        set_(self, "norm_eps", check_eps("norm_eps", self.norm_eps))
        set_(self, "gate_clamp", check_eps("gate_clamp", self.gate_clamp))

        if not self.layer_ids:
            raise ValueError("layer_ids is empty: give at least one layer, e.g. (1,)")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids {self.layer_ids} repeats a layer; each layer has one table")
        if min(self.layer_ids) < 0:
            raise ValueError(f"layer_ids {self.layer_ids} has a negative layer; layers count from 0")
        if max(self.layer_ids) > MAX_LAYER_ID:
            raise ValueError(
                f"layer_ids has layer {max(self.layer_ids)}: give layer ids from 0 to {MAX_LAYER_ID} (MAX_LAYER_ID)"
            )
        if len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise ValueError(
                f"engram_vocab_size has {len(self.engram_vocab_size)} entries but orders 2..{self.max_ngram_size} "
                f"need {self.max_ngram_size - 1} (one prime-search base per order)"
            )
        if min(self.engram_vocab_size) < 2:
            raise ValueError(f"engram_vocab_size {self.engram_vocab_size} must be >= 2 (prime-search bases)")
        if not 1 <= self.n_heads <= MAX_HEADS:
            raise ValueError(
                f"n_heads={self.n_heads}: give 1 to {MAX_HEADS} hash heads per order (MAX_HEADS; V4.1 uses 8)"
            )
        for name, hi in (
            ("head_dim", MAX_HEAD_DIM),
            ("hidden_size", MAX_HIDDEN_SIZE),
            ("hc_mult", MAX_HC_MULT),
            ("kernel_size", MAX_KERNEL_SIZE),
            ("vocab_size", MAX_VOCAB_SIZE),
            ("table_rows_multiple", MAX_TABLE_ROWS_MULTIPLE),
        ):
            v = getattr(self, name)
            if not 1 <= v <= hi:
                raise ValueError(f"{name}={v}: give 1 to {hi:,} (MAX_{name.upper()})")
        if self.engram_dim > MAX_ENGRAM_DIM:
            raise ValueError(
                f"one token's lookup is (max_ngram_size - 1) * n_heads * head_dim = {self.max_ngram_size - 1} * "
                f"{self.n_heads} * {self.head_dim} = {self.engram_dim:,} values, over {MAX_ENGRAM_DIM:,} "
                "(MAX_ENGRAM_DIM; V4.1: 6,144): give fewer heads or orders, or a smaller head_dim"
            )
        rows = self.n_heads * sum(self.engram_vocab_size)  # about the sum of one layer's primes
        if rows > MAX_LAYER_ROWS:
            raise ValueError(
                f"n_heads * sum(engram_vocab_size) = {self.n_heads} * {sum(self.engram_vocab_size):,} = about "
                f"{rows:,} rows a layer, over {MAX_LAYER_ROWS:,} (MAX_LAYER_ROWS = 2^36; V4.1: 384M): give "
                "smaller engram_vocab_size bases (the rows of one head) or fewer heads"
            )
        primes = self.n_layers * self.rows_per_token
        if primes > MAX_PRIMES:
            raise ValueError(
                f"layers * orders * heads = {self.n_layers} * {self.max_ngram_size - 1} * {self.n_heads} = "
                f"{primes:,} primes to search, over {MAX_PRIMES:,} (MAX_PRIMES; V4.1: 48): give fewer layers, "
                "orders or heads"
            )
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
        """Layers with an Engram module: len(layer_ids)."""
        return len(self.layer_ids)

    def layer_index(self, layer_id: int) -> int:
        """The position of `layer_id` in `layer_ids` (the hasher's layer axis).

        Args:
            layer_id: A backbone layer id.

        Returns:
            Its index in `layer_ids`.

        Raises:
            ValueError: The layer has no Engram module in this config.
        """
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} has no Engram module; this config's layers are {self.layer_ids}"
            ) from None

    def replace(self, **changes: Any) -> EngramConfig:
        """A copy with some fields changed, validated again.

        Changing `max_ngram_size` alone spreads the first order's `engram_vocab_size` base over the
        new orders; `declared_num_embeddings` is dropped unless given.

        Args:
            **changes: Fields to change, by name.

        Returns:
            The new config.
        """
        if "engram_vocab_size" not in changes and "max_ngram_size" in changes:
            # one base, spread over the orders by __post_init__ once max_ngram_size is checked
            changes["engram_vocab_size"] = self.engram_vocab_size[0]
        changes.setdefault("declared_num_embeddings", None)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset(name: str) -> EngramConfig:
        """One of `PRESETS` by name.

        Args:
            name: 'deepseek-v4.1', 'demo-v1', 'qwen4-exp-tiny' or 'tiny'.

        Returns:
            The preset's config.

        Raises:
            ValueError: No preset has that name; the message lists the known ones.
        """
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            ) from None

    # ------------------------------------------------------------------ Hugging Face configs
    @classmethod
    def from_hf_config(cls, config: Any, *, name: str = "hf", tokenizer: str | None = None) -> EngramConfig:
        """The Engram config that a Hugging Face model config holds.

        Either family of keys is read: DeepSeek-V4.1's `engram_*` keys or Qwen4-Exp's `ple_*` /
        `ngram_*` keys (of a `Qwen4ExpTextConfig`, or a `Qwen4ExpConfig`'s `text_config`).
        A declared `engram_num_embeddings` is kept, not checked (the primes are not this module's):
        `engram.checkpoint.hf_config.from_hf_dict` reads the same keys and checks it.

        Args:
            config: A transformers config object or a plain dict (a config.json).
            name: The new config's `name`.
            tokenizer: The new config's `tokenizer` (`engram_*` keys only; Qwen4-Exp hashes raw ids).

        Returns:
            The config.

        Raises:
            TypeError: `config` is neither a mapping nor an object with `to_dict`, or a key has the
                wrong type.
            ValueError: The config holds neither family of keys, or its values are invalid.
        """
        d = _hf_mapping(config)
        if "engram_layer_ids" in d:
            return _from_engram_keys(d, name, tokenizer)
        if "ple_layer_ids" in d or "ngram_size" in d:
            return _from_qwen4_exp_keys(d, name)
        raise ValueError(
            f"{type(config).__name__} holds no Engram settings: looked for DeepSeek-V4.1's engram_* keys "
            f"({', '.join(HF_ENGRAM_KEYS)}) and Qwen4-Exp's ple_*/ngram_* keys ({', '.join(HF_QWEN4_EXP_KEYS)}); "
            f"found keys {sorted(d)[:30]}"
        )

    # ------------------------------------------------------------------ plain round trip
    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values (enums as their values, tuples as lists).

        The Hugging Face `engram_*` keys are `engram.checkpoint.hf_config`'s.

        Returns:
            A dict keyed by field name; `from_dict` reads it back.
        """
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngramConfig:
        """The inverse of `to_dict`.

        Args:
            d: A dict written by `to_dict` (lists for the tuple fields are accepted).

        Returns:
            The config.

        Raises:
            ValueError: `d` has keys that are not fields (a dict of another format or version).
        """
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


# ------------------------------------------------------------------------- Hugging Face keys
HF_ENGRAM_KEYS = (  # DeepSeek-V4.1's config.json: all required
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
)
# EngramConfig field -> config.json key, for the optional keys of the engram_* family
HF_ENGRAM_OPTIONAL = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("hc_mult", "hc_mult"),
    ("seed", "engram_seed"),
    ("kernel_size", "engram_kernel_size"),
    ("norm_eps", "engram_norm_eps"),
    ("gate_clamp", "engram_gate_clamp"),
    ("restart_after_id", "engram_restart_after_id"),
    ("multiplier_scheme", "engram_multiplier_scheme"),
    ("table_rows_multiple", "engram_table_rows_multiple"),
)
HF_QWEN4_EXP_KEYS = (  # Qwen4ExpTextConfig's PLE keys (defaults are transformers')
    "ple_layer_ids",
    "ple_embed_dim",
    "ple_conv_kernel_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "seed",
    "eos_token_id",
    "vocab_size",
    "hidden_size",
    "hc_count",
    "rms_norm_eps",
)
_QWEN4_EXP_DEFAULTS = {
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "vocab_size": 248320,
    "hidden_size": 2048,
    "hc_count": 4,
    "rms_norm_eps": 1e-6,
}


def _hf_mapping(config: Any) -> Mapping[str, Any]:
    """The keys of a transformers config object or a dict; a multimodal config's text_config."""
    if isinstance(config, Mapping):
        d: Mapping[str, Any] = config
    elif callable(getattr(config, "to_dict", None)):
        d = config.to_dict()
    else:
        raise TypeError(f"from_hf_config takes a transformers config or a dict, got {type(config).__name__}")
    text = d.get("text_config")
    if text is not None and "engram_layer_ids" not in d and "ple_layer_ids" not in d:
        if not isinstance(text, Mapping):
            text = text.to_dict() if callable(getattr(text, "to_dict", None)) else text
        if not isinstance(text, Mapping):
            raise TypeError(f"text_config must be a config or a dict, got {type(text).__name__}")
        d = text
    return d


def _int_key(d: Mapping[str, Any], key: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{key} must be an int, got {v!r}")
    return v


def _from_engram_keys(d: Mapping[str, Any], name: str, tokenizer: str | None) -> EngramConfig:
    if "engram_pad_id" in d:  # the name SPEC §4 and the issue use; engram_pad_token_id ours
        if "engram_pad_token_id" in d and d["engram_pad_token_id"] != d["engram_pad_id"]:
            raise ValueError(
                f"engram_pad_id={d['engram_pad_id']!r} and engram_pad_token_id={d['engram_pad_token_id']!r} "
                "disagree; keep one"
            )
        d = {**d, "engram_pad_token_id": d["engram_pad_id"]}
    missing = [k for k in HF_ENGRAM_KEYS if k not in d]
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
        "seed": 0,
        "tokenizer": tokenizer,
    }
    for key, hf_key in HF_ENGRAM_OPTIONAL:
        if hf_key in d:
            kw[key] = check_eps(hf_key, d[hf_key]) if key in ("norm_eps", "gate_clamp") else d[hf_key]
    declared = d.get("engram_num_embeddings")
    if isinstance(declared, list):
        declared = tuple(declared)
    if declared is not None and not (
        (isinstance(declared, int) and not isinstance(declared, bool))
        or (
            isinstance(declared, tuple)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in declared)
        )
    ):
        raise TypeError(f"engram_num_embeddings must be an int or a list of ints, got {declared!r}")
    return EngramConfig(**kw, declared_num_embeddings=declared)


def _from_qwen4_exp_keys(d: Mapping[str, Any], name: str) -> EngramConfig:
    g = {**_QWEN4_EXP_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    ple = d.get("ple_layer_ids") or []
    if not isinstance(ple, list | tuple) or not ple:
        raise ValueError(
            f"ple_layer_ids={d.get('ple_layer_ids')!r}: this Qwen4-Exp config has no PLE layers "
            "(give the one-indexed decoder layers that use PLE, e.g. ple_layer_ids=[1, 3])"
        )
    layers = sorted({int(i) for i in ple})
    if layers[0] < 1:
        raise ValueError(f"ple_layer_ids {list(ple)} must be one-indexed decoder layers (>= 1)")
    eos = g.get("eos_token_id")
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError(
            "eos_token_id must be set: Qwen4-Exp's PLE pads with EOS and restarts windows after it"
        )
    n, k = _int_key(g, "ngram_size"), _int_key(g, "heads_per_ngram")
    hidden = _int_key(g, "hidden_size")
    embed = d.get("ple_embed_dim") or hidden
    heads = (n - 1) * k
    if heads <= 0 or embed <= 0 or embed % heads:
        raise ValueError(
            f"ple_embed_dim={embed} must be a positive multiple of the n-gram heads (ngram_size-1)*heads_per_ngram "
            f"= ({n}-1)*{k} = {heads}"
        )
    vocab = _int_key(g, "vocab_size")
    return EngramConfig(
        name=name,
        variant=Variant.QWEN4_EXP_PLE,
        layer_ids=tuple(i - 1 for i in layers),  # 0-based: PLE runs at the entrance of decoder layer i-1
        max_ngram_size=n,
        n_heads=k,
        engram_vocab_size=_int_key(g, "ngram_vocab_size_base"),
        vocab_size=vocab,
        compressed_vocab_size=vocab,
        pad_token_id=int(eos),
        restart_after_id=int(eos),
        seed=_int_key(g, "seed"),
        tokenizer=None,
        head_dim=embed // heads,
        hidden_size=hidden,
        hc_mult=_int_key(g, "hc_count"),
        kernel_size=_int_key(g, "ple_conv_kernel_size"),
        norm_eps=check_eps("rms_norm_eps", g["rms_norm_eps"]),
        multiplier_scheme=MultiplierScheme.SPLITMIX64,
        table_rows_multiple=_int_key(g, "make_ngram_vocab_size_divisible_by"),
    )


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
    # Qwen4-Exp's PLE at CPU size (the real model's keys: EngramConfig.from_hf_config of its
    # Qwen4ExpTextConfig): raw ids of a 1000-id vocabulary, EOS 1, PLE at decoder layers 2 and 4.
    "qwen4-exp-tiny": EngramConfig(
        name="qwen4-exp-tiny",
        variant=Variant.QWEN4_EXP_PLE,
        layer_ids=(1, 3),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(4096, 4096),
        vocab_size=1000,
        compressed_vocab_size=1000,
        pad_token_id=1,
        restart_after_id=1,
        seed=1234,
        tokenizer=None,
        head_dim=8,
        hidden_size=64,
        hc_mult=2,
        kernel_size=4,
        multiplier_scheme=MultiplierScheme.SPLITMIX64,
        table_rows_multiple=128,
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
"""The preset registry, by name: 'deepseek-v4.1', 'demo-v1', 'qwen4-exp-tiny' and 'tiny' (CPU-sized)."""
