"""`engram study memorize`: facts written into Engram rows (memory patches, `engram.memory`) against
LoRA, a fine-tuned last layer and the fact given in the prompt, for 10, 100 and 1,000 of the shipped
synthetic facts (`facts_gen.FACTS_PATH`; seed s's n facts: the first n of a permutation drawn with s).

Models: an HF folder with Engram, and the demo's own Engram LM. The HF folder is --model
(a plain folder gets Engram first, trained as `engram study pretrained`'s Engram-alone arm trains it:
its plan, default layers and rows); without it, that arm's seed-0 folder when `<out>/pretrained/
results.json` names one, else SmolLM2-135M converted into `<out>/smollm2-135m` and trained so. The demo
LM is --demo-run (an `engram train` run folder), else the demo preset trained once here (--quick: the
tiny one; minutes on 2 cores); `demo=False` skips it. Everything but that training runs on the CPU:
`memorize` writes patches there.

Arms (`ARMS`), each on the same facts, passes, batch and batch order, loss on the target tokens only:
none, patch, reader-patch (a patch written through readers trained once on other facts:
`memorize_reader`), reader-patch-ref (the same, leaving out every row the training text's first
tokens read: `memorize(reference=...)`; `MemorizePlan.reference_tokens`), lora-r1, lora-r8,
last-layer, in-prompt (`memorize_arms`). LoRA's and the last layer's learning rates: a pilot on seed 0
(`MemorizePlan`). Models: `memorize_models`; measurements: `memorize_probes`; report:
`memorize_report`.
Resumable as `study pretrained`: a run's record `<out>/runs/memorize-<key>.json` (atomic), its key a
hash of the model's files, the facts, the arm and its settings; a finished run is reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram.apps.study.facts_gen import FACTS_PATH, READER_FACTS_PATH
from engram.apps.study.memorize_arms import (
    LORA_RANKS,
    PATCH_ARMS,
    READER_ARMS,
    answers,
    fact_subset,
    fit,
    in_prompt,
    metrics,
    nbytes,
    read_records,
    to_learn,
    trainable,
)
from engram.apps.study.memorize_models import (
    Subject,
    demo_folder,
    demo_subject,
    encode_text,
    hf_folder,
    hf_subject,
)
from engram.apps.study.memorize_probes import locality, position_losses
from engram.apps.study.memorize_reader import check_apart, reader_model, text_blocks
from engram.apps.study.memorize_report import summarize, write_report
from engram.apps.study.pretrained import pretrained_plan, write_corpus
from engram.apps.study.pretrained_report import read_record, write_atomic
from engram.memory import (
    MemorizeSettings,
    ReaderSettings,
    apply_patch,
    memorize,
    patch_hits,
    remove_patch,
    save_patch,
)
from engram.memory.choose import default_reference_tokens

__all__ = ["ARMS", "MemorizePlan", "fact_subset", "memorize_plan", "read_records", "run_memorize_study"]

STUDY = "memorize"
_VERSION = 1
ARMS = ("none", "patch", "reader-patch", "reader-patch-ref", "lora-r1", "lora-r8", "last-layer", "in-prompt")


@dataclass(frozen=True)
class MemorizePlan:
    """The study's settings. Every trained arm: `steps` passes over the facts in batches of
    `batch_size` (memorize's defaults), Adam; LoRA and the last layer at the lr of `lora_lrs` /
    `layer_lrs` that the pilot found lowest in final training loss: the pilot's runs are seed 0's runs
    at each lr of the grid (each facts size up to `pilot_max_facts`; larger sizes take the largest
    piloted size's lr), the chosen one kept as seed 0's run. The reader arms' readers, trained once a
    model and used by every seed and size: the first `reader_facts` facts of the reader facts file
    (other subjects than any written fact), `reader_passes` passes at `reader_lr` with the training
    text's LM loss at `reader_text_weight` (0 facts: both arms are left out). reader-patch-ref's
    reference: the training text's first `reference_tokens` tokens (text the model was trained on, not
    the held-out text it is measured on); None: a layer's rows per head (its fewest), rounded down to a
    power of two (`engram.memory.choose.default_reference_tokens`, as `engram memorize --reference`
    takes; SmolLM2's study model: 65,536, the demo LM: 16,384)."""

    facts: tuple[int, ...] = (10, 100, 1000)
    steps: int = 30
    batch_size: int = 32
    patch_lr: float = MemorizeSettings.lr  # memorize's default
    lora_lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    layer_lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    pilot_max_facts: int = 100
    held_tokens: int = 16384  # of the held-out books: the loss change and the locality
    block_len: int = 128
    neighbour_tokens: int = 3
    eval_batch: int = 32
    patch_rows: int | None = MemorizeSettings.rows_per_fact  # both patch arms: rows a layer a fact
    reader_facts: int = 300
    reader_passes: int = ReaderSettings.passes
    reader_lr: float = ReaderSettings.lr
    reader_text_weight: float = ReaderSettings.text_weight
    reader_seed: int = 0  # the readers' pass order (trained once: not the run's seed)
    # reader-patch-ref: the training text's tokens whose rows no fact takes (None: the docstring's rule)
    reference_tokens: int | None = None
    arms: tuple[str, ...] = ARMS  # the arms run (a subset of ARMS; `none` is always measured)

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms:
            raise ValueError(
                f"--arms {','.join(self.arms)}: {'no arm' if not bad else repr(bad[0]) + ' is not an arm'}; give "
                f"one or more of {', '.join(ARMS)}"
            )
        object.__setattr__(self, "arms", tuple(a for a in ARMS if a in self.arms or a == "none"))
        sizes = self.facts
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"--facts {sizes!r}: give one or more whole numbers >= 1, e.g. 10,100,1000")
        for name in (
            "steps",
            "batch_size",
            "held_tokens",
            "neighbour_tokens",
            "eval_batch",
            "reference_tokens",
        ):
            v = getattr(self, name)
            if v is None and name == "reference_tokens":
                continue  # the docstring's rule
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: give a whole number >= 1")
        if self.patch_rows is not None and (
            isinstance(self.patch_rows, bool) or not isinstance(self.patch_rows, int) or self.patch_rows < 1
        ):
            raise ValueError(f"patch_rows={self.patch_rows!r}: give a whole number >= 1, or None (every row)")
        if (
            isinstance(self.reader_facts, bool)
            or not isinstance(self.reader_facts, int)
            or self.reader_facts < 0
        ):
            raise ValueError(f"reader_facts={self.reader_facts!r}: give a whole number >= 0")
        self.reader_settings()  # its own checks
        if self.block_len < 2:
            raise ValueError(f"block_len={self.block_len}: give 2 or more")
        for name in ("lora_lrs", "layer_lrs"):
            lrs = getattr(self, name)
            if not lrs or any(isinstance(v, bool) or not 0 < v < math.inf for v in lrs):
                raise ValueError(f"{name}={lrs!r}: give one or more finite learning rates > 0")

    def reader_settings(self) -> ReaderSettings:
        return ReaderSettings(
            passes=self.reader_passes,
            lr=self.reader_lr,
            text_weight=self.reader_text_weight,
            batch_size=self.batch_size,
            seed=self.reader_seed,
        )


QUICK = MemorizePlan(
    facts=(10, 20),
    steps=5,
    lora_lrs=(1e-3,),
    layer_lrs=(3e-4,),
    held_tokens=2048,
    reader_facts=8,
    reader_passes=2,
    reference_tokens=512,
)


def memorize_plan(
    quick: bool = False, steps: int | None = None, facts: Sequence[int] | None = None
) -> MemorizePlan:
    """The full plan or --quick's (a smoke test), with --steps and --facts applied."""
    p = QUICK if quick else MemorizePlan()
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--steps {steps!r}: give a whole number >= 1")
        p = replace(p, steps=steps)
    return p if facts is None else replace(p, facts=tuple(sorted(set(facts))))


# ------------------------------------------------------------------------------------------- runs
def _ev(p: MemorizePlan) -> tuple[int, int]:
    return p.eval_batch, p.neighbour_tokens


@dataclass
class _Ctx:
    out: Path
    plan: MemorizePlan
    records: list[dict[str, Any]]
    facts_fp: str
    say: Callable[[str], None]
    progress: bool
    reader_records: list[dict[str, Any]] = field(default_factory=list)  # the readers' facts
    reader_fp: str = ""  # of their file: in the readers' keys
    report_only: bool = False  # runs not made yet are listed in `missing`, not made
    missing: list[str] = field(default_factory=list)
    train_text: str = ""
    train_fp: str = ""  # of train_text: in the readers' keys
    fresh: int = 0
    pilots: int = 0
    references: dict[str, list[int]] = field(default_factory=dict)  # reader-patch-ref's, by model key


@contextlib.contextmanager
def _passes(ctx: _Ctx, what: str, passes: int | None = None) -> Iterator[Callable[[int, float], None]]:
    """A progress bar over a run's passes (none without `ctx.progress`); yields its tick."""
    from tqdm.auto import tqdm

    total = ctx.plan.steps if passes is None else passes
    with tqdm(total=total, desc=what, leave=False, disable=not ctx.progress) as bar:

        def tick(_: int, loss: float) -> None:
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}")

        yield tick


