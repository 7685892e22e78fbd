"""The studies' runs (`engram study`): which training configs each study compares.

`study_base` is the studies' training config (a preset, shortened with --quick); `plan_study(name,
base, seeds)` lists a study's runs as `RunSpec`s (a variant name, its TrainConfig with the seed, the
value a plot puts it at). memory: the table grown at constant compute; ablations: gate, compression,
orders, heads, capacity 1, rows that ignore the n-gram (every variant at about the reference's total
rows); baselines: same FLOPs, same total parameters on a wider or deeper dense backbone, a hashed
n-gram input embedding; allocation: a fixed sparse budget split between MoE experts and the table;
optimizers: the table optimizers (V4.1's Sinkhorn, SparseRowAdam, the paper's dense Adam, row-wise
Adagrad), each at three table learning rates, and V4.1's recipe against AdamW everywhere.
Plain configs only: trains nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engram.addressing.layout import Layout
from engram.apps.lm.train_config import (
    TRAIN_PRESETS,
    EmbeddingOptimizer,
    RowHash,
    TableOptimizer,
    TrainConfig,
)
from engram.config import EngramConfig

__all__ = [
    "STUDIES",
    "RunSpec",
    "optimizer_lrs",
    "plan_study",
    "study_base",
    "table_rows",
]

STUDIES = ("memory", "ablations", "baselines", "allocation", "optimizers")

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
# The optimizers study: each table optimizer's grid centre as a multiple of the preset's table_lr
# (SparseRowAdam's default), and three learning rates a factor OPTIMIZER_LR_STEP apart around it
# (--quick: the centre and the step below). Update sizes: SparseRowAdam moves a looked-up row by up to
# lr per element; Sinkhorn moves every active row (looked up in the last ~100 steps) by 0.18 lr per
# element (RMS) each step; the paper's dense Adam keeps moving a row after its lookup while its
# momentum decays; Adagrad's steps shrink as 1 / sqrt(lookups). Centres from a pilot (tiny preset, 150
# steps, one seed, lrs a factor 2 apart), then moved where the demo preset's first seed put the best
# lr on a grid's edge (at 2x the default, SparseRowAdam's and Sinkhorn's best was their highest lr):
# 4x for Sinkhorn and SparseRowAdam, 8x for Adagrad; dense Adam's best in the full run at 4x was its
# lowest lr (2x), so its grid is centred there (the runs at 1x added, the others the same).
OPTIMIZER_LR_CENTRES = {
    TableOptimizer.SINKHORN: 4.0,
    TableOptimizer.ADAM: 4.0,
    TableOptimizer.DENSE_ADAM: 2.0,
    TableOptimizer.ADAGRAD: 8.0,
}
OPTIMIZER_LR_STEP = 2.0
# V4.1's recipe's token embedding and LM head on the Sinkhorn update: its lr as multiples of the
# preset's dense lr (AdamW's). A pilot (tiny preset, 150 steps, one seed, tied embedding, table on
# Sinkhorn at 0.1) gave held-out 4.814 / 3.932 / 3.826 / 3.866 / 3.941 at 1 / 4 / 8 / 16 / 32 x lr,
# against 4.362 with the embedding on AdamW at lr: at lr itself the recipe is far behind. On the demo
# preset (first seed) 16x beat 8x, hence 8 / 16 / 32.
RECIPE_EMBEDDING_LR_FACTORS = (8.0, 16.0, 32.0)
QUICK_RECIPE_EMBEDDING_LR_FACTORS = (8.0,)
OPTIMIZER_NAMES = {
    TableOptimizer.SINKHORN: "Sinkhorn",
    TableOptimizer.ADAM: "SparseRowAdam",
    TableOptimizer.DENSE_ADAM: "dense Adam",
    TableOptimizer.ADAGRAD: "row-wise Adagrad",
}
OPTIMIZER_NOTES = {
    TableOptimizer.SINKHORN: "SparseSinkhorn, V4.1's Sinkhorn-balanced update (one momentum per active row)",
    TableOptimizer.ADAM: "SparseRowAdam, lazy per-row Adam (the default)",
    TableOptimizer.DENSE_ADAM: "the paper's Adam over the whole table (two states per parameter)",
    TableOptimizer.ADAGRAD: "SparseRowAdagrad, one accumulator per row",
}


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


def optimizer_lrs(base: TrainConfig, opt: TableOptimizer, quick: bool = False) -> tuple[float, ...]:
    """The table learning rates of `opt` in the optimizers study, rounded to 3 significant digits."""
    centre = base.table_lr * OPTIMIZER_LR_CENTRES[opt]
    steps = (-1, 0) if quick else (-1, 0, 1)
    return tuple(float(f"{centre * OPTIMIZER_LR_STEP**k:.3g}") for k in steps)


def _plan_optimizers(base: TrainConfig, quick: bool) -> list[tuple[str, TrainConfig, float | None, str]]:
    """Part 1: each table optimizer at its learning rates (x: the table lr), the embedding on AdamW.
    Part 2 (x None), the tables at the grid centres: V4.1's recipe (Sinkhorn for the table, the token
    embedding and the LM head, the latter at three lrs) against AdamW everywhere (the dense Adam
    table: the same runs as part 1's)."""
    ref = base.replace(engram=_engram(base), embedding_optimizer=EmbeddingOptimizer.ADAMW, embedding_lr=None)
    out: list[tuple[str, TrainConfig, float | None, str]] = []
    for opt in OPTIMIZER_LR_CENTRES:
        for lr in optimizer_lrs(base, opt, quick):
            cfg = ref.replace(table_optimizer=opt, table_lr=lr)
            out.append((f"{OPTIMIZER_NAMES[opt]}, table lr {lr:g}", cfg, lr, OPTIMIZER_NOTES[opt]))
    sink = optimizer_lrs(base, TableOptimizer.SINKHORN)[1]
    dense = optimizer_lrs(base, TableOptimizer.DENSE_ADAM)[1]
    for factor in QUICK_RECIPE_EMBEDDING_LR_FACTORS if quick else RECIPE_EMBEDDING_LR_FACTORS:
        emb_lr = float(f"{base.lr * factor:.3g}")
        v41 = ref.replace(
            table_optimizer=TableOptimizer.SINKHORN,
            table_lr=sink,
            embedding_optimizer=EmbeddingOptimizer.SINKHORN,
            embedding_lr=emb_lr,
        )
        out.append(
            (
                f"V4.1 recipe, embedding lr {emb_lr:g}",
                v41,
                None,
                f"Sinkhorn for the table (lr {sink:g}), the token embedding and the LM head (lr {emb_lr:g}, "
                f"{factor:g}x the dense lr); AdamW for the rest",
            )
        )
    adamw = ref.replace(table_optimizer=TableOptimizer.DENSE_ADAM, table_lr=dense)
    out.append(
        (
            "AdamW everywhere",
            adamw,
            None,
            f"dense Adam for the table (lr {dense:g}), AdamW for the rest: the runs of "
            f"'{OPTIMIZER_NAMES[TableOptimizer.DENSE_ADAM]}, table lr {dense:g}'",
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
        "optimizers": lambda: _plan_optimizers(base, quick),
    }
    variants = plans[study]()
    return [RunSpec(name, cfg.replace(seed=s), x, note) for s in seeds for name, cfg, x, note in variants]
