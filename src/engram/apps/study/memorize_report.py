"""The report of `engram study memorize` (engram.apps.study.memorize): each model's table of arms by
facts size (mean ± seed spread), the patches' locality, where patches lose and win (read from the
numbers: a baseline better than the patch by more than the larger seed spread), the pilot, a plot,
a README row, `report.md` and `results.json`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from engram.apps.study.memorize_arms import PATCH_ARMS, READER_ARMS
from engram.apps.study.pretrained_report import write_atomic

__all__ = ["ARM_NOTES", "METRICS", "findings", "readme_row", "summarize", "table_lines", "write_report"]

# (key, label, higher is better, format)
METRICS: tuple[tuple[str, str, bool, str], ...] = (
    ("direct_recall", "direct recall", True, ".3f"),
    ("direct_logprob", "target log-prob", True, ".2f"),
    ("paraphrase_recall", "paraphrase recall", True, ".3f"),
    ("indirect_recall", "indirect acc.", True, ".3f"),
    ("neighbour_change", "neighbours changed", False, ".3f"),
    ("held_out_delta", "Δ held-out loss", False, "+.4f"),
    ("bytes_per_fact", "bytes / fact", False, ",.0f"),
    ("train_seconds", "train s", False, ".1f"),
)
LOCALITY = (
    "own_delta",  # the patch's own change of the held-out loss (against the model it was written for)
    "rows",
    "hits_per_1000",
    "hit_abs_change",
    "hit_change",
    "later_abs_change",
    "before_first_hit",
    "bit_equal",
)
ARM_NOTES = {
    "none": "the model as it is (the reference: no fact written)",
    "patch": "`engram.memory.memorize` with its default settings: the facts' Engram rows only",
    "reader-patch": "the same, through Engram readers trained once (`engram.memory.train_reader`) on other "
    "facts and the training text; its held-out loss change and neighbours include the readers' own",
    "reader-patch-ref": "reader-patch leaving out every row the training text's first tokens read "
    "(`memorize(reference=...)`), so that common text reads fewer of the patch's rows",
    "lora-r1": "LoRA of rank 1 on the decoder layers' linear layers, Engram and the rest frozen",
    "lora-r8": "LoRA of rank 8, the same",
    "last-layer": "every weight of the last decoder layer trained, the rest frozen",
    "in-prompt": "no training: the fact as a sentence, then a space, before every question",
}
_BASELINES = ("lora-r1", "lora-r8", "last-layer", "in-prompt")


def _ms(xs: list[float | None]) -> dict[str, float | None]:
    v = [x for x in xs if x is not None]
    if not v:
        return {"mean": None, "spread": None}
    # one seed: no spread (None), shown as the mean alone and counted as 0 in comparisons
    return {"mean": statistics.fmean(v), "spread": statistics.stdev(v) if len(v) > 1 else None}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """{"summary": one entry per (model, facts, arm): every metric's mean and seed spread (and the
    patch's locality, the lrs, in-prompt's context tokens), "findings": where patches lose and win}."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in results["runs"]:
        groups.setdefault((r["model"], r["n"], r["arm"]), []).append(r)
    summary = []
    for m in results["models"]:
        for n in results["plan"]["facts"]:
            for arm in results["arms"]:
                recs = groups.get((m["key"], n, arm), [])
                if not recs:
                    continue
                s: dict[str, Any] = {
                    "model": m["key"],
                    "n": n,
                    "arm": arm,
                    "seeds": [r["seed"] for r in recs],
                }
                s["lrs"] = sorted({r["lr"] for r in recs if r.get("lr") is not None})
                for key, *_ in METRICS:
                    s[key] = _ms([r["metrics"][key] for r in recs])
                if arm in PATCH_ARMS:
                    s["locality"] = {k: _ms([_loc(r, k) for r in recs]) for k in LOCALITY}
                    s["locality"]["before_first_hit_total"] = sum(
                        r["locality"]["before_first_hit"] for r in recs
                    )
                    s["locality"]["bit_equal_total"] = sum(r["locality"]["bit_equal"] for r in recs)
                if arm == "in-prompt":
                    s["context_tokens"] = _ms([r.get("context_tokens") for r in recs])
                summary.append(s)
    out = {"summary": summary}
    out["findings"] = findings({**results, **out})
    return out


def _loc(r: dict[str, Any], key: str) -> float | None:
    """A patch run's locality number; `own_delta`: its held-out loss change against the model it was
    written for (the reader model, for reader-patch), which `held_out_delta` measures from the model
    as it was."""
    loc = r["locality"]
    return loc["held_out_loss"] - loc["base_loss"] if key == "own_delta" else loc[key]


def _v(x: dict[str, float | None], fmt: str) -> str:
    return "-" if x["mean"] is None else format(x["mean"], fmt)