def _key(ctx: _Ctx, s: Subject, what: dict[str, Any]) -> str:
    p = ctx.plan
    held = hashlib.sha256(s.held.numpy().tobytes()).hexdigest()[:16]
    ev = {"held": held, "nb": p.neighbour_tokens}
    blob = {"v": _VERSION, "study": STUDY, "model": s.fingerprint, "facts": ctx.facts_fp, "eval": ev, **what}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def _base(ctx: _Ctx, s: Subject, ids: list[int]) -> dict[str, Any]:
    """The untrained model's answers per record (added to as more records are needed) and held-out loss."""
    path = ctx.out / "runs" / f"memorize-base-{_key(ctx, s, {'arm': 'base'})}.json"
    rec = read_record(path, _VERSION) or {"version": _VERSION, "records": {}}
    if "held_out_loss" not in rec:
        rec["held_out_loss"] = float(position_losses(s.logits(s.model), s.held, 8).mean())
    todo = [i for i in ids if str(i) not in rec["records"]]
    if todo:
        ctx.say(f"{s.name}: the untrained model on {len(todo)} facts")
        ans = answers(s, s.model, [ctx.records[i] for i in todo], lambda r: "", *_ev(ctx.plan))
        rec["records"].update({str(i): a for i, a in zip(todo, ans, strict=True)})
        write_atomic(path, json.dumps(rec))
    return rec


