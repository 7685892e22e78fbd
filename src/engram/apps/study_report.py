"""The report of one `engram study`: per-variant means with their seed spreads, paired differences
said in words (larger than the spread or not), the findings, `report.md`, `results.json` and a plot
(memory: loss against table rows; ablations and baselines: bars; allocation: loss against the
share of sparse parameters in experts). Reads `run_study`'s results; trains nothing.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["compare", "study_lines", "summarize", "write_study_report"]

TITLES = {
    "memory": "Is it memory? The table grown at constant compute",
    "ablations": "Which parts matter",
    "baselines": "Is the comparison fair? Baselines",
    "allocation": "Allocation: a fixed sparse budget split between MoE experts and the Engram table",
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
            }
        )
    return out


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


def _reference(study: str, summary: list[dict[str, Any]]) -> dict[str, Any]:
    names = [v["variant"] for v in summary]
    if study == "memory":
        return summary[names.index("baseline")]
    if study == "ablations":
        return summary[1]  # the reference Engram (plan order: baseline, reference, variants)
    if study == "baselines":
        return summary[0]  # Engram
    return max(summary, key=lambda v: v["x"] if v["x"] is not None else -1)  # allocation: all experts


def findings(study: str, summary: list[dict[str, Any]]) -> list[str]:
    """What the study found, in words, whatever it is."""
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
    ref = _reference(results["study"], summary)
    lines = [
        f"| variant | held-out loss (mean ± spread, {len(results['seeds'])} seeds) | vs {ref['variant']} (- is lower) | "
        "total params | activated params | tokens/s | what it is |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for v in summary:
        diff = "" if v is ref else f"{compare(ref, v)['diff']:+.4f}"
        p = v["params"]
        lines.append(
            f"| {v['variant']} | {_fmt(v)} | {diff} | {p['total']:,} | {p['activated']:,} | "
            f"{v['tokens_per_s']:,.0f} | {v['note']} |"
        )
    return lines


def _plot(results: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    study, summary = results["study"], results["summary"]
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
        names = [v["variant"] for v in summary]
        ys = np.arange(len(summary))
        ax.barh(
            ys,
            [v["mean"] for v in summary],
            xerr=[v["spread"] for v in summary],
            color="tab:blue",
            alpha=0.6,
            capsize=3,
        )
        for y, v in zip(ys, summary, strict=True):
            ax.scatter(v["losses"], [y] * len(v["losses"]), color="black", s=10, zorder=3)
        lo = min(min(v["losses"]) for v in summary)
        hi = max(max(v["losses"]) for v in summary)
        pad = max(0.02, (hi - lo) * 0.3)
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_yticks(ys, names)
        ax.invert_yaxis()
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


def write_study_report(results: dict[str, Any], out: str | Path) -> None:
    """Add the summary and findings to `results`, and write results.json, the plot and report.md."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results["runs"])
    results["summary"] = summary
    results["findings"] = findings(results["study"], summary)
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
        f"Reproduce: `{results['command']}` ({results['new_runs']} runs trained this time, "
        f"{len(results['runs']) - results['new_runs']} from the cache; {results['wall_seconds'] / 60:.1f} minutes).",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