def _vs(x: dict[str, float | None], fmt: str) -> str:
    if x["mean"] is None:
        return "-"
    if x["spread"] is None:
        return format(x["mean"], fmt)
    return f"{format(x['mean'], fmt)} ± {format(x['spread'], fmt.lstrip('+'))}"


def _name(results: dict[str, Any], key: str) -> str:
    return next(m["name"] for m in results["models"] if m["key"] == key)


def _compare(p: dict[str, Any], b: dict[str, Any], key: str, higher: bool) -> float | None:
    """How much better `b` is than `p` on `key` beyond the larger seed spread (None: not beyond it)."""
    pm, bm = p[key], b[key]
    if pm["mean"] is None or bm["mean"] is None:
        return None
    diff = (bm["mean"] - pm["mean"]) if higher else (pm["mean"] - bm["mean"])
    margin = max(pm["spread"] or 0.0, bm["spread"] or 0.0)
    fmt = next(f for k, _, _, f in METRICS if k == key)
    shown = format(bm["mean"], fmt) != format(pm["mean"], fmt)  # a difference the tables show
    return diff if diff > margin and diff > 0 and shown else None


def findings(results: dict[str, Any]) -> dict[str, list[str]]:
    """{"lose": ..., "win": ..., "notes": ...}: for each model and facts size, each baseline that beats
    the patch (or that the patch beats) on a metric by more than the larger seed spread, with both
    means; the locality check; the pilot's choices on a grid's edge."""
    by = {(s["model"], s["n"], s["arm"]): s for s in results["summary"]}
    lose, win, notes = [], [], []
    one_seed = len(results["seeds"]) < 2
    if one_seed:
        notes.append("One seed: no spread, so any difference counts below; run --seeds 3 for a result.")
    for m in results["models"]:
        for n, patch in ((n, a) for n in results["plan"]["facts"] for a in PATCH_ARMS):
            p = by.get((m["key"], n, patch))
            if p is None:
                continue
            lost, won = [], []
            for arm in _BASELINES:
                b = by.get((m["key"], n, arm))
                if b is None:
                    continue
                ls, ws = [], []
                for key, label, higher, fmt in METRICS:
                    if _compare(p, b, key, higher) is not None:
                        ls.append(f"{label} ({_v(b[key], fmt)} vs {_v(p[key], fmt)})")
                    elif _compare(b, p, key, higher) is not None:
                        ws.append(f"{label} ({_v(p[key], fmt)} vs {_v(b[key], fmt)})")
                if ls:
                    lost.append(f"{arm} on {', '.join(ls)}")
                if ws:
                    won.append(f"{arm} on {', '.join(ws)}")
            where = f"{m['name']}, {n} facts, {patch}"
            if not one_seed and p["direct_recall"]["spread"] is None:
                notes.append(f"{where}: one seed at this size, so any difference counts there.")
            lose.append(
                f"{where}: the patch loses to {'; to '.join(lost)}."
                if lost
                else f"{where}: no baseline beats the patch by more than the seed spread."
            )
            if won:
                win.append(f"{where}: the patch beats {'; '.join(won)}.")
            loc = p["locality"]
            before, equal = loc["before_first_hit_total"], loc["bit_equal_total"]
            notes.append(
                f"{where}: {before:,} held-out positions before a block's first patched row, "
                + (
                    "every one bit-equal."
                    if before == equal
                    else f"only {equal:,} bit-equal: a patch is NOT local here."
                )
            )
    for r in results["pilot"]:
        if r["edge"]:
            notes.append(
                f"{_name(results, r['model'])}: the pilot chose lr {r['lr']:g} for {r['arm']} at {r['n']} facts, an "
                "edge of its grid: the best lr may lie beyond it."
            )
    return {"lose": lose, "win": win, "notes": notes}


def table_lines(results: dict[str, Any], key: str) -> list[str]:
    """The markdown table of one model's arms by facts size (mean ± seed spread)."""
    lines = [
        "| facts | arm | lr | " + " | ".join(label for _, label, *_ in METRICS) + " |",
        "|---|---|---|" + "---|" * len(METRICS),
    ]
    for s in results["summary"]:
        if s["model"] != key:
            continue
        lr = ", ".join(f"{x:g}" for x in s["lrs"]) or "-"
        cells = " | ".join(_vs(s[k], fmt) for k, _, _, fmt in METRICS)
        lines.append(f"| {s['n']:,} | {s['arm']} | {lr} | {cells} |")
    return lines