def _none(base: dict[str, Any], ids: list[int]) -> dict[str, float]:
    """The untrained model's metrics on facts `ids` (from its answers per record)."""
    recs = [base["records"][str(i)] for i in ids]
    m = metrics(recs, recs)
    return {**m, "held_out_delta": 0.0, "bytes_per_fact": 0.0, "train_seconds": 0.0}


def _pilot(ctx: _Ctx, s: Subject, base: dict[str, Any], arm: str, n: int) -> list[dict[str, Any]] | None:
    """Final training loss of `arm` at each of its lrs on seed 0's `n` facts: seed 0's run at each lr
    (`_run`, cached), so the chosen one is seed 0's run and nothing is trained twice. None: a run not
    made yet (`ctx.report_only`)."""
    p = ctx.plan
    lrs = p.lora_lrs if arm in LORA_RANKS else p.layer_lrs
    out = []
    for lr in lrs:
        made = ctx.fresh
        rec = _run(ctx, s, base, arm, n, 0, lr)
        if rec is None:
            return None
        ctx.pilots += ctx.fresh - made
        final = rec["losses"][-1]
        out.append(
            {
                "model": s.key,
                "arm": arm,
                "n": n,
                "lr": lr,
                "final_loss": final if math.isfinite(final) else None,
            }
        )
    best = min(out, key=lambda r: math.inf if r["final_loss"] is None else r["final_loss"])
    for r in out:
        r["chosen"] = r is best
        r["edge"] = len(out) > 1 and r is best and r["lr"] in (min(lrs), max(lrs))
    return out


