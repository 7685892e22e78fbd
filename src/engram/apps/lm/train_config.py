"""A training run's settings: `TrainConfig` (backbone, its nested `EngramConfig` or None for the
baseline, optimisation, evaluation, checkpoints), the table optimizer's `TableOptimizer`, and the
named `TRAIN_PRESETS`. Plain values and JSON round trip only: it trains nothing.
Design: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engram.checkpoint.input_files import input_file
from engram.checkpoint.json_file import read_json
from engram.config import MAX_HC_MULT, MAX_HIDDEN_SIZE, MAX_LAYER_ID, MAX_VOCAB_SIZE, EngramConfig

__all__ = [
    "DEFAULT_ENGRAM",
    "ENGRAM_MODES",
    "TRAIN_PRESETS",
    "EmbeddingOptimizer",
    "RowHash",
    "TableOptimizer",
    "TrainConfig",
]

# Bounds on a run's sizes beyond EngramConfig's (engram.config: MAX_HIDDEN_SIZE for dim, MAX_HC_MULT
# for hc, MAX_VOCAB_SIZE for bpe_vocab_size, MAX_LAYER_ID + 1 layers): generous for a model trained
# here (the presets: dim 64-192, seq_len 64-256) but a mistyped size is refused before any work.
MAX_MLP_HIDDEN = 4 * MAX_HIDDEN_SIZE  # a feed-forward layer's (or one expert's) width
MAX_SEQ_LEN = 1 << 20  # tokens a sequence
MAX_BATCH_SIZE = 1 << 16  # sequences a step
MAX_EXPERTS = 1024  # routed experts of a MoE feed-forward
_DEEPSEEK_V4_VOCAB = 129_280  # the deepseek-v4 tokenizer's ids, for the memory estimate


class TableOptimizer(enum.StrEnum):
    """The sparse row optimizer of the Engram tables (engram.model.optim)."""

    ADAM = "adam"  # SparseRowAdam
    ADAGRAD = "adagrad"  # SparseRowAdagrad
    SINKHORN = "sinkhorn"  # SparseSinkhorn: V4.1's Sinkhorn-balanced update (SPEC §7b)
    DENSE_ADAM = "dense-adam"  # DenseTableAdam: the paper's Adam over the whole table (a comparison)


class EmbeddingOptimizer(enum.StrEnum):
    """The optimizer of the token embedding and the LM head (the head is the embedding when tied)."""

    ADAMW = "adamw"  # with the rest of the backbone
    SINKHORN = "sinkhorn"  # V4.1's recipe: the Sinkhorn-balanced update at `lr`, AdamW for the rest


class RowHash(enum.StrEnum):
    """How each token's Engram rows are chosen (engram.apps.lm.rows). Everything but NGRAM is a control
    for the studies: rows that ignore the n-gram."""

    NGRAM = "ngram"  # the Engram hash of the token's suffix n-grams (the real thing)
    RANDOM = "random"  # a seeded random row per head and stream position (train and held-out differ)
    POSITION = "position"  # a function of the token's position in its document only
    CONSTANT = "constant"  # one row per head for every token: a table of capacity 1


# engram.model.lm.EngramMode's values (this module imports no model code)
ENGRAM_MODES = ("gated", "fixed-gate", "input-embedding")

# TrainConfig's Engram: layer 1, orders 2-3, 4 heads of 32-wide rows, prime-search base 30000 per
# order (rows per head ~ base). hidden_size and hc_mult are the backbone's dim and hc.
DEFAULT_ENGRAM = EngramConfig(
    name="lm",
    layer_ids=(1,),
    max_ngram_size=3,
    n_heads=4,
    engram_vocab_size=(30000, 30000),
    tokenizer=None,
    head_dim=32,
    hidden_size=128,
    hc_mult=1,
)

# The fields of the old flat format (before `engram` held an EngramConfig); refused, never misread.
_FLAT_ENGRAM_KEYS = ("engram_layers", "engram_max_ngram", "engram_heads", "engram_head_dim", "engram_base")


@dataclass(frozen=True)
class TrainConfig:
    """A training run. `engram` is the Engram module (None: the baseline backbone alone); its
    tokenizer fields (tokenizer, vocab_size, compressed_vocab_size, pad_token_id) are set by
    `prepare_data` from the run's tokenizer, whatever they hold here."""

    # data
    corpus: str | None = None  # None: the King James Bible; else a text file, folder or glob
    tokenizer: str = "bpe"  # "bpe" (trained on the training split), "deepseek-v4", or a tokenizer.json
    bpe_vocab_size: int = 4096
    # backbone
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int = 384
    seq_len: int = 128
    hc: int = 1
    tie_embeddings: bool = True
    # Engram (hidden_size == dim, hc_mult == hc)
    engram: EngramConfig | None = DEFAULT_ENGRAM
    engram_mode: str = "gated"  # ENGRAM_MODES: the module, its gate fixed at 1, or an input embedding
    row_hash: RowHash = RowHash.NGRAM
    compression: bool = True  # False: the identity map (Engram hashes raw tokenizer ids)
    # feed-forward: 0 experts is the dense SwiGLU; else top-k routed experts (engram.model.ffn.MoE)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_hidden: int | None = None  # width of one expert (None: mlp_hidden // moe_top_k)
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss in the training loss
    # optimisation
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    table_lr: float = 5e-2
    table_optimizer: TableOptimizer = TableOptimizer.ADAM
    embedding_optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ADAMW
    embedding_lr: float | None = None  # with embedding_optimizer 'sinkhorn' (None: lr)
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # evaluation and checkpoints
    eval_every: int = 50
    eval_tokens: int = 16384  # held-out tokens sampled (over every document) at each periodic evaluation
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name, kind in (
            ("table_optimizer", TableOptimizer),
            ("embedding_optimizer", EmbeddingOptimizer),
            ("row_hash", RowHash),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise ValueError(
                    f"{name}={value!r}: use one of {', '.join(repr(o.value) for o in kind)}"
                ) from None
        for name in ("lr", "table_lr") + (("embedding_lr",) if self.embedding_lr is not None else ()):
            value = getattr(self, name)
            if not 0 < value < math.inf:  # NaN too
                raise ValueError(
                    f"{name}={value!r} must be a finite number > 0"
                    + (" (or null: the dense lr)" if name == "embedding_lr" else "")
                )
        if self.embedding_lr is not None and self.embedding_optimizer is not EmbeddingOptimizer.SINKHORN:
            raise ValueError(
                f"embedding_lr={self.embedding_lr!r} is the Sinkhorn embedding's learning rate, but "
                f"embedding_optimizer={self.embedding_optimizer.value!r} would ignore it: set "
                "embedding_optimizer='sinkhorn' (--embedding-optimizer sinkhorn), or drop embedding_lr"
            )
        for name, hi in (("min_lr_ratio", 1.0), ("weight_decay", math.inf), ("grad_clip", math.inf),
                         ("moe_aux_coef", math.inf)):  # fmt: skip
            value = getattr(self, name)
            if not (0 <= value <= hi and math.isfinite(value)):  # NaN too
                raise ValueError(
                    f"{name}={value!r} must be a finite number from 0"
                    + (f" to {hi:g}" if hi < math.inf else "")
                )
        if self.engram_mode not in ENGRAM_MODES:
            raise ValueError(f"engram_mode={self.engram_mode!r}: use one of {ENGRAM_MODES}")
        for name, hi in (
            ("steps", None),
            ("batch_size", MAX_BATCH_SIZE),
            ("seq_len", MAX_SEQ_LEN),
            ("dim", MAX_HIDDEN_SIZE),
            ("n_layers", MAX_LAYER_ID + 1),
            ("n_heads", self.dim),
            ("mlp_hidden", MAX_MLP_HIDDEN),
            ("hc", MAX_HC_MULT),
            ("bpe_vocab_size", MAX_VOCAB_SIZE),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}={v!r}: give a whole number")
            if v < 1 or (hi is not None and v > hi):
                raise ValueError(
                    f"{name}={v} must be >= 1"
                    + ("" if hi is None else f" and at most {hi:,}")
                    + (" (dim)" if name == "n_heads" else "")
                )
        if self.moe_experts > MAX_EXPERTS:
            raise ValueError(f"moe_experts={self.moe_experts}: give at most {MAX_EXPERTS} experts (0: dense)")
        if self.moe_hidden is not None and not 1 <= self.moe_hidden <= MAX_MLP_HIDDEN:
            raise ValueError(
                f"moe_hidden={self.moe_hidden}: give 1 to {MAX_MLP_HIDDEN:,} (or null: mlp_hidden // moe_top_k)"
            )
        if self.moe_experts < 0 or (self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts):
            raise ValueError(
                f"moe_experts={self.moe_experts}, moe_top_k={self.moe_top_k}: give 0 experts (dense) or "
                "1 <= moe_top_k <= moe_experts"
            )
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints={self.keep_checkpoints} must be >= 1")
        e = self.engram
        if e is None:
            changed = [
                f"{k}={getattr(getattr(self, k), 'value', getattr(self, k))!r}"
                for k, default in (
                    ("engram_mode", "gated"),
                    ("row_hash", RowHash.NGRAM),
                    ("compression", True),
                )
                if getattr(self, k) != default
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} but engram is None (the baseline has no rows): drop them or give an EngramConfig"
                )
            return
        if not isinstance(e, EngramConfig):
            raise TypeError(
                f"engram must be an EngramConfig or None (the baseline), got {type(e).__name__}; "
                "a dict of its fields is read with TrainConfig.from_dict"
            )
        if max(e.layer_ids) >= self.n_layers:
            raise ValueError(
                f"engram.layer_ids={e.layer_ids} must name layers of the {self.n_layers}-layer model "
                f"(0..{self.n_layers - 1})"
            )
        if (e.hidden_size, e.hc_mult) != (self.dim, self.hc):
            raise ValueError(
                f"engram.hidden_size={e.hidden_size}, engram.hc_mult={e.hc_mult} but the backbone has "
                f"dim={self.dim}, hc={self.hc}: Engram adds into the backbone's residual streams; use "
                f"engram=cfg.engram.replace(hidden_size={self.dim}, hc_mult={self.hc})"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def train_bytes(self) -> int:
        """A lower bound on the memory training takes, before anything is allocated: the parameters in
        float32 with their gradients and AdamW's two moments (16 bytes each; the embedding counted where
        the tokenizer's size is known: 'bpe', 'deepseek-v4'), and the Engram tables with their optimizer
        state (about n_heads * sum(engram_vocab_size) rows a layer, 8 bytes a value and 8 a row; 16 a
        value for dense-adam). Activations are not counted."""
        vocab = {"bpe": self.bpe_vocab_size, "deepseek-v4": _DEEPSEEK_V4_VOCAB}.get(self.tokenizer, 0)
        d = self.dim
        if self.moe_experts:
            width = self.moe_hidden or max(1, self.mlp_hidden // self.moe_top_k)
            ffn = self.moe_experts * (3 * d * width + d)
        else:
            ffn = 3 * d * self.mlp_hidden
        params = vocab * d * (1 if self.tie_embeddings else 2) + self.n_layers * (4 * d * d + ffn)
        tables = 0
        e = self.engram
        if e is not None:
            params += e.n_layers * e.engram_dim * e.hidden_size * (e.hc_mult + 1)  # key / value projections
            per_row = (
                16 * e.head_dim if self.table_optimizer is TableOptimizer.DENSE_ADAM else 8 * e.head_dim + 8
            )
            tables = e.n_layers * e.n_heads * sum(e.engram_vocab_size) * per_row
        return 16 * params + tables

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: `engram` as EngramConfig.to_dict() (or None), enums as their strings."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["engram"] = None if self.engram is None else self.engram.to_dict()
        d["table_optimizer"] = self.table_optimizer.value
        d["embedding_optimizer"] = self.embedding_optimizer.value
        d["row_hash"] = self.row_hash.value
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The inverse of `to_dict`; refuses unknown keys and the old flat format (`engram: true` and
        `engram_*` keys)."""
        if isinstance(d.get("engram"), bool) or any(k in d for k in _FLAT_ENGRAM_KEYS):
            raise ValueError(
                "a training config of the old flat format (engram: true/false, engram_layers, engram_heads, "
                "...); `engram` now holds an EngramConfig's fields (EngramConfig.to_dict), or null for the "
                "baseline"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training config keys {unknown}; known keys: {sorted(known)}")
        hints = typing.get_type_hints(cls)
        for key, value in d.items():
            if not _json_fits(value, hints[key]):
                raise TypeError(
                    f"{key}={value!r}: expected {_json_expected(hints[key])}, got {_json_kind(value)}; "
                    f"give {key} as {_json_expected(hints[key])}"
                )
        kw = dict(d)
        if kw.get("engram") is not None:
            kw["engram"] = EngramConfig.from_dict(kw["engram"])
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        data = read_json(input_file(path, "a JSON file"))  # never opens a FIFO; ValueError naming the file
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: expected a JSON object of TrainConfig fields, got {type(data).__name__}"
            )
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path}: {e}") from None


# ------------------------------------------------------------------------------------------- JSON types
def _json_fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value can stand for a field annotated `hint` (bool is not a number here; an
    int is a float; an enum field takes its value's string, which __post_init__ checks)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_json_fits(value, h) for h in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, str):  # str, and the StrEnums
        return isinstance(value, str)
    if hint is dict or hint is EngramConfig:  # a JSON object (of EngramConfig's fields)
        return isinstance(value, dict)
    return True  # a type JSON cannot name: the constructor checks it


def _json_expected(hint: Any) -> str:
    """What a field annotated `hint` takes, in JSON words."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_json_expected(h) for h in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    words = {type(None): "null", bool: "true or false", int: "a whole number", float: "a number",
             str: "a string", dict: "a JSON object", EngramConfig: "a JSON object of EngramConfig fields"}  # fmt: skip
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _json_kind(value: Any) -> str:
    """What a JSON value is, in the same words."""
    for kind, word in ((bool, "true or false"), (int, "a whole number"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "a JSON object")):  # fmt: skip
        if isinstance(value, kind):
            return word
    return "null" if value is None else type(value).__name__


# Named configs sized for a 2-core CPU (tokens/s measured there: about 10K for "demo").
TRAIN_PRESETS: dict[str, TrainConfig] = {
    # a few seconds: smoke tests and examples
    "tiny": TrainConfig(
        bpe_vocab_size=1024,
        dim=64,
        n_layers=2,
        n_heads=2,
        mlp_hidden=192,
        seq_len=64,
        engram=DEFAULT_ENGRAM.replace(hidden_size=64, engram_vocab_size=(5000, 5000)),
        steps=50,
        batch_size=16,
        eval_every=25,
        eval_tokens=8192,
    ),
    # `engram demo`'s model: 4 layers of 128, Engram at layer 1 (about 3.5 minutes per model)
    "demo": TrainConfig(steps=240, eval_every=40, eval_tokens=16384),
    # a longer run: 6 layers of 192, two Engram layers (1 and 4); about an hour on 2 cores
    "small": TrainConfig(
        dim=192,
        n_layers=6,
        n_heads=6,
        mlp_hidden=512,
        seq_len=256,
        engram=DEFAULT_ENGRAM.replace(
            hidden_size=192, layer_ids=(1, 4), max_ngram_size=4, engram_vocab_size=(60000,) * 3
        ),
        steps=2000,
        batch_size=16,
        eval_every=200,
        checkpoint_every=500,
    ),
}