def _locality_lines(results: dict[str, Any], key: str) -> list[str]:
    lines = [
        "| facts, arm | Δ held-out loss, the patch's own | rows written | held-out positions reading one, per 1,000 | "
        "mean abs. Δ loss there | mean Δ loss there | mean abs. Δ loss after the first, elsewhere | positions "
        "before the first (all seeds) | bit-equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summary"]:
        if s["model"] == key and s["arm"] in PATCH_ARMS:
            loc = s["locality"]
            lines.append(
                f"| {s['n']:,} {s['arm']} | {_vs(loc['own_delta'], '+.4f')} | {_vs(loc['rows'], ',.0f')} | {_vs(loc['hits_per_1000'], '.1f')} | "
                f"{_vs(loc['hit_abs_change'], '.4f')} | {_vs(loc['hit_change'], '+.4f')} | "
                f"{_vs(loc['later_abs_change'], '.5f')} | {loc['before_first_hit_total']:,} | {loc['bit_equal_total']:,} |"
            )
    return lines


def _reader_lines(results: dict[str, Any], m: dict[str, Any]) -> list[str]:
    """The reader-patch arm's readers (trained once a model): what they trained on and what they cost."""
    rd = next(
        (
            r["reader"]
            for r in results["runs"]
            if r["model"] == m["key"] and r["arm"] in READER_ARMS and "reader" in r
        ),
        None,
    )
    if rd is None:
        return []
    text = (
        f", text loss {rd['text_losses'][0]:.3f} -> {rd['text_losses'][-1]:.3f}" if rd["text_losses"] else ""
    )
    return [
        "### The readers (reader-patch, reader-patch-ref)",
        "",
        f"Trained once on {rd['facts']:,} facts of their own (other subjects than any written fact), "
        f"{len(rd['losses'])} passes, {rd['seconds']:.0f} s, and used by every seed and size; their facts' loss "
        f"{rd['losses'][0]:.3f} -> {rd['losses'][-1]:.3f}{text}; held-out loss with the readers "
        f"{rd['held_out_loss']:.4f} ({rd['held_out_loss'] - m['base_held_out_loss']:+.4f} against the model as it "
        "was).",
        "",
    ]


