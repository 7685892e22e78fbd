"""The report of `engram study pretrained` (engram.apps.study.pretrained): the arms' table (mean ±
seed spread), the claims judged against the seed spread (`engram.apps.study.report.compare`), the
pilot, `report.md`, `results.json` and a plot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["findings", "read_record", "table_lines", "write_atomic", "write_report"]


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_record(path: Path, version: int) -> dict[str, Any] | None:
    """A cached run's JSON record written at `version`, or None (missing, unreadable, another version:
    the run is done again)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("version") == version else None


def findings(summary: list[dict[str, Any]]) -> list[str]:
    """The claims, each judged against the seed spread (engram.apps.study.report.compare)."""
    from engram.apps.study.report import compare

    by = {s["variant"]: s for s in summary}
    out = []
    for ref, other, what in (
        ("LoRA", "LoRA + Engram", "Adding Engram to LoRA"),
        ("LoRA", "Engram", "Engram alone instead of LoRA"),
        ("no training", "Engram", "Engram alone against no training"),
        ("no training", "LoRA", "LoRA against no training"),
    ):
        if ref in by and other in by:
            c = compare(by[ref], by[other])
            out.append(
                f"{what}: held-out loss {c['diff']:+.4f} nats/token ({other} - {ref}, paired by seed), "
                f"{c['words']}."
            )
    return out


def _f(v: dict[str, float | None], pct: bool = False) -> str:
    if v["mean"] is None:
        return "-"
    if pct:
        return f"{100 * v['mean']:.1f} ± {100 * (v['spread'] or 0):.1f} %"
    return f"{v['mean']:.4f} ± {v['spread']:.4f}"


def table_lines(results: dict[str, Any]) -> list[str]:
    """The markdown table of the arms (mean ± seed spread)."""
    n = len(results["seeds"])
    lines = [
        f"| arm | held-out loss ({n} seeds) | next-token acc. | memory acc. | generalisation acc. | cloze "
        "| s/token vs LoRA | trained params | added params | added bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summary"]:
        cost = "-" if s["cost_vs_lora"] is None else f"{s['cost_vs_lora']:.2f}x"
        lines.append(
            f"| {s['variant']} | {_f({'mean': s['mean'], 'spread': s['spread']})} | {_f(s['accuracy'], True)} | "
            f"{_f(s['memory'], True)} | {_f(s['generalisation'], True)} | {_f(s['cloze'], True)} | {cost} | "
            f"{s['trained_params']:,} | {s['added_params']:,} | {s['added_bytes']:,} |"
        )
    return lines


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    names = [s["variant"] for s in summary]
    fig, axes = plt.subplots(1, 3, figsize=(12, 0.5 * len(names) + 1.6), sharey=True)
    panels = (
        ("held-out loss (nats/token)", [s["mean"] for s in summary], [s["spread"] for s in summary]),
        ("memory / generalisation acc.", [s["memory"]["mean"] for s in summary], None),
        ("cloze accuracy", [s["cloze"]["mean"] for s in summary], [s["cloze"]["spread"] for s in summary]),
    )
    ys = list(range(len(names)))
    for ax, (title, vals, err) in zip(axes, panels, strict=True):
        vals = [0.0 if v is None else v for v in vals]
        if err is None:
            gen = [
                0.0 if s["generalisation"]["mean"] is None else s["generalisation"]["mean"] for s in summary
            ]
            ax.barh([y - 0.2 for y in ys], vals, height=0.4, color="tab:orange", label="memory")
            ax.barh([y + 0.2 for y in ys], gen, height=0.4, color="tab:green", label="generalisation")
            ax.legend(fontsize=7)
        else:
            ax.barh(
                ys, vals, xerr=[0.0 if e is None else e for e in err], color="tab:blue", alpha=0.6, capsize=3
            )
        if title.startswith("held-out"):
            lo, hi = min(vals), max(vals)
            pad = max(0.02, (hi - lo) * 0.3)
            ax.set_xlim(lo - pad, hi + pad)
            for y, s in zip(ys, summary, strict=True):
                ax.scatter(s["losses"], [y] * len(s["losses"]), color="black", s=10, zorder=3)
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks(ys, names)
    axes[0].invert_yaxis()
    fig.suptitle(
        f"{Path(results['model']).name}: {results['tokens_per_run']:,} training tokens per arm", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    p = results["plan"]
    write_atomic(out / "results.json", json.dumps(results, indent=1))
    _plot(results, out / "pretrained.png")
    ch = results["chosen"]
    lines = [
        "# Engram on a pretrained model: against LoRA at equal training tokens",
        "",
        f"`{results['command']}`" + (" (--quick: a smoke test, not a result)" if results["quick"] else ""),
        "",
        f"- Model: `{results['model']}` ({results['model_layers']} layers, hidden {results['model_hidden']}, "
        f"{results['backbone_params']:,} parameters).",
        f"- Corpus: {results['corpus']}, the demo's split: {results['train_tokens']:,} training tokens; "
        f"held out ({', '.join(results['held_out_documents'])}): {results['held_out_tokens']:,} tokens, "
        f"never trained on; the first {results['eval_tokens']:,} predicted tokens evaluated.",
        f"- Every trained arm: {p['steps']} steps of {p['batch_size']} x {p['seq_len']} = "
        f"{results['tokens_per_run']:,} tokens; lr LoRA {p['lora_lr']:g}, full {p['full_lr']:g}, Engram "
        f"{p['engram_lr']:g} (tables {p['table_lr']:g}); LoRA rank {p['lora_rank']}; seeds "
        f"{results['seeds']}.",
        f"- Memory / generalisation: next-token accuracy where the {p['ngram']}-gram ending at the target "
        "occurred in the training text / did not.",
        f"- Cloze: {results['cloze_items']} held-out occurrences of {results['cloze_phrases']} phrases of "
        f"{p['cloze_n']} tokens seen {p['cloze_min_count']}+ times in training, after {p['cloze_context']} "
        f"tokens of context; the last {p['cloze_blank']} token(s) completed greedily, exact match.",
        "",
        "## Arms (mean ± seed spread)",
        "",
        *table_lines(results),
        "",
        "s/token: training seconds per token (a resumed run: since its resume) relative to LoRA's. Added: "
        "what the model carries at inference (LoRA merged: none); bytes: the Engram part's files.",
        "",
        "## Findings",
        "",
        *[f"- {f}" for f in results["findings"]],
        "",
        f"## Pilot (Engram alone, seed {results['seeds'][0]}, {p['pilot_steps']} steps)",
        "",
        "| layers | table rows a layer | held-out loss |",
        "|---|---|---|",
        *[
            f"| {r['layers']} | {r['rows']:,} | {r['held_out_loss']:.4f}"
            + (" (chosen)" if r["layers"] == ch["layers"] and r["rows"] == ch["rows"] else "")
            + " |"
            for r in results["pilot"]
        ],
        "",
        "![arms](pretrained.png)",
        "",
        f"{results['new_runs']} run(s) new, the rest from `runs/`; {results['wall_seconds']:.0f} s.",
        "",
    ]
    write_atomic(out / "report.md", "\n".join(lines))
