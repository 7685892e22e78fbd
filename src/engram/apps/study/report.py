"""The report of one `engram study`: per-variant means with their seed spreads, paired differences
said in words (larger than the spread or not), the findings, `report.md`, `results.json` and a plot
(memory: loss against table rows; ablations and baselines: bars; allocation: loss against the
share of sparse parameters in experts; optimizers: loss against the table lr per optimizer, and bars
of V4.1's recipe against AdamW everywhere). Reads `run_study`'s results; trains nothing.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from engram.apps.study.plans import OPTIMIZER_NAMES

__all__ = ["compare", "run_counts", "state_bytes_per_param", "study_lines", "summarize", "write_study_report"]

TITLES = {
    "memory": "Is it memory? The table grown at constant compute",
    "ablations": "Which parts matter",
    "baselines": "Is the comparison fair? Baselines",
    "allocation": "Allocation: a fixed sparse budget split between MoE experts and the Engram table",
    "optimizers": "Table optimizers: V4.1's Sinkhorn-balanced update against Adam and Adagrad",
}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per variant (in the order of first appearance): held-out losses over seeds, their
    mean and spread (sample standard deviation; 0 for one seed), parameters, tokens/s."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    out = []
    for name, rs in by.items():
        losses = [r["held_out_loss"] for r in rs]
        out.append(
            {
                "variant": name,
                "note": rs[0]["note"],
                "x": rs[0]["x"],
                "seeds": [r["seed"] for r in rs],
                "losses": losses,
                "mean": statistics.fmean(losses),
                "spread": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "params": rs[0]["params"],
                "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs),
                "settings": rs[0].get("settings", {}),
                "table_state": [r.get("table_state") for r in rs],  # per seed (None: not recorded)
                "embedding_state": [r.get("embedding_state") for r in rs],
            }
        )
    return out


# Bytes of optimizer state per table parameter (fp32 tables, rows `dim` wide), as the optimizers
# document them; SparseSinkhorn's depends on the share of rows active (with nonzero momentum).
def state_bytes_per_param(optimizer: str, dim: int, active_fraction: float | None = None) -> float | None:
    """SparseRowAdam 4 + 8/dim, SparseRowAdagrad 4/dim, dense Adam 8, SparseSinkhorn (4 + 8/dim) times
    the active fraction (None when it is not known)."""
    if optimizer == "adam":
        return 4 + 8 / dim
    if optimizer == "adagrad":
        return 4 / dim
    if optimizer == "dense-adam":
        return 8.0
    if optimizer == "sinkhorn":
        return None if active_fraction is None else active_fraction * (4 + 8 / dim)
    raise ValueError(f"unknown table optimizer {optimizer!r}")


def _state(v: dict[str, Any], key: str = "table_state") -> tuple[float | None, float | None]:
    """(bytes of state per parameter, active fraction of the rows) of a variant, means over its seeds:
    measured where the records hold it, else the documented formula (the fraction: None)."""
    got = [st for st in v.get(key, []) if st]
    if got:
        per = statistics.fmean(st["state_bytes"] / st["params"] for st in got)
        act = [st["active_rows"] / st["rows"] for st in got if st.get("active_rows") is not None]
        return per, (statistics.fmean(act) if act else None)
    e = v.get("settings", {}).get("engram")
    opt = v.get("settings", {}).get("table_optimizer")
    if key != "table_state" or not e or opt is None:
        return None, None
    return state_bytes_per_param(opt, e["head_dim"]), None


def _fmt_state(v: dict[str, Any], key: str = "table_state") -> str:
    per, act = _state(v, key)
    if per is None:
        return "n/a"
    return f"{per:.3g}" + ("" if act is None else f" ({act:.0%} of rows active)")


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """`other` - `ref` in held-out loss, paired by seed (negative: `other` is better), against the
    larger of their two seed spreads. `clear`: every paired difference has the mean's sign and the
    mean exceeds the spread (needs two seeds or more)."""
    lo = dict(zip(ref["seeds"], ref["losses"], strict=True))
    diffs = [l2 - lo[s] for s, l2 in zip(other["seeds"], other["losses"], strict=True) if s in lo]
    mean = statistics.fmean(diffs) if diffs else other["mean"] - ref["mean"]
    spread = max(ref["spread"], other["spread"])
    n = len(diffs)
    clear = n >= 2 and abs(mean) > spread and all((d > 0) == (mean > 0) and d != 0 for d in diffs)
    if n < 2:
        words = "one seed: no spread to judge it by"
    elif clear:
        words = f"larger than the seed spread ({spread:.4f})"
    else:
        words = f"within the seed spread ({spread:.4f}): not a difference these seeds can tell"
    return {"diff": mean, "per_seed": diffs, "spread": spread, "clear": clear, "words": words}


def _fmt(v: dict[str, Any]) -> str:
    return f"{v['mean']:.4f} ± {v['spread']:.4f}"


def _reference(study: str, summary: list[dict[str, Any]], table_lr: float | None = None) -> dict[str, Any]:
    names = [v["variant"] for v in summary]
    if study == "optimizers":  # the default: SparseRowAdam at the preset's table lr
        adam = [v for v in summary if v["x"] is not None and v["settings"].get("table_optimizer") == "adam"]
        if not adam:
            return summary[0]
        return min(adam, key=lambda v: abs(v["x"] - table_lr) if table_lr is not None else v["x"])
    if study == "memory":
        return summary[names.index("baseline")]
    if study == "ablations":
        return summary[1]  # the reference Engram (plan order: baseline, reference, variants)
    if study == "baselines":
        return summary[0]  # Engram
    return max(summary, key=lambda v: v["x"] if v["x"] is not None else -1)  # allocation: all experts


def _optimizer_findings(summary: list[dict[str, Any]]) -> list[str]:
    """Each optimizer's best table lr (lowest mean held-out loss over the seeds; the same seeds pick
    it for every optimizer), the best against each other, the recipe against AdamW everywhere, state."""
    by: dict[str, list[dict[str, Any]]] = {}
    for v in summary:
        if v["x"] is not None:
            by.setdefault(v["settings"]["table_optimizer"], []).append(v)
    best = {o: min(vs, key=lambda v: v["mean"]) for o, vs in by.items()}
    out: list[str] = []
    for o, vs in by.items():
        b, xs = best[o], sorted(v["x"] for v in vs)
        edge = ""
        if len(xs) >= 3 and b["x"] in (xs[0], xs[-1]):  # (two lrs: always an edge)
            side = "lowest" if b["x"] == xs[0] else "highest"
            edge = f"; the {side} lr of the grid: the optimum may lie beyond it"
        others = ", ".join(f"{v['x']:g}: {_fmt(v)}" for v in sorted(vs, key=lambda v: v["x"]) if v is not b)
        out.append(
            f"{OPTIMIZER_NAMES[o]}: best table lr {b['x']:g} of {' / '.join(f'{x:g}' for x in xs)}, {_fmt(b)} "
            f"(others {others or 'none'}){edge}."
        )

    def versus(a: str, b: str, claim: str = "") -> None:
        if a not in best or b not in best:
            return
        c = compare(best[b], best[a])
        better = "lower" if c["diff"] < 0 else "higher"
        line = (
            f"{OPTIMIZER_NAMES[a]} (best, lr {best[a]['x']:g}) vs {OPTIMIZER_NAMES[b]} (best, lr {best[b]['x']:g}): "
            f"{c['diff']:+.4f} nats/token ({better}; per seed {', '.join(f'{d:+.4f}' for d in c['per_seed'])}); "
            f"{c['words']}"
        )
        if claim:
            verdict = (
                ("holds here" if c["diff"] < 0 else "does not hold here: it is worse")
                if c["clear"]
                else "is neither confirmed nor refuted by these seeds"
            )
            line += f". {claim} {verdict}"
        out.append(line + ".")

    versus("sinkhorn", "adam", "V4.1's claim that the Sinkhorn-balanced update outperforms Adam")
    versus("sinkhorn", "dense-adam", "Against the paper's Adam, the claim")
    versus("dense-adam", "adam")
    versus("adagrad", "adam")
    recipe = [v for v in summary if v["x"] is None and v["settings"].get("embedding_optimizer") == "sinkhorn"]
    adamw = [v for v in summary if v["x"] is None and v["settings"].get("embedding_optimizer") == "adamw"]
    if recipe and adamw:
        r, a = min(recipe, key=lambda v: v["mean"]), adamw[0]
        c = compare(a, r)
        lrs = f"table lr {r['settings']['table_lr']:g} and {a['settings']['table_lr']:g}, the grids' centres"
        if len(recipe) > 1:
            emb_lrs = " / ".join(f"{v['settings']['embedding_lr']:g}" for v in recipe)
            lrs += f"; the recipe's best embedding lr {r['settings']['embedding_lr']:g} of {emb_lrs}"
        picked = [
            o
            for o, v in (("sinkhorn", r), ("dense-adam", a))
            if o in best and best[o]["x"] != v["settings"]["table_lr"]
        ]
        if picked:
            lrs += f" (not the best lr of part 1 for {' and '.join(OPTIMIZER_NAMES[o] for o in picked)})"
        r_emb, a_emb = _state(r, "embedding_state")[0], _state(a, "embedding_state")[0]
        emb = ""
        if r_emb is not None and a_emb is not None:
            emb = f" Embedding and head optimizer state: {r_emb:.3g} against {a_emb:.3g} bytes per parameter."
        out.append(
            f"{r['variant']} vs {a['variant']} ({lrs}): {_fmt(r)} against {_fmt(a)}, {c['diff']:+.4f} nats/token; "
            f"{c['words']}.{emb}"
        )
    states = []
    for o, b in best.items():
        per, act = _state(b)
        if per is not None:
            states.append(
                f"{OPTIMIZER_NAMES[o]} {per:.3g}"
                + ("" if act is None else f" ({act:.0%} of the rows active at the end)")
            )
    if states:
        out.append(
            "Optimizer state per table parameter, measured at the end of the runs (bytes; SparseRowAdam 4 + 8/dim, "
            "row-wise Adagrad 4/dim, dense Adam 8, Sinkhorn 4 per active parameter + 8 per active row): "
            + "; ".join(states)
            + "."
        )
    return out


def findings(study: str, summary: list[dict[str, Any]], *, table_lr: float | None = None) -> list[str]:
    """What the study found, in words, whatever it is (`table_lr`: the base config's, the optimizers
    study's reference)."""
    if study == "optimizers":
        return _optimizer_findings(summary)
    ref = _reference(study, summary)
    out: list[str] = []
    if study == "memory":
        tables = sorted((v for v in summary if v["x"] is not None), key=lambda v: v["x"])
        for v in tables:
            c = compare(ref, v)
            out.append(
                f"{v['variant']} ({int(v['x']):,} rows): {_fmt(v)}, {-c['diff']:+.4f} nats/token better than "
                f"the baseline; {c['words']}."
            )
        if len(tables) >= 2:
            x = np.log2([v["x"] for v in tables])
            slope = float(np.polyfit(x, [v["mean"] for v in tables], 1)[0])
            small, large = tables[0], tables[-1]
            c = compare(small, large)
            trend = "falls" if slope < 0 else "rises"
            out.append(
                f"Across the tables the loss {trend} by {abs(slope):.4f} nats/token per doubling of the rows "
                f"(least-squares fit of the means on log2 rows); from the smallest to the largest table it "
                f"changes by {c['diff']:+.4f}, {c['words']}."
            )
            gains = [-compare(ref, v)["diff"] for v in tables]
            grows = all(b >= a for a, b in itertools.pairwise(gains))
            out.append(
                "The gain over the baseline grows with every step up in table size."
                if grows
                else "The gain over the baseline does not grow at every step up in table size."
            )
    elif study == "allocation":
        best = min(summary, key=lambda v: v["mean"])
        out.append(
            f"Lowest held-out loss with {best['x']:.0%} of the sparse budget in experts ({_fmt(best)})."
        )
        for v in summary:
            if v is not ref:
                c = compare(ref, v)
                out.append(f"{v['variant']} vs all experts (no Engram): {c['diff']:+.4f}; {c['words']}.")
        ends = [v for v in summary if v["x"] in (0.0, 1.0)]
        inner = [v for v in summary if v not in ends]
        if len(ends) == 2 and inner:
            m = min(inner, key=lambda v: v["mean"])
            both = all(compare(e, m)["clear"] and compare(e, m)["diff"] < 0 for e in ends)
            out.append(
                f"A U-curve (an interior split beating both ends by more than the spread): "
                f"{'yes' if both else 'no'}."
            )
    else:
        for v in summary:
            if v is ref:
                continue
            c = compare(ref, v)
            better = "better" if c["diff"] < 0 else "worse"
            out.append(
                f"{v['variant']}: {_fmt(v)}, {abs(c['diff']):.4f} nats/token {better} than {ref['variant']} "
                f"(per seed {', '.join(f'{d:+.4f}' for d in c['per_seed'])}); {c['words']}."
            )
    return out


def study_lines(results: dict[str, Any]) -> list[str]:
    """The table of variants (markdown) as `engram study` prints it."""
    summary = results["summary"]
    study = results["study"]
    ref = _reference(study, summary, results["base_config"].get("table_lr"))
    opt = study == "optimizers"  # one more column: the table optimizer's state
    lines = [
        f"| variant | held-out loss (mean ± spread, {len(results['seeds'])} seeds) | vs {ref['variant']} (- is lower) | "
        "total params | activated params | tokens/s | "
        + ("table optimizer state (bytes / table param) | " if opt else "")
        + "what it is |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if opt else "") + "---|",
    ]
    for v in summary:
        diff = "" if v is ref else f"{compare(ref, v)['diff']:+.4f}"
        p = v["params"]
        lines.append(
            f"| {v['variant']} | {_fmt(v)} | {diff} | {p['total']:,} | {p['activated']:,} | "
            f"{v['tokens_per_s']:,.0f} | " + (f"{_fmt_state(v)} | " if opt else "") + f"{v['note']} |"
        )
    return lines


def _variant_bars(ax: Any, variants: list[dict[str, Any]]) -> None:
    """One horizontal bar per variant: its mean, the seed spread as whiskers, each seed as a dot."""
    ys = np.arange(len(variants))
    ax.barh(
        ys,
        [v["mean"] for v in variants],
        xerr=[v["spread"] for v in variants],
        color="tab:blue",
        alpha=0.6,
        capsize=3,
    )
    for y, v in zip(ys, variants, strict=True):
        ax.scatter(v["losses"], [y] * len(v["losses"]), color="black", s=10, zorder=3)
    lo = min(min(v["losses"]) for v in variants)
    hi = max(max(v["losses"]) for v in variants)
    pad = max(0.02, (hi - lo) * 0.3)
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_yticks(ys, [v["variant"] for v in variants])
    ax.invert_yaxis()


def _plot(results: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    study, summary = results["study"], results["summary"]
    if study == "optimizers":
        return _plot_optimizers(plt, summary, out)
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    if study in ("memory", "allocation"):
        pts = sorted((v for v in summary if v["x"] is not None), key=lambda v: v["x"])
        xs = np.array([v["x"] for v in pts])
        mean = np.array([v["mean"] for v in pts])
        sd = np.array([v["spread"] for v in pts])
        ax.plot(xs, mean, marker="o", color="tab:blue", label="mean over seeds")
        ax.fill_between(xs, mean - sd, mean + sd, color="tab:blue", alpha=0.2, label="± seed spread")
        for v in pts:
            ax.scatter([v["x"]] * len(v["losses"]), v["losses"], color="tab:blue", s=10, alpha=0.6)
        if study == "memory":
            ax.set_xscale("log")
            ax.set_xlabel("Engram table rows (log scale), same compute per token")
            base = next((v for v in summary if v["variant"] == "baseline"), None)
            if base is not None:
                ax.axhline(base["mean"], color="tab:gray", label="baseline (no Engram)")
                ax.axhspan(
                    base["mean"] - base["spread"], base["mean"] + base["spread"], color="tab:gray", alpha=0.2
                )
        else:
            ax.set_xlabel("share of the sparse parameter budget in MoE experts (rest: Engram table)")
    else:
        _variant_bars(ax, summary)
        ax.set_xlabel("held-out loss (nats/token); bars: mean, whiskers: seed spread, dots: seeds")
    if study in ("memory", "allocation"):
        ax.set_ylabel("held-out loss (nats/token)")
        ax.legend(fontsize=8)
    ax.set_title(TITLES[study], fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    name = f"{study}.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def _plot_optimizers(plt: Any, summary: list[dict[str, Any]], out: Path) -> str:
    """Left: held-out loss against the table lr (log), a line and seed band per optimizer; right: bars
    of the runs at fixed lrs (V4.1's recipe, AdamW everywhere)."""
    from matplotlib.ticker import NullLocator

    fixed = [v for v in summary if v["x"] is None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), width_ratios=(3, 2) if fixed else (1, 0.01))
    ax = axes[0]
    by: dict[str, list[dict[str, Any]]] = {}
    for v in summary:
        if v["x"] is not None:
            by.setdefault(v["settings"]["table_optimizer"], []).append(v)
    for (o, vs), color in zip(
        by.items(), ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange"), strict=False
    ):
        vs = sorted(vs, key=lambda v: v["x"])
        xs, mean = np.array([v["x"] for v in vs]), np.array([v["mean"] for v in vs])
        sd = np.array([v["spread"] for v in vs])
        ax.plot(xs, mean, marker="o", color=color, label=OPTIMIZER_NAMES[o])
        ax.fill_between(xs, mean - sd, mean + sd, color=color, alpha=0.15)
        for v in vs:
            ax.scatter([v["x"]] * len(v["losses"]), v["losses"], color=color, s=8, alpha=0.5)
    ax.set_xscale("log")
    ticks = sorted({v["x"] for vs in by.values() for v in vs})
    ax.xaxis.set_minor_locator(NullLocator())  # the lrs themselves as ticks, plainly written
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("table learning rate (log scale)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("each table optimizer at its table lrs (band: seed spread)", fontsize=9)
    if fixed:
        bx = axes[1]
        _variant_bars(bx, fixed)
        bx.set_xlabel("held-out loss (nats/token)")
        bx.grid(alpha=0.3)
        bx.set_title("V4.1's recipe against AdamW everywhere", fontsize=9)
    else:
        axes[1].axis("off")
    fig.suptitle(TITLES["optimizers"], fontsize=10)
    fig.tight_layout()
    name = "optimizers.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def run_counts(results: dict[str, Any]) -> str:
    """How many runs were trained, how many came from the cache, how many variants share a run."""
    runs = results["runs"]
    cached = len({r["key"] for r in runs if r["cached"]})
    shared = len(runs) - len({r["key"] for r in runs})
    words = f"{results['new_runs']} runs trained, {cached} from the cache"
    return words + (f", {shared} shared by two variants" if shared else "")


def write_study_report(results: dict[str, Any], out: str | Path) -> None:
    """Add the summary and findings to `results`, and write results.json, the plot and report.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results["runs"])
    results["summary"] = summary
    results["findings"] = findings(results["study"], summary, table_lr=results["base_config"].get("table_lr"))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot = _plot(results, out)
    b = results["base_config"]
    e = b["engram"]
    lines = [
        f"# Study: {TITLES[results['study']]}",
        "",
        f"Corpus: {results['corpus']} (train {results['train_tokens']:,} tokens, held out "
        f"{results['held_out_tokens']:,}); tokenizer {b['tokenizer']} ({results['vocab_size']} ids).",
        f"Each run: {b['steps']} steps x {b['batch_size']} x {b['seq_len']} tokens; backbone {b['n_layers']} "
        f"layers of {b['dim']}; Engram at layers {e['layer_ids']}, {e['n_heads']} heads of {e['head_dim']} per "
        f"order, orders 2-{e['max_ngram_size']} unless the variant says otherwise. Seeds {results['seeds']}; runs "
        "trained two at a time in lock-step.",
        "Every loss is the final evaluation on all held-out tokens; ± is the sample standard deviation "
        "over seeds, and a difference is paired by seed.",
        "",
        *study_lines(results),
        "",
        "## What was found",
        "",
        *[f"- {f}" for f in results["findings"]],
        "",
        f"![{results['study']}]({plot})",
        "",
        f"Reproduce: `{results['command']}` ({run_counts(results)} this time; "
        f"{results['wall_seconds'] / 60:.1f} minutes).",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