def readme_row(results: dict[str, Any]) -> str:
    """One README results row from the numbers: the largest facts size of each model."""
    n = max(results["plan"]["facts"])
    by = {(s["model"], s["n"], s["arm"]): s for s in results["summary"]}
    parts = []
    for m in results["models"]:
        p = by.get((m["key"], n, "patch"))
        if p is None:
            continue
        arms = [a for a in (*PATCH_ARMS, *_BASELINES) if (m["key"], n, a) in by]

        def row(key: str, fmt: str, m: dict[str, Any] = m, arms: list[str] = arms) -> str:
            return ", ".join(f"{a} {_vs(by[m['key'], n, a][key], fmt)}" for a in arms)

        loc = p["locality"]
        parts.append(
            f"{m['name']}: direct recall {row('direct_recall', '.2f')}; paraphrase recall "
            f"{row('paraphrase_recall', '.2f')}; held-out loss change {row('held_out_delta', '+.4f')}; "
            f"bytes a fact {row('bytes_per_fact', ',.0f')}; the patch's rows read at "
            f"{_v(loc['hits_per_1000'], '.1f')} held-out positions per 1,000, the "
            f"{loc['before_first_hit_total']:,} positions before each block's first "
            f"{'all bit-equal' if loc['before_first_hit_total'] == loc['bit_equal_total'] else 'NOT all bit-equal'}"
        )
    what = (
        f"memory patches (`engram.memory`) against LoRA r1 / r8, the last layer and the fact in the prompt: "
        f"{n:,} of the shipped facts, seeds {results['seeds']}, {results['plan']['steps']} passes"
    )
    return f"| {what} | {'. '.join(parts)} | `{results['command']}` |"


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("direct_recall", "direct recall"), ("paraphrase_recall", "paraphrase recall"),
              ("held_out_delta", "held-out loss change (nats/token)"))  # fmt: skip
    models = results["models"]
    fig, axes = plt.subplots(len(models), len(panels), figsize=(12, 3.2 * len(models)), squeeze=False)
    for row, m in zip(axes, models, strict=True):
        for ax, (key, title) in zip(row, panels, strict=True):
            for arm in results["arms"]:
                pts = [s for s in results["summary"] if s["model"] == m["key"] and s["arm"] == arm]
                if not pts or pts[0][key]["mean"] is None:
                    continue
                ax.errorbar(
                    [s["n"] for s in pts],
                    [s[key]["mean"] for s in pts],
                    yerr=[s[key]["spread"] or 0.0 for s in pts],
                    marker="o",
                    capsize=3,
                    label=arm,
                    linestyle="--" if arm in ("none", "in-prompt") else "-",
                )
            ax.set_xscale("log")
            sizes = results["plan"]["facts"]
            ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
            ax.minorticks_off()
            ax.set_xlabel("facts written")
            ax.set_title(f"{m['name']}: {title}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    p = results["plan"]
    f = results["findings"]
    write_atomic(out / "results.json", json.dumps(results, indent=1))
    _plot(results, out / "memorize.png")
    lines = [
        "# Memory patches against LoRA, a last-layer fine-tune and the fact in the prompt",
        "",
        f"`{results['command']}`" + (" (--quick: a smoke test, not a result)" if results["quick"] else ""),
        "",
        f"- Facts: {', '.join(f'{n:,}' for n in p['facts'])} of the {results['facts_total']:,} in "
        f"`{results['facts_file']}` (invented people: no model knows them before); seed s's n facts are the "
        f"first n of a permutation drawn with s. Seeds {results['seeds']}.",
        f"- Every trained arm: {p['steps']} passes over the facts in batches of {p['batch_size']} (the same "
        "batches in the same order), Adam, loss on the target tokens only; the patch at lr "
        f"{p['patch_lr']:g} (memorize's default); LoRA (alpha 2r) and the last layer at the lr their pilot "
        "chose (seed 0's runs at each lr of its grid, the lowest final training loss kept; sizes above the "
        "largest piloted one take its lr)."
        + (
            " reader-patch-ref's reference: the training text's first "
            + ", ".join(f"{m['reference_tokens']:,} tokens ({m['name']})" for m in results["models"])
            + "."
            if "reader-patch-ref" in results["arms"]
            else ""
        ),
        "- Direct recall: greedy decoding after the fact's prompt gives its whole target (checked "
        "teacher-forced); target log-prob: nats, summed over the target's tokens; paraphrase recall: both "
        "paraphrases; indirect acc.: the indirect question's answer (the fact combined with what the model "
        f"knows); neighbours changed: the share of the 2 neighbour prompts a fact whose next "
        f"{p['neighbour_tokens']} greedy tokens differ from the untrained model's (in-prompt: with the fact "
        "before them); Δ held-out loss: on "
        f"unrelated text (the held-out books of {results['corpus']}), against the untrained model; bytes / "
        "fact: the patch file, LoRA's adapter tensors, the last layer's tensors (float32), the in-prompt "
        "sentence's UTF-8 bytes (paid again in context at every question).",
        "",
        "Arms: " + "; ".join(f"**{a}**: {ARM_NOTES[a]}" for a in results["arms"]) + ".",
        "",
    ]
    for s in results["skipped"]:
        lines.append(f"- Not measured: {s}.")
    for m in results["models"]:
        lines += [
            f"## {m['name']}",
            "",
            f"`{m['source']}`: {m['how']}. {m['params']:,} parameters; Engram at layers {m['engram_layers']}, "
            f"{', '.join(f'{int(v):,}' for v in m['table_rows'].values())} rows of {m['row_dim']} a layer. "
            f"Held-out: {m['held_out_tokens']:,} tokens in blocks of {m['block_len']}; the untrained model's "
            f"loss {m['base_held_out_loss']:.4f} nats/token.",
            "",
            *table_lines(results, m["key"]),
            "",
            "Mean ± the seed spread (standard deviation); a value without one is a single seed's.",
            "",
            "### Locality of the patches",
            "",
            "Positions of the held-out blocks whose n-grams read a row the patch writes, the loss change there "
            "and at the positions after a block's first such position that read none (attention carries the "
            "change); before it, the logits must be bit-equal to the same model without the patch (the reader "
            "arms: the model with its trained readers).",
            "",
            *_locality_lines(results, m["key"]),
            "",
            *_reader_lines(results, m),
        ]
    lines += ["## Where patches lose", "", *[f"- {x}" for x in f["lose"]], ""]
    lines += [
        "## Where patches win",
        "",
        *([f"- {x}" for x in f["win"]] or ["- nowhere beyond the seed spread"]),
        "",
    ]
    lines += ["## Notes", "", *[f"- {x}" for x in f["notes"]], ""]
    if results["pilot"]:
        lines += [
            "## Pilot (seed 0: final training loss)",
            "",
            "| model | arm | facts | lr | final loss |",
            "|---|---|---|---|---|",
        ]
        for r in results["pilot"]:
            loss = "diverged" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
            lines.append(
                f"| {_name(results, r['model'])} | {r['arm']} | {r['n']:,} | {r['lr']:g} | {loss}"
                + (" (chosen)" if r["chosen"] else "")
                + " |"
            )
        lines.append("")
    lines += [
        "![recall and held-out loss by facts written](memorize.png)",
        "",
        "## README row",
        "",
        readme_row(results),
        "",
        f"{results['new_runs']} run(s) new ({results['new_pilot_runs']} of them the pilot's), the rest from `runs/`; "
        f"{results['wall_seconds']:.0f} s.",
        "",
    ]
    write_atomic(out / "report.md", "\n".join(lines))
