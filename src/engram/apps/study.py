"""`engram study`: the questions a researcher asks after the demo, answered with seed spreads.

Holds the studies (`STUDIES`): `memory` (the table grown at constant compute), `ablations` (gate,
compression, orders, heads, capacity 1, rows that ignore the n-gram), `baselines` (same FLOPs, same
total parameters on a wider or deeper dense backbone, a plain hashed n-gram input embedding) and
`allocation` (a fixed budget of sparse parameters split between MoE experts and the Engram table).
`plan_study` lists a study's runs (`RunSpec`: a TrainConfig with its seed, a variant name, a value
to plot); `run_study` trains what is not already cached, two runs in lock-step at a time (one step
each in turn, as the demo does, so a noisy machine slows both alike), and writes the report
(`engram.apps.study_report`). Every finished run is a JSON record in `<out>/runs/`, named by the
hash of its config and corpus: an interrupted study continues where it stopped, and studies sharing
a folder share runs (the baseline, the reference Engram). Studies compare final full evaluations.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram.addressing.layout import Layout
from engram.apps.data import load_corpus
from engram.apps.train import TRAIN_PRESETS, DataBundle, TrainConfig, Trainer, build_model, prepare_data
from engram.apps.train_config import RowHash
from engram.config import EngramConfig

__all__ = ["STUDIES", "RunSpec", "corpus_fingerprint", "plan_study", "run_key", "run_study", "study_base"]

STUDIES = ("memory", "ablations", "baselines", "allocation")
_RECORD_VERSION = 1

# Table sizes of the memory study: the preset's prime-search base per head times these factors.
MEMORY_FACTORS = (1 / 16, 1 / 4, 1.0, 4.0)
QUICK_MEMORY_FACTORS = (1 / 4, 1.0, 4.0)
# The baselines study's Engram table: the preset's scaled by this, so the dense models with the
# same total parameters stay affordable (about 2x the backbone's compute at the demo size).
BASELINES_TABLE_SCALE = 1 / 8
# The allocation study: a sparse budget worth this many idle experts (per MoE layer), top-2 routing,
# and the fraction of it given to experts.
ALLOCATION_BUDGET_EXPERTS = 8
ALLOCATION_TOP_K = 2
ALLOCATION_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
QUICK_ALLOCATION_RATIOS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class RunSpec:
    """One training run of a study: `variant` names it across seeds, `cfg` holds its seed."""

    variant: str
    cfg: TrainConfig
    x: float | None = None  # what the study plots it against (table rows, allocation ratio)
    note: str = ""  # what the variant is, in words (the report's table)

    @property
    def seed(self) -> int:
        return self.cfg.seed


# ---------------------------------------------------------------------------- base config
def study_base(
    size: str | None = None,
    *,
    steps: int | None = None,
    corpus: str | None = None,
    threads: int | None = None,
    quick: bool = False,
) -> TrainConfig:
    """The studies' training config: preset `size` (default "demo"; quick: "tiny" and 150 steps),
    `steps` and `corpus` overrides; periodic evaluations every quarter of the run on a sample
    (studies compare the final full evaluation only)."""
    size = size or ("tiny" if quick else "demo")
    if size not in TRAIN_PRESETS:
        raise ValueError(f"--size {size!r}: use one of {', '.join(TRAIN_PRESETS)}")
    cfg = TRAIN_PRESETS[size]
    n = steps if steps is not None else (150 if quick else cfg.steps)
    if n < 1:
        raise ValueError(f"--steps {n} must be >= 1")
    return cfg.replace(
        steps=n,
        warmup=min(cfg.warmup, max(1, n // 5)),
        eval_every=max(1, n // 4),
        eval_tokens=8192,
        corpus=corpus,
        threads=threads,
        checkpoint_every=0,
    )


def _with_table_base(e: EngramConfig, base: int) -> EngramConfig:
    return e.replace(engram_vocab_size=(max(2, int(base)),) * (e.max_ngram_size - 1))


def table_rows(e: EngramConfig) -> int:
    """Rows of the Engram tables of config `e` (every layer)."""
    return Layout(e).total_rows


def _with_rows(e: EngramConfig, target: int) -> EngramConfig:
    """`e` with the base per head whose tables hold the number of rows nearest `target` (each head
    takes a distinct prime above the base, so rows are not simply base x heads at small sizes)."""
    lo, hi = 2, max(2, target)
    while lo < hi:  # the smallest base with at least `target` rows (rows grow with the base)
        mid = (lo + hi) // 2
        if table_rows(_with_table_base(e, mid)) < target:
            lo = mid + 1
        else:
            hi = mid
    best = [_with_table_base(e, b) for b in (max(2, lo - 1), lo)]
    return min(best, key=lambda c: abs(table_rows(c) - target))


# ---------------------------------------------------------------------------- the studies' runs
def _engram(base: TrainConfig) -> EngramConfig:
    if base.engram is None:
        raise ValueError("the studies need a config with an EngramConfig (cfg.engram is None)")
    return base.engram


def _plan_memory(base: TrainConfig, quick: bool) -> list[tuple[str, TrainConfig, float | None, str]]:
    e = _engram(base)
    b0 = e.engram_vocab_size[0]
    out: list[tuple[str, TrainConfig, float | None, str]] = [
        ("baseline", base.replace(engram=None), None, "no Engram (same backbone, same FLOPs)")
    ]
    for f in QUICK_MEMORY_FACTORS if quick else MEMORY_FACTORS:
        ec = _with_table_base(e, round(b0 * f))
        rows = table_rows(ec)
        out.append((_table_name(ec), base.replace(engram=ec), float(rows), f"{rows:,} table rows"))
    return out


def _table_name(e: EngramConfig) -> str:
    return f"engram base {e.engram_vocab_size[0]}"


def _plan_ablations(base: TrainConfig, quick: bool) -> list[tuple[str, TrainConfig, float | None, str]]:
    """Every variant keeps the table's total rows about equal to the reference's, so a difference
    is the structure's, not the capacity's (capacity 1 aside)."""
    e = _engram(base)
    b0 = e.engram_vocab_size[0]
    orders0, heads0 = e.max_ngram_size - 1, e.n_heads
    ref = base.replace(engram=e)
    out: list[tuple[str, TrainConfig, float | None, str]] = [
        ("baseline", base.replace(engram=None), None, "no Engram"),
        (
            _table_name(e),
            ref,
            None,
            f"the reference: orders 2-{e.max_ngram_size}, {heads0} heads, gate, compression",
        ),
        ("gate fixed at 1", ref.replace(engram_mode="fixed-gate"), None, "value added with gate 1"),
        ("compression off", ref.replace(compression=False), None, "rows hashed from raw tokenizer ids"),
        (
            "random rows",
            ref.replace(row_hash=RowHash.RANDOM),
            None,
            "a seeded random row per head and position",
        ),
        (
            "position rows",
            ref.replace(row_hash=RowHash.POSITION),
            None,
            "rows from the position in the document",
        ),
        (
            "capacity 1",
            ref.replace(engram=_with_table_base(e, 2), row_hash=RowHash.CONSTANT),
            None,
            "one row per head for every token",
        ),
    ]
    if quick:
        return out[:5]
    for n in (2, 4):
        if n - 1 == orders0:
            continue
        ec = _with_rows(e.replace(max_ngram_size=n, engram_vocab_size=(b0,) * (n - 1)), table_rows(e))
        out.append(
            (f"orders 2-{n}" if n > 2 else "order 2 only", ref.replace(engram=ec), None, "same total rows")
        )
    for k in (1, 8):
        if k == heads0:
            continue
        ec = _with_rows(e.replace(n_heads=k), table_rows(e))
        out.append(
            (f"{k} head{'s' if k > 1 else ''} per order", ref.replace(engram=ec), None, "same total rows")
        )
    return out


def _dense_params(cfg: TrainConfig, vocab: int, *, dim: int | None = None, layers: int | None = None) -> int:
    """Parameters of the dense backbone of `cfg` (hc = 1) as `build_model` makes it, with `dim`
    (the MLP scaled alike) or `layers` changed."""
    d = dim or cfg.dim
    h = round(cfg.mlp_hidden / cfg.dim * d)
    block = 4 * d * d + 3 * d * h + 2 * d  # attention (wqkv, wo), SwiGLU, two norms
    head = 0 if cfg.tie_embeddings else vocab * d
    return vocab * d + (layers or cfg.n_layers) * block + d + head


def _plan_baselines(
    base: TrainConfig, quick: bool, vocab: int
) -> list[tuple[str, TrainConfig, float | None, str]]:
    e = _engram(base)
    e = _with_table_base(e, round(e.engram_vocab_size[0] * BASELINES_TABLE_SCALE))
    ref = base.replace(engram=e)
    # Engram's total parameters: the backbone, its table and its projection (v4.1: wkv and q/k weights)
    total = _dense_params(base, vocab) + table_rows(e) * e.head_dim
    total += len(e.layer_ids) * (e.engram_dim * (base.hc + 1) * base.dim + 2 * base.hc * base.dim)
    step = 2 * base.n_heads  # dim must split into n_heads heads of even width
    ratio = base.mlp_hidden / base.dim
    dims = range(base.dim, 16 * base.dim + 1, step)
    wide = min(dims, key=lambda d: abs(_dense_params(base, vocab, dim=d) - total))
    layers = range(base.n_layers, 64 * base.n_layers + 1)
    deep = min(layers, key=lambda n: abs(_dense_params(base, vocab, layers=n) - total))
    ie = e
    if e.n_heads * e.head_dim != base.dim:  # the input embedding concatenates an order's heads to dim
        hd = base.dim // e.n_heads
        ie = _with_table_base(e.replace(head_dim=hd), round(e.engram_vocab_size[0] * e.head_dim / hd))
    out: list[tuple[str, TrainConfig, float | None, str]] = [
        (_table_name(e), ref, None, f"Engram, {total:,} parameters in all"),
        ("baseline", base.replace(engram=None), None, "same FLOPs: the backbone alone"),
        (
            "hashed n-gram input embedding",
            ref.replace(engram=ie, engram_mode="input-embedding"),
            None,
            "the same rows, orders averaged, added to the token embedding; no gate, no projection",
        ),
        (
            f"wider dense (dim {wide})",
            base.replace(engram=None, dim=wide, mlp_hidden=round(ratio * wide)),
            None,
            "same total parameters",
        ),
        (
            f"deeper dense ({deep} layers)",
            base.replace(engram=None, n_layers=deep),
            None,
            "same total parameters",
        ),
    ]
    return out[:3] if quick else out


def _plan_allocation(base: TrainConfig, quick: bool) -> list[tuple[str, TrainConfig, float | None, str]]:
    """Top-2 MoE with experts of mlp_hidden / 2 (the activated width of the dense MLP) and a fixed
    budget of sparse parameters: ratio rho of it in experts that are idle for a token, the rest in
    the Engram table. rho = 1: no Engram; rho = 0: two experts (every token uses both)."""
    e = _engram(base)
    k = ALLOCATION_TOP_K
    hidden = base.mlp_hidden // k
    expert = 3 * base.dim * hidden * base.n_layers  # one expert in every layer
    budget = ALLOCATION_BUDGET_EXPERTS * expert
    out: list[tuple[str, TrainConfig, float | None, str]] = []
    for rho in QUICK_ALLOCATION_RATIOS if quick else ALLOCATION_RATIOS:
        idle = round(rho * ALLOCATION_BUDGET_EXPERTS)
        moe = base.replace(moe_experts=k + idle, moe_top_k=k, moe_hidden=hidden)
        left = budget - idle * expert
        if left <= 0:
            cfg, table = moe.replace(engram=None), 0
        else:
            ec = _with_rows(e, round(left / e.head_dim))
            cfg, table = moe.replace(engram=ec), table_rows(ec) * e.head_dim
        actual = idle * expert / (idle * expert + table)
        out.append(
            (
                f"experts {actual:.0%}",
                cfg,
                actual,
                f"{k + idle} experts (top-{k}), table {table:,} parameters",
            )
        )
    return out


def plan_study(
    study: str, base: TrainConfig, seeds: tuple[int, ...], *, quick: bool = False, vocab: int
) -> list[RunSpec]:
    """The runs of `study` for every seed (seed-major: lock-step pairs share a seed where they can);
    `vocab`: the tokenizer's size (parameter counts of the baselines study)."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}: use one of {', '.join(STUDIES)} (or 'all')")
    if not seeds:
        raise ValueError("seeds is empty: give at least one seed")
    plans = {
        "memory": lambda: _plan_memory(base, quick),
        "ablations": lambda: _plan_ablations(base, quick),
        "baselines": lambda: _plan_baselines(base, quick, vocab),
        "allocation": lambda: _plan_allocation(base, quick),
    }
    variants = plans[study]()
    return [RunSpec(name, cfg.replace(seed=s), x, note) for s in seeds for name, cfg, x, note in variants]