def _run(
    ctx: _Ctx, s: Subject, base: dict[str, Any], arm: str, n: int, seed: int, lr: float | None
) -> dict[str, Any] | None:
    """One (model, arm, n, seed) record: from the cache, or trained and measured now (None: not made
    yet, and `ctx.report_only`)."""
    p = ctx.plan
    ids = fact_subset(len(ctx.records), n, seed)
    if arm == "none":
        return {"model": s.key, "arm": arm, "n": n, "seed": seed, "metrics": _none(base, ids), "cached": True}
    train = {"steps": p.steps, "batch": p.batch_size, "lr": lr} if arm != "in-prompt" else {}
    if arm in PATCH_ARMS:  # always: a key naming no rows would mean whatever memorize's default was then
        train["rows"] = p.patch_rows
    if arm in READER_ARMS:
        train["reader"] = _reader_what(ctx)
    if arm == "reader-patch-ref":
        train["reference"] = [ctx.train_fp, reference_len(p, s)]
    key = _key(ctx, s, {"arm": arm, "n": n, "seed": seed, **train})
    path = ctx.out / "runs" / f"memorize-{key}.json"
    rec = read_record(path, _VERSION)
    if rec is not None:
        return {**rec, "cached": True}
    if ctx.report_only:
        ctx.missing.append(
            f"{s.name}, {arm}, {n:,} facts, seed {seed}" + (f", lr {lr:g}" if "lr" in train else "")
        )
        return None
    ctx.say(f"{s.name}: {arm}, {n} facts, seed {seed}" + (f", lr {lr:g}" if lr else ""))
    recs = [ctx.records[i] for i in ids]
    facts = [to_learn(r) for r in recs]
    base_ans = [base["records"][str(i)] for i in ids]
    f = s.logits(s.model)
    extra: dict[str, Any] = {}
    if arm == "in-prompt":
        ans = answers(s, s.model, recs, in_prompt, *_ev(p))
        m = metrics(ans, base_ans)
        ctx_tokens = [len(encode_text(s.tokenizer, in_prompt(r), False)) for r in recs]
        m.update(
            held_out_delta=0.0,
            train_seconds=0.0,
            bytes_per_fact=float(np.mean([len(in_prompt(r).encode()) for r in recs])),
        )
        extra["context_tokens"] = float(np.mean(ctx_tokens))
    elif arm in PATCH_ARMS:
        model = s.model
        if arm in READER_ARMS:  # readers trained once on other facts (the answers' base: the model before)
            model, reader = _reader(ctx, s)
            f = s.logits(model)
            extra["reader"] = reader
        reference = [_reference(ctx, s)] if arm == "reader-patch-ref" else None
        settings = MemorizeSettings(
            steps=p.steps, lr=lr or p.patch_lr, batch_size=p.batch_size, seed=seed, rows_per_fact=p.patch_rows
        )
        t = time.perf_counter()  # the row choice included, as LoRA's time includes encoding the facts
        with _passes(ctx, arm) as tick:
            name = f"{n} facts, seed {seed}"
            try:
                res = memorize(
                    model,
                    s.tokenizer,
                    facts,
                    settings,
                    reference=reference,
                    name=name,
                    progress=tick,
                    hasher=s.hasher,
                )
            except ValueError as e:
                if reference is None or not str(e).startswith("no row is left"):
                    raise
                raise ValueError(
                    f"{s.name}, reader-patch-ref, {n} facts: the reference (the training text's first "
                    f"{reference_len(p, s):,} tokens) reads every row the facts could use; give a smaller "
                    "reference_tokens, or leave the arm out (--arms)"
                ) from None
        secs = time.perf_counter() - t
        file = save_patch(res.patch, path.with_suffix(".patch.safetensors"))
        hasher = s.layers(model).hasher
        hits = np.stack([patch_hits(hasher, res.patch, b.tolist()) for b in s.held])
        apply_patch(model, res.patch, hasher=s.hasher)
        try:
            ans = answers(s, model, recs, lambda r: "", *_ev(p))
        finally:
            remove_patch(model, res.patch, hasher=s.hasher)
        loc = locality(
            f,
            s.held,
            hits,
            lambda: apply_patch(model, res.patch, hasher=s.hasher),
            lambda: remove_patch(model, res.patch, hasher=s.hasher),
            8,
        )
        m = metrics(ans, base_ans)
        m.update(
            held_out_delta=loc["held_out_loss"] - base["held_out_loss"],  # the readers' change included
            train_seconds=secs,
            bytes_per_fact=file.stat().st_size / n,
        )
        extra.update(
            locality={**loc, "rows": res.patch.num_rows, "file_bytes": file.stat().st_size},
            losses=res.losses,
            facts_without_rows=len(res.facts_without_rows),
        )
        del model
    else:
        model, params = trainable(s, arm, seed)
        with _passes(ctx, arm) as tick:
            losses, secs = fit(s, model, params, facts, lr or 0.0, p.steps, p.batch_size, seed, tick)
        ans = answers(s, model, recs, lambda r: "", *_ev(p))
        m = metrics(ans, base_ans)
        held = float(position_losses(s.logits(model), s.held, 8).mean())
        m.update(
            held_out_delta=held - base["held_out_loss"],
            train_seconds=secs,
            bytes_per_fact=nbytes(params) / n,
        )
        extra.update(losses=losses, params=sum(q.numel() for q in params))
        del model
    rec = {
        "version": _VERSION,
        "key": key,
        "model": s.key,
        "arm": arm,
        "n": n,
        "seed": seed,
        "lr": lr,
        "metrics": m,
        **extra,
    }
    write_atomic(path, json.dumps(rec, indent=1))
    ctx.fresh += 1
    return {**rec, "cached": False}


