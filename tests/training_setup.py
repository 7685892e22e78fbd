"""The small training setup several test files share: a corpus of 12 short books of the Bible and a
tiny TrainConfig on it (seconds-long runs; the BPE trained on it is cached)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engram.apps.lm.corpus import kjv_verses
from engram.apps.lm.train import DEFAULT_ENGRAM, TrainConfig
from engram.config import EngramConfig


def write_corpus(root: Path) -> str:
    """12 short books of the Bible as text files under root (at most 12000 characters each)."""
    books: dict[str, list[str]] = {}
    for v in kjv_verses():
        books.setdefault(v["book"], []).append(v["text"])
    for name in list(books)[:12]:
        (root / f"{name}.txt").write_text("\n".join(books[name])[:12000], encoding="utf-8")
    return str(root)


def tiny_engram(dim: int = 32, hc: int = 1, **kw: Any) -> EngramConfig:
    """Layer 1, orders 2-3, 2 heads of 8-wide rows, base 500, for a backbone of `dim` and `hc`
    streams; `kw` overrides any EngramConfig field."""
    fields = dict(n_heads=2, head_dim=8, engram_vocab_size=(500, 500), hidden_size=dim, hc_mult=hc)
    return DEFAULT_ENGRAM.replace(**(fields | kw))


def tiny_cfg(corpus: str, engram_kw: dict[str, Any] | None = None, **kw: Any) -> TrainConfig:
    """A 2-layer, 32-wide model with one small Engram layer (tiny_engram, with `engram_kw`) on
    `corpus`; `kw` overrides any field (engram=None: the baseline)."""
    base: dict[str, Any] = dict(
        corpus=corpus,
        bpe_vocab_size=512,
        dim=32,
        n_layers=2,
        n_heads=2,
        mlp_hidden=64,
        seq_len=32,
        steps=30,
        batch_size=8,
        warmup=5,
        eval_every=10,
        eval_tokens=2048,
        lr=1e-2,
        table_lr=5e-2,
    )
    base.update(kw)
    if "engram" not in base:
        base["engram"] = tiny_engram(base["dim"], base.get("hc", 1), **(engram_kw or {}))
    return TrainConfig(**base)


def dist_cfg(corpus: str) -> TrainConfig:
    """The distributed tests' run: two Engram layers (two tables, one exchange for both), 6 steps of
    6 sequences (splits over 2 and 3 ranks), evaluation every 3 steps, one thread."""
    return tiny_cfg(
        corpus,
        engram_kw={"layer_ids": (0, 1)},
        steps=6,
        batch_size=6,
        warmup=2,
        eval_every=3,
        eval_tokens=1024,
        threads=1,
    )