# ---------------------------------------------------------------------------- cache
def corpus_fingerprint(corpus: str | None) -> str:
    """A hash of the corpus's documents (names and text): a changed file is another corpus."""
    h = hashlib.sha256(b"corpus-v1")
    for d in load_corpus(corpus):
        h.update(d.name.encode() + b"\x00" + d.text.encode() + b"\x00")
    return h.hexdigest()[:16]


def run_key(cfg: TrainConfig, corpus_fp: str) -> str:
    """The cache key of a run: its config (threads aside: they change speed only) and its corpus."""
    d = cfg.to_dict()
    for k in ("threads", "extra", "keep_checkpoints", "checkpoint_every"):
        d.pop(k, None)
    d["corpus"] = corpus_fp
    blob = json.dumps({"v": _RECORD_VERSION, "config": d}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _read_record(path: Path) -> dict[str, Any] | None:
    """A finished run's record, or None when it is missing or unreadable (the run is redone)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and rec.get("version") == _RECORD_VERSION and "held_out" in rec
    return rec if ok else None


def _write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # atomic: an interrupted write leaves no half record


# ---------------------------------------------------------------------------- running
def _data_key(cfg: TrainConfig) -> str:
    e = None if cfg.engram is None else cfg.engram.to_dict()
    return json.dumps([cfg.corpus, cfg.tokenizer, cfg.bpe_vocab_size, cfg.compression, cfg.row_hash.value, e])


def _check_data(data: DataBundle, cfg: TrainConfig) -> None:
    need = cfg.seq_len + 2
    for name, stream in (("training", data.train), ("held-out", data.held_out)):
        if len(stream) < need:
            raise ValueError(
                f"--corpus {cfg.corpus or 'kjv'}: the {name} split has {len(stream)} tokens, fewer than one "
                f"window of {need}; give a larger corpus (its held-out part is the last 10 % of a single "
                "file, or every tenth file) or a smaller --size"
            )


def _train_pair(specs: list[RunSpec], cache: dict[str, DataBundle], on_step: Any) -> list[dict[str, Any]]:
    """Train `specs` (one or two runs) in lock-step and return their records."""
    trainers = []
    for spec in specs:
        key = _data_key(spec.cfg)
        if key not in cache:
            cache[key] = prepare_data(spec.cfg)
            _check_data(cache[key], spec.cfg)
        data = cache[key]
        trainers.append(Trainer(spec.cfg, data, build_model(spec.cfg, data)))
    while any(t.step < t.cfg.steps for t in trainers):
        for t in trainers:
            if t.step < t.cfg.steps:
                t.run(until=t.step + 1)
                on_step()
    records = []
    for spec, t in zip(specs, trainers, strict=True):
        c = spec.cfg
        ev = t.evaluate()
        records.append(
            {
                "version": _RECORD_VERSION,
                "variant": spec.variant,
                "seed": c.seed,
                "note": spec.note,
                "x": spec.x,
                "config": c.to_dict(),
                "held_out": ev,
                "held_out_loss": ev["loss"],
                "params": t.model.num_params(),
                "tokens_per_s": c.steps * c.batch_size * c.seq_len / t.train_seconds,
                "train_seconds": t.train_seconds,
                "history": t.history,
            }
        )
    return records


def run_study(
    study: str,
    base: TrainConfig,
    *,
    seeds: tuple[int, ...] = (0, 1, 2),
    quick: bool = False,
    out_dir: str | Path = "reports/study",
    progress: bool = True,
    command: str = "engram study",
) -> dict[str, Any]:
    """Run (or take from the cache) every run of `study` and write `<out_dir>/<study>/`: report.md,
    results.json and plots. Runs are cached in `<out_dir>/runs/`. Returns the results."""
    from tqdm.auto import tqdm

    from engram.apps.study_report import write_study_report

    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}: use one of {', '.join(STUDIES)} (or 'all')")
    if not seeds or min(seeds) < 0:
        raise ValueError(f"seeds {list(seeds)}: give one or more seeds >= 0")
    out = Path(out_dir)
    runs_dir = out / "runs"
    if base.threads:
        torch.set_num_threads(base.threads)
    t_start = time.perf_counter()
    corpus_fp = corpus_fingerprint(base.corpus)
    cache: dict[str, DataBundle] = {}
    data0 = prepare_data(base, with_engram=False)
    _check_data(data0, base)
    specs = plan_study(study, base, seeds, quick=quick, vocab=data0.vocab_size)
    keys = [run_key(s.cfg, corpus_fp) for s in specs]
    records: dict[str, dict[str, Any]] = {}
    for k in keys:
        rec = _read_record(runs_dir / f"{k}.json")
        if rec is not None:
            records[k] = rec
    pending = [(k, s) for k, s in zip(keys, specs, strict=True) if k not in records]
    pending = list(dict(pending).items())  # a run listed twice is trained once
    fresh = {k for k, _ in pending}
    bar = tqdm(
        total=sum(s.cfg.steps for _, s in pending),
        desc=f"study {study}",
        unit="step",
        disable=not progress,
        mininterval=0.5 if sys.stderr.isatty() else 10,
    )
    done_runs = len(keys) - len(pending)
    bar.set_postfix(runs=f"{done_runs}/{len(keys)}", cached=done_runs)
    for i in range(0, len(pending), 2):
        pair = pending[i : i + 2]
        for (k, _), rec in zip(
            pair, _train_pair([s for _, s in pair], cache, lambda: bar.update(1)), strict=True
        ):
            rec["key"] = k
            _write_record(runs_dir / f"{k}.json", rec)
            records[k] = rec
        done_runs += len(pair)
        bar.set_postfix(runs=f"{done_runs}/{len(keys)}")
        cache.clear()  # the next pair may need other rows; tokenization is cheap (its BPE is cached)
    bar.close()
    runs = []
    for k, s in zip(keys, specs, strict=True):
        rec = records[k]
        runs.append(
            {
                "key": k,
                "variant": s.variant,
                "seed": s.seed,
                "x": s.x,
                "note": s.note,
                "settings": _settings(s.cfg),
                "held_out_loss": rec["held_out_loss"],
                "held_out": rec["held_out"],
                "params": rec["params"],
                "tokens_per_s": rec["tokens_per_s"],
                "train_seconds": rec["train_seconds"],
                "cached": k not in fresh,
            }
        )
    results = {
        "study": study,
        "command": command,
        "corpus": base.corpus or "kjv",
        "corpus_fingerprint": corpus_fp,
        "train_tokens": len(data0.train),
        "held_out_tokens": len(data0.held_out),
        "vocab_size": data0.vocab_size,
        "seeds": list(seeds),
        "quick": quick,
        "base_config": base.to_dict(),
        "runs": runs,
        "new_runs": len(pending),
        "wall_seconds": time.perf_counter() - t_start,
    }
    write_study_report(results, out / study)
    return results


_SETTING_FIELDS = (
    "dim",
    "n_layers",
    "mlp_hidden",
    "engram_mode",
    "row_hash",
    "compression",
    "moe_experts",
    "moe_top_k",
    "moe_hidden",
    "steps",
    "batch_size",
    "seq_len",
)


def _settings(cfg: TrainConfig) -> dict[str, Any]:
    """The run's settings a reader compares: the backbone, the Engram table and the variant knobs."""
    d = cfg.to_dict()
    s = {k: d[k] for k in _SETTING_FIELDS}
    e = cfg.engram
    s["engram"] = (
        None
        if e is None
        else {
            "layers": list(e.layer_ids),
            "orders": list(e.orders),
            "heads": e.n_heads,
            "head_dim": e.head_dim,
            "base": list(e.engram_vocab_size),
            "table_rows": table_rows(e),
        }
    )
    return s
