"""The verdicts and text of `engram quantise-check` (`quantise_check.check_folder`'s results): each
format's loss change over several folders (seeds) against the float table's seed spread, the gate's
failures, and the lines printed for a folder and for the seeds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from engram.apps.tools.quantise_check import REFERENCE

__all__ = ["distinct_seeds", "format_report", "format_summary", "gate_failures", "seed_summary"]


def distinct_seeds(results: Sequence[dict[str, Any]]) -> int:
    """How many different seeds the results were trained with (a folder that records none counts none)."""
    return len({repr(sorted(r["seed"].items())) for r in results if r.get("seed") is not None})


def seed_summary(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Over several folders (seeds of one model): per format the loss change's mean and standard
    deviation, against the float table's seed spread (the standard deviation of its loss over the
    folders), and whether the mean change is within it. Fewer than two distinct seeds (`seed`: each
    result's recorded seeds) give no spread: it and the verdict are None (unknown), never 0."""
    if len(results) < 2:
        raise ValueError(f"a seed spread needs 2 or more folders, got {len(results)}")
    names = [r["format"] for r in results[0]["formats"]]
    for res in results[1:]:
        if [r["format"] for r in res["formats"]] != names:
            raise ValueError("folders checked with different formats: check them in one call")
    known = distinct_seeds(results) >= 2
    spread = statistics.stdev(res["formats"][0]["loss"] for res in results) if known else None
    out = []
    for j, name in enumerate(names[1:], 1):
        changes = [res["formats"][j]["loss_change"] for res in results]
        mean = statistics.fmean(changes)
        out.append(
            {
                "format": name,
                "loss_change_mean": mean,
                "loss_change_std": statistics.stdev(changes),
                "loss_changes": changes,
                "float_seed_spread": spread,
                "within_seed_spread": None if spread is None else mean <= spread,
            }
        )
    return out


def gate_failures(results: Sequence[dict[str, Any]], max_increase: float) -> list[str]:
    """One line per (folder, format) whose held-out loss rises more than `max_increase` nats/token."""
    return [
        f"{r['format']} raises the held-out loss of {res['folder']} by {r['loss_change']:+.6f} nats/token, "
        f"more than --max-loss-increase {max_increase:g}"
        for res in results
        for r in res["formats"][1:]
        if r["loss_change"] > max_increase
    ]


def _acc(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def format_report(res: dict[str, Any]) -> list[str]:
    """The lines `engram quantise-check` prints for one folder."""
    ref = res["formats"][0]
    nt = ref["next_token"]
    head = f"{res['folder']} ({res['kind']}" + (f", step {res['step']}" if "step" in res else "") + ")"
    tables = ", ".join(f"layer {t['layer']} {t['rows']:,} x {t['dim']} {t['stored']}" for t in res["tables"])
    lines = [
        f"{head}: tables {tables}",
        f"  {ref['tokens']:,} held-out tokens of {res['text']}; memory: the {res['ngram']}-gram ending at the "
        f"target occurs in the training text ({nt['memory_tokens']:,} tokens), generalisation: it does not "
        f"({nt['generalisation_tokens']:,})",
        f"  {'format':<9}{'B/row':>6}{'V4.1 B/row':>11}{'V4.1 GB':>9}{'loss':>9}{'change':>10}{'acc':>8}"
        f"{'memory':>8}{'general':>8}{'rel.err':>9}",
    ]
    for r in res["formats"]:
        a = r["next_token"]
        change = "-" if r["format"] == REFERENCE else f"{r['loss_change']:+.5f}"
        rel = "-" if r["format"] == REFERENCE else f"{r['table_relative_error']:.4f}"
        lines.append(
            f"  {r['format']:<9}{r['bytes_per_row']:>6}{r['v41_bytes_per_row']:>11}{r['v41_table_gb']:>9.1f}"
            f"{r['loss']:>9.4f}{change:>10}{_acc(a['accuracy']):>8}{_acc(a['memory']):>8}"
            f"{_acc(a['generalisation']):>8}{rel:>9}"
        )
    for r in res["formats"][1:]:
        if r["worst_rows"]:
            worst = "; ".join(
                f"layer {w['layer']} row {w['row']} {w['max_abs_error']:.3g} ({w['relative_error']:.3g})"
                for w in r["worst_rows"]
            )
            lines.append(f"  largest row errors, {r['format']}: max |error| (relative): {worst}")
    return lines


def format_summary(summary: Sequence[dict[str, Any]], folders: int) -> list[str]:
    """The lines of `seed_summary`: each format's loss change against the float table's seed spread."""
    spread = summary[0]["float_seed_spread"]
    if spread is None:
        lines = [
            f"over {folders} folders: the float table's seed spread is unknown (fewer than 2 distinct seeds "
            "recorded): give runs of different seeds to compare against it"
        ]
    else:
        lines = [
            f"over {folders} folders: the float table's held-out loss has seed spread {spread:.5f} (std)"
        ]
    for s in summary:
        ratio = f" ({s['loss_change_mean'] / spread:.2f}x)" if spread else ""
        verdict = (
            "seed spread unknown"
            if spread is None
            else "within the seed spread"
            if s["within_seed_spread"]
            else "LOSES MORE than the seed spread"
        )
        lines.append(
            f"  {s['format']:<9} loss change {s['loss_change_mean']:+.5f} +- {s['loss_change_std']:.5f}: "
            f"{verdict}{ratio}"
        )
    return lines
