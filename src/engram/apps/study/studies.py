"""`engram study`: the questions a researcher asks after the demo, answered with seed spreads.

The studies (`STUDIES`: memory, ablations, baselines, allocation, optimizers) and their runs are
`engram.apps.study.plans`'s; `run_study` trains what is not already cached, two runs in lock-step at a time (one step
each in turn, as the demo does, so a noisy machine slows both alike), and writes the report
(`engram.apps.study.report`). Every finished run is a JSON record in `<out>/runs/`, named by the
hash of its config and corpus: an interrupted study continues where it stopped, and studies sharing
a folder share runs (the baseline, the reference Engram). Studies compare final full evaluations.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engram.apps.lm.data import load_corpus
from engram.apps.lm.train import DataBundle, TrainConfig, Trainer, build_model, prepare_data
from engram.apps.study.plans import STUDIES, RunSpec, plan_study, study_base, table_rows
from engram.device import Precision
from engram.model.optim import split_param_groups
from engram.model.sinkhorn import SparseSinkhorn

__all__ = [
    "STUDIES",
    "RunSpec",
    "corpus_fingerprint",
    "plan_study",
    "run_key",
    "run_study",
    "study_base",
    "table_rows",
]

_RECORD_VERSION = 1


# ---------------------------------------------------------------------------- cache
def corpus_fingerprint(corpus: str | None) -> str:
    """A hash of the corpus's documents (names and text): a changed file is another corpus."""
    h = hashlib.sha256(b"corpus-v1")
    for d in load_corpus(corpus):
        h.update(d.name.encode() + b"\x00" + d.text.encode() + b"\x00")
    return h.hexdigest()[:16]


def run_key(cfg: TrainConfig, corpus_fp: str, precision: Precision = Precision.FLOAT32) -> str:
    """The cache key of a run: its config (threads aside: they change speed only), its corpus, and its
    precision when not float32 (bf16 results are not float32's; the device is no part of it: a run
    cached on the GPU serves the CPU, within float rounding)."""
    d = cfg.to_dict()
    for k in ("threads", "extra", "keep_checkpoints", "checkpoint_every"):
        d.pop(k, None)
    d["corpus"] = corpus_fp
    if precision is not Precision.FLOAT32:  # float32 keys stay those of runs cached before precisions
        d["precision"] = precision.value
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


def _optimizer_state(
    opt: torch.optim.Optimizer | None, params: list[torch.nn.Parameter]
) -> dict[str, Any] | None:
    """What `opt` keeps for `params` at the end of a run: their parameters and rows, the bytes of its
    state tensors (workspaces aside) and, for SparseSinkhorn, the rows that hold state (None: no
    optimizer, or none of `params`)."""
    if opt is None or not params:
        return None
    held = sum(
        t.numel() * t.element_size()
        for p in params
        for t in opt.state.get(p, {}).values()
        if torch.is_tensor(t)
    )
    active = sum(opt.active_rows(p) for p in params) if isinstance(opt, SparseSinkhorn) else None
    return {
        "params": sum(p.numel() for p in params),
        "rows": sum(p.shape[0] for p in params),
        "dim": params[0].shape[1],
        "state_bytes": held,
        "active_rows": active,
    }


def _train_pair(
    specs: list[RunSpec],
    cache: dict[str, DataBundle],
    on_step: Any,
    device: torch.device,
    precision: Precision,
) -> list[dict[str, Any]]:
    """Train `specs` (one or two runs) in lock-step on `device` in `precision`; return their records."""
    trainers = []
    for spec in specs:
        key = _data_key(spec.cfg)
        if key not in cache:
            cache[key] = prepare_data(spec.cfg)
            _check_data(cache[key], spec.cfg)
        data = cache[key]
        model = build_model(spec.cfg, data)
        trainers.append(Trainer(spec.cfg, data, model, device=device, precision=precision))
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
                "device": str(t.device),
                "precision": t.precision.value,
                "held_out": ev,
                "held_out_loss": ev["loss"],
                "params": t.model.num_params(),
                "tokens_per_s": c.steps * c.batch_size * c.seq_len / t.train_seconds,
                "train_seconds": t.train_seconds,
                "history": t.history,
                "table_state": _optimizer_state(t.table_opt, split_param_groups(t.model)[1]),
                "embedding_state": _optimizer_state(
                    t.opt if t.embed_opt is None else t.embed_opt, _embedding_params(t)
                ),
            }
        )
    return records


def _embedding_params(t: Trainer) -> list[torch.nn.Parameter]:
    """The token embedding and the LM head (one parameter when tied)."""
    m = t.model
    return [m.embed.weight] + ([m.head.weight] if m.head is not None else [])


def run_study(
    study: str,
    base: TrainConfig,
    *,
    seeds: tuple[int, ...] = (0, 1, 2),
    quick: bool = False,
    out_dir: str | Path = "reports/study",
    progress: bool = True,
    command: str = "engram study",
    device: torch.device | None = None,
    precision: Precision = Precision.FLOAT32,
) -> dict[str, Any]:
    """Run (or take from the cache) every run of `study` and write `<out_dir>/<study>/`: report.md,
    results.json and plots. Runs are cached in `<out_dir>/runs/`, trained on `device` (default the
    CPU) in `precision`. Returns the results."""
    from tqdm.auto import tqdm

    from engram.apps.study.report import write_study_report

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
    keys = [run_key(s.cfg, corpus_fp, precision) for s in specs]
    device = torch.device("cpu") if device is None else device
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
            pair,
            _train_pair([s for _, s in pair], cache, lambda: bar.update(1), device, precision),
            strict=True,
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
                "table_state": rec.get("table_state"),  # absent in records of older versions
                "embedding_state": rec.get("embedding_state"),
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
        "device": str(device),
        "precision": precision.value,
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
    "table_optimizer",
    "table_lr",
    "embedding_optimizer",
    "embedding_lr",
    "lr",
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