def reference_len(p: MemorizePlan, s: Subject) -> int:
    """reader-patch-ref's reference length in tokens (`MemorizePlan.reference_tokens`; its docstring)."""
    if p.reference_tokens is not None:
        return p.reference_tokens
    return default_reference_tokens(s.layers(s.model).hasher)


def _reference(ctx: _Ctx, s: Subject) -> list[int]:
    """reader-patch-ref's reference: the training text's first `reference_len` tokens (once a model)."""
    if s.key not in ctx.references:
        r = reference_len(ctx.plan, s)
        text = ctx.train_text[: r * 8]  # 8 characters a token is plenty
        ctx.references[s.key] = encode_text(s.tokenizer, text, False)[:r]
    return ctx.references[s.key]


def _reader_what(ctx: _Ctx) -> dict[str, Any]:
    p = ctx.plan
    return {
        "facts": [ctx.reader_fp, len(ctx.reader_records)],
        "settings": asdict(p.reader_settings()),
        "text": ctx.train_fp,
        "block": p.block_len,
    }


def _reader(ctx: _Ctx, s: Subject) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model with its trained readers (`memorize_reader`; once a model) and their record."""
    p, what = ctx.plan, _reader_what(ctx)
    path = ctx.out / "runs" / f"memorize-reader-{_key(ctx, s, {'arm': 'reader', **what})}.json"
    blocks = text_blocks(s, ctx.train_text, p.block_len)
    with _passes(ctx, "readers", p.reader_passes) as tick:
        return reader_model(s, ctx.reader_records, p.reader_settings(), blocks, path, ctx.say, tick)


def _piloted(p: MemorizePlan) -> list[int]:
    """The facts sizes the pilot runs at (MemorizePlan's docstring)."""
    return [n for n in p.facts if n <= p.pilot_max_facts] or [min(p.facts)]


def _lrs(
    ctx: _Ctx, s: Subject, base: dict[str, Any]
) -> tuple[dict[tuple[str, int], float], list[dict[str, Any]]]:
    """{(arm, n): lr} of LoRA and the last layer, and the pilot's runs (MemorizePlan's docstring); an
    (arm, n) whose pilot is not made yet (report only) is left out, with the sizes that take its lr."""
    p = ctx.plan
    piloted = _piloted(p)
    lrs: dict[tuple[str, int], float] = {}
    pilots: list[dict[str, Any]] = []
    for arm in [a for a in ("lora-r1", "lora-r8", "last-layer") if a in p.arms]:
        grid = p.lora_lrs if arm in LORA_RANKS else p.layer_lrs
        for n in piloted:
            if len(grid) == 1:
                lrs[arm, n] = grid[0]
                continue
            got = _pilot(ctx, s, base, arm, n)
            if got is not None:
                pilots.extend(got)
                lrs[arm, n] = next(r["lr"] for r in got if r["chosen"])
        for n in p.facts:  # a larger size: the lr of the largest piloted size below it
            took = (arm, max([m for m in piloted if m <= n] or piloted[:1]))
            if took in lrs:
                lrs.setdefault((arm, n), lrs[took])
    return lrs, pilots


def _study(
    ctx: _Ctx, s: Subject, seeds: Sequence[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Every run of one model: (records, pilot runs, the untrained model's held-out loss)."""
    p = ctx.plan
    needed = sorted({i for seed in seeds for i in fact_subset(len(ctx.records), max(p.facts), seed)})
    base = _base(ctx, s, needed)
    lrs, pilots = _lrs(ctx, s, base)
    runs = []
    for n in p.facts:
        for seed in seeds:
            for arm in p.arms:
                if arm in READER_ARMS and not ctx.reader_records:
                    continue  # reader_facts 0 (run_memorize_study says so)
                lr = p.patch_lr if arm in PATCH_ARMS else lrs.get((arm, n))
                if lr is None and arm in (*LORA_RANKS, "last-layer"):  # its pilot not made yet (report only)
                    if not (seed == 0 and n in _piloted(p)):  # seed 0's: the pilot's runs, listed by it
                        ctx.missing.append(f"{s.name}, {arm}, {n:,} facts, seed {seed} (its lr: the pilot's)")
                    continue
                r = _run(ctx, s, base, arm, n, seed, lr)
                if r is not None:
                    runs.append(r)
    return runs, pilots, base["held_out_loss"]


def run_memorize_study(
    out_dir: str | Path = "reports/study",
    *,
    model: str | None = None,
    demo_run: str | None = None,
    demo: bool = True,
    facts: Sequence[int] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    steps: int | None = None,
    quick: bool = False,
    corpus: str | None = None,
    threads: int | None = None,
    progress: bool = True,
    command: str = "engram study memorize",
    plan: MemorizePlan | None = None,
    facts_path: str | os.PathLike[str] | None = None,
    reader_facts_path: str | os.PathLike[str] | None = None,
    report_only: bool = False,
    demo_config: Any = None,
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Run (or take from `<out_dir>/runs/`) every model x facts size x seed x arm; write
    `<out_dir>/memorize/`: report.md, results.json, memorize.png. `facts_path`: the facts written
    (default the shipped 1,000); `reader_facts_path`: the reader-patch arm's readers' (default the
    shipped 300; refused where one shares a subject or prompt with a written fact). `report_only`: the
    report of the runs already made (the untrained model's answers are still measured); the others are
    listed under "skipped", not run. `device`: where an
    Engram base the study trains itself is trained (default: the GPU when there is one); everything else
    on the CPU."""
    import transformers.utils.logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        if not seeds or min(seeds) < 0:
            raise ValueError(f"seeds {list(seeds)}: give one or more seeds >= 0")
        plan = plan or memorize_plan(quick, steps, facts)
        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        out = Path(out_dir)
        fpath = Path(facts_path or FACTS_PATH)
        records = read_records(fpath)
        if max(plan.facts) > len(records):
            raise ValueError(
                f"--facts {','.join(map(str, plan.facts))}: {fpath} holds {len(records)} facts; give sizes up "
                f"to {len(records)}"
            )
        if demo_run is not None and not demo:
            raise ValueError(f"--demo-run {demo_run} with --no-demo: give one of them")
        train, held, corpus_info = write_corpus(out / STUDY, corpus, pretrained_plan(quick))
        held_text = held.read_text(encoding="utf-8")
        fp = hashlib.sha256(fpath.read_bytes()).hexdigest()[:16]
        ctx = _Ctx(out, plan, records, fp, say, progress, report_only=report_only)
        if plan.reader_facts:
            rpath = Path(reader_facts_path or READER_FACTS_PATH)
            readers = read_records(rpath)
            if len(readers) < plan.reader_facts:
                raise ValueError(
                    f"reader_facts {plan.reader_facts}: {rpath} holds {len(readers)} facts; give at most that many"
                )
            ctx.reader_records = readers[: plan.reader_facts]
            check_apart(records, ctx.reader_records, str(rpath))
            ctx.reader_fp = hashlib.sha256(rpath.read_bytes()).hexdigest()[:16]
        ctx.train_text = train.read_text(encoding="utf-8")
        ctx.train_fp = hashlib.sha256(ctx.train_text.encode()).hexdigest()[:16]  # once, not a run at a time
        subjects, skipped = [], []
        if not plan.reader_facts:
            skipped.append("reader-patch, reader-patch-ref: reader_facts 0 (no readers trained): left out")
        folder, how = hf_folder(out, model, train, quick=quick, progress=progress, say=say, device=device)
        subjects.append(hf_subject(folder, how, held_text, plan.held_tokens, plan.block_len))
        if demo:
            run, how = demo_folder(out, demo_run, demo_config, quick, say)
            subjects.append(demo_subject(run, how, held_text, plan.held_tokens, plan.block_len))
        else:
            skipped.append("the demo's Engram LM: skipped (--no-demo)")
        runs, pilots, models = [], [], []
        for s in subjects:
            r, pl, base_loss = _study(ctx, s, seeds)
            runs += r
            pilots += pl
            e = s.layers(s.model)
            models.append({
                "key": s.key, "name": s.name, "source": s.source, "how": s.how,
                "params": sum(q.numel() for q in s.model.parameters()),
                "engram_layers": sorted(e.modules), "table_rows": {str(k): m.table.num_rows for k, m in e.modules.items()},
                "row_dim": next(iter(e.modules.values())).table.dim,
                "held_out_tokens": int(s.held.numel()), "block_len": int(s.held.shape[1]),
                "base_held_out_loss": base_loss, "reference_tokens": reference_len(plan, s),
            })  # fmt: skip
        if ctx.missing:
            shown = "; ".join(ctx.missing[:6]) + ("; ..." if len(ctx.missing) > 6 else "")
            skipped.append(f"{len(ctx.missing)} runs not made yet (report only): {shown}")
        results = {
            "study": STUDY,
            "command": command,
            "quick": quick,
            "plan": asdict(plan),
            "facts_file": str(fpath),
            "facts_total": len(records),
            "seeds": list(seeds),
            **corpus_info,
            "models": models,
            "skipped": skipped,
            "arms": list(plan.arms),
            "pilot": pilots,
            "runs": runs,
            "new_runs": ctx.fresh,
            "new_pilot_runs": ctx.pilots,
            "wall_seconds": time.perf_counter() - t0,
        }
        results.update(summarize(results))
        write_report(results, out / STUDY)
        return results
    finally:
        if bars:
            hf_logging.enable_progress_bar()
