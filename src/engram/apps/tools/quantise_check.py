"""`engram quantise-check`: what storing a trained model's Engram tables in each row format costs it.

For a training run of the small LM (`engram train --out DIR`: its newest checkpoint, scored on its own
held-out split as `engram eval` scores it) or an `engram.hf` folder (backbone + Engram part, as
`hf-train` writes it: scored on the held-out blocks `hf-eval` takes, or on a separate held-out text),
each table is quantised to every format asked (`quantize_table`) and swapped in for the float one; per
format: bytes a row (here and at V4.1's 256-wide rows), V4.1's two tables in GB, held-out loss and its
change against the float table, next-token accuracy split into memory and generalisation (the
probes' `seen_mask`: the n-gram ending at the target occurred in the training text or not), the
tables' relative error and the rows whose dequantisation error is largest. Several folders (seeds of
one model: `comparable` refuses folders whose configs differ in more than the seed, and one folder twice)
add each format's loss change over seeds against the float table's seed spread (`quantise_report`, which
also formats the results). Plain functions, no argparse: the command is
`engram.cli.quantise`'s. Design: docs/storage.md.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from engram.addressing.layout import Layout
from engram.apps.study.probes import greedy_predictions_and_loss, ngram_set, seen_mask, split_accuracy
from engram.checkpoint.input_files import path_kind
from engram.config import EngramConfig
from engram.device import Precision, autocast
from engram.model.table import EngramTable, QuantTable, TrainableTable, dequantize_table, quantize_table
from engram.rowformat.formats import RowFormat

__all__ = [
    "NGRAM_MAX",
    "REFERENCE",
    "FolderKind",
    "FolderRecord",
    "RowErrors",
    "TableSlot",
    "check_folder",
    "check_ngram",
    "comparable",
    "describe",
    "folder_kind",
    "hf_slots",
    "lm_slots",
    "quantised",
    "row_errors",
    "sizes",
    "tables_as",
    "worst_rows",
]

REFERENCE = "float"  # the float table every format is measured against
V41 = "deepseek-v4.1"  # the preset whose table size the GB column is of
_CHUNK_ROWS = 1 << 16  # rows per chunk when reading or comparing a whole table
# The memory probe's longest n-gram: its set holds one n-tuple a training token (about 56 + 8n bytes
# each: n 1000 on a million tokens is 8 GB), and an n-gram longer than a block is never in one.
NGRAM_MAX = 32
# Config fields that do not make a different model: where files go, how often to save or log, threads.
_NOT_MODEL = frozenset(
    {"out", "threads", "checkpoint_every", "keep_checkpoints", "eval_every", "extra", "table_sync"}
)


class FolderKind:
    RUN = "training run"  # state.json or checkpoints/step-* (engram train)
    HF = "HF folder"  # config.json (+ engram/: hf-train, save_engram)


def folder_kind(folder: str | Path) -> str:
    """`FolderKind.RUN` or `FolderKind.HF`; ValueError naming the folder otherwise."""
    d = Path(folder)
    if path_kind(d) != "a folder":
        raise ValueError(f"{folder} is not a folder: give a training run's folder or an engram.hf folder")
    if path_kind(d / "state.json") == "a file" or any((d / "checkpoints").glob("step-*")):
        return FolderKind.RUN
    if path_kind(d / "config.json") == "a file":
        return FolderKind.HF
    raise ValueError(
        f"{folder} is neither a training run (state.json or checkpoints/step-*: `engram train --out`) nor an "
        "HF model folder (config.json: `engram hf-train --out`): give one of those"
    )


# ------------------------------------------------------------------------------------------ seeds
@dataclass(frozen=True)
class FolderRecord:
    """What a folder says it is, read before any work: its kind, its config flattened to dotted keys
    (`engram.table_rows`; the seeds and `_NOT_MODEL` fields left out; the steps trained included), its
    seeds (None where it records none) and the block length it is scored in."""

    folder: str
    kind: str
    config: dict[str, Any]
    seed: tuple[Any, ...] | None
    seq_len: int


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _split_seeds(config: dict[str, Any]) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """(the model fields of a flat config, its seeds: every `seed` / `*.seed` / `*_seed` field, by name)."""
    model, seeds = {}, []
    for k in sorted(config):
        last = k.rsplit(".", 1)[-1]
        if last == "seed" or last.endswith("_seed"):
            seeds.append((k, config[k]))
        elif last not in _NOT_MODEL:
            model[k] = config[k]
    return model, tuple(seeds)


def describe(folder: str | Path, seq_len: int | None = None) -> FolderRecord:
    """`FolderRecord` of a training run (its newest checkpoint's state.json: training config and step) or
    an engram.hf folder (engram_train.json's settings and steps, the part's engram/config.json); `seq_len`:
    an HF folder's block length when given (else the run's, else 128). ValueError naming the folder."""
    kind = folder_kind(folder)
    if kind == FolderKind.RUN:
        from engram.apps.lm.run_checkpoint import latest_checkpoint, read_state

        ckpt = latest_checkpoint(folder)
        if ckpt is None:
            raise ValueError(f"no checkpoint in {folder} (expected state.json or checkpoints/step-*)")
        state, cfg, _ = read_state(ckpt)
        model, seeds = _split_seeds(_flatten({**cfg.to_dict(), "step": state["step"]}))
        return FolderRecord(str(folder), kind, model, seeds, cfg.seq_len)
    from engram.apps.hf.folder import RUN_FILE
    from engram.checkpoint.files import member_file
    from engram.checkpoint.json_file import read_json

    flat: dict[str, Any] = {}
    recorded = path_kind(Path(folder) / RUN_FILE) == "a file"
    if recorded:
        run = read_json(member_file(folder, RUN_FILE, "the model folder's record of its training run"))
        settings = run.get("settings") if isinstance(run, dict) else None
        if not isinstance(settings, dict):
            raise ValueError(f"{Path(folder) / RUN_FILE}: no 'settings' object (the record hf-train writes)")
        flat.update(_flatten({**settings, "steps": run.get("steps")}))
    part = Path(folder) / "engram" / "config.json"
    if path_kind(part) == "a file":
        part_cfg = read_json(member_file(Path(folder) / "engram", "config.json", "the Engram part's"))
        if isinstance(part_cfg, dict):
            flat.update(_flatten(part_cfg, "part."))
    model, seeds = _split_seeds(flat)
    block = seq_len or flat.get("seq_len") or 128
    return FolderRecord(str(folder), kind, model, seeds if recorded else None, int(block))


def check_ngram(ngram: int | None, record: FolderRecord) -> None:
    """Refuse a memory-probe n-gram longer than NGRAM_MAX or than `record`'s blocks (ValueError)."""
    if ngram is None:
        return
    _ngram(None, ngram)
    top = min(NGRAM_MAX, record.seq_len)
    if ngram > top:
        why = (
            f"{record.folder}'s blocks are {record.seq_len} tokens" if top < NGRAM_MAX else "the most probed"
        )
        raise ValueError(f"--ngram {ngram} is too long ({why}): give a whole number from 2 to {top}")


def comparable(folders: Sequence[str | Path], seq_len: int | None = None) -> list[FolderRecord]:
    """The `FolderRecord`s of folders compared as seeds of one model: of one kind, no folder twice (a
    symlink or a trailing slash resolves to the same), configs equal but for the seeds. ValueError on the
    first that is not, naming the folders and the fields that differ."""
    records = [describe(f, seq_len) for f in folders]
    kinds = {r.kind for r in records}
    if len(kinds) > 1:
        listed = ", ".join(f"{r.folder} ({r.kind})" for r in records)
        raise ValueError(f"folders of two kinds ({listed}): give the seeds of one model, one kind at a time")
    seen: dict[Path, str] = {}
    for r in records:
        real = Path(r.folder).resolve()
        if real in seen:
            raise ValueError(
                f"{r.folder} is {seen[real]} again: one run has no seed spread; give each folder once"
            )
        seen[real] = r.folder
    first = records[0]
    for r in records[1:]:
        keys = sorted(set(first.config) | set(r.config))
        diff = [k for k in keys if first.config.get(k) != r.config.get(k)]
        if diff:
            shown = ", ".join(f"{k} ({first.config.get(k)!r} vs {r.config.get(k)!r})" for k in diff[:6])
            more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
            raise ValueError(
                f"{first.folder} and {r.folder} are not seeds of one model: they differ in {shown}{more}; "
                "give runs whose configs differ only in the seed"
            )
    return records


# ------------------------------------------------------------------------------------------ tables
@dataclass
class TableSlot:
    """One Engram table of a model: `holder.<attr>` is it (`table` of an Engram module, `ngram_embed` of
    the LM), `weight` its rows in float32 [rows, dim] (the reference), `stored` what it holds."""

    layer: str
    holder: nn.Module
    attr: str
    weight: torch.Tensor
    stored: str

    @property
    def original(self) -> EngramTable:
        return getattr(self.holder, self.attr)


def _reference_rows(table: EngramTable, device: torch.device) -> tuple[torch.Tensor, str]:
    """(rows in float32 [rows, dim] on `device`, what the table stores): a float table's weight as it is,
    any other (FP8 / INT8 / 4-bit, in memory or memory-mapped) dequantised row chunk by row chunk."""
    if isinstance(table, TrainableTable):
        w = table.weight.detach()
        return w.float(), str(w.dtype).removeprefix("torch.")
    if isinstance(table, QuantTable):
        return dequantize_table(table.weight, table.scale, torch.float32).to(device), table.row_format.value
    with torch.no_grad():
        parts = [
            table.gather(torch.arange(s, min(s + _CHUNK_ROWS, table.num_rows)), torch.float32).to(device)
            for s in range(0, table.num_rows, _CHUNK_ROWS)
        ]
    fmt = getattr(table, "row_format", None)
    return torch.cat(parts), fmt.value if isinstance(fmt, RowFormat) else type(table).__name__


def _slot(layer: str, holder: nn.Module, attr: str) -> TableSlot:
    table = getattr(holder, attr)
    device = next((p.device for p in holder.parameters() if p is not getattr(table, "weight", None)), None)
    weight, stored = _reference_rows(table, device or torch.device("cpu"))
    return TableSlot(layer, holder, attr, weight, stored)


def lm_slots(model: nn.Module) -> list[TableSlot]:
    """The tables of an `EngramLM`: each Engram layer's, and the n-gram input embedding's."""
    slots = [_slot(lid, m, "table") for lid, m in model.engrams.items()]  # type: ignore[union-attr]
    if getattr(model, "ngram_embed", None) is not None:
        slots.append(_slot("input", model, "ngram_embed"))
    return slots


def hf_slots(model: nn.Module) -> list[TableSlot]:
    """The tables of an HF model with Engram attached (`engram.hf`)."""
    from engram.hf.attach import get_attachment

    return [_slot(lid, m, "table") for lid, m in get_attachment(model).layers.items()]


Stored = tuple[torch.Tensor, torch.Tensor]  # a table's (values, scales) in one row format


def quantised(slots: Sequence[TableSlot], fmt: RowFormat) -> list[Stored]:
    """Every slot's float rows quantised to `fmt` once: what `tables_as` swaps in and `worst_rows` measures."""
    return [quantize_table(s.weight, fmt) for s in slots]


@contextlib.contextmanager
def tables_as(
    slots: Sequence[TableSlot], fmt: RowFormat | None, stored: Sequence[Stored] | None = None
) -> Iterator[None]:
    """Every slot's table in row format `fmt` while inside (`stored`: its bytes from `quantised`, made
    here when not given); None: the float rows (the original table when it is float). The original
    tables come back afterwards."""
    if fmt is not None and stored is None:
        stored = quantised(slots, fmt)
    saved: list[tuple[TableSlot, EngramTable]] = []
    try:
        for i, s in enumerate(slots):
            if fmt is not None:
                assert stored is not None
                table: EngramTable = QuantTable(*stored[i], fmt)
            elif isinstance(s.original, TrainableTable):
                continue
            else:
                table = TrainableTable.from_weight(s.weight)
            saved.append((s, s.original))
            setattr(s.holder, s.attr, table)
        yield
    finally:
        for s, original in reversed(saved):
            setattr(s.holder, s.attr, original)


class RowErrors(NamedTuple):
    """The dequantisation error of a table [rows, dim]: per row the largest |error| and the relative
    error ||error|| / ||row|| (0 for a zero row); over the table the summed squares of the error and of
    the rows (their ratio's square root is the table's relative error)."""

    max_abs: torch.Tensor
    rel: torch.Tensor
    err_sq: float
    ref_sq: float

    @property
    def table_rel(self) -> float:
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else 0.0


def row_errors(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> RowErrors:
    """How far the stored rows (`values`, `scales`: `weight` quantised, any row format) dequantise from
    `weight` [rows, dim], row chunk by row chunk."""
    n = weight.shape[0]
    max_abs = torch.empty(n, dtype=torch.float32)
    rel = torch.empty(n, dtype=torch.float32)
    err_sq = ref_sq = 0.0
    for s in range(0, n, _CHUNK_ROWS):
        w = weight[s : s + _CHUNK_ROWS].float()
        back = dequantize_table(values[s : s + _CHUNK_ROWS], scales[s : s + _CHUNK_ROWS], torch.float32)
        e = (back - w).double()
        e_norm, w_norm = e.norm(dim=1), w.double().norm(dim=1)
        max_abs[s : s + w.shape[0]] = e.abs().amax(dim=1).float().cpu()
        rel[s : s + w.shape[0]] = (
            torch.where(w_norm > 0, e_norm / w_norm.clamp_min(1e-300), 0.0).float().cpu()
        )
        err_sq += float(e_norm.square().sum())
        ref_sq += float(w_norm.square().sum())
    return RowErrors(max_abs, rel, err_sq, ref_sq)


def worst_rows(
    slots: Sequence[TableSlot], stored: Sequence[Stored], top: int
) -> tuple[list[dict[str, Any]], float]:
    """The `top` rows of all tables with the largest |error| in their stored form (`quantised`'s), and
    all tables' relative error."""
    found: list[dict[str, Any]] = []
    err_sq = ref_sq = 0.0
    for s, (values, scales) in zip(slots, stored, strict=True):
        e = row_errors(s.weight, values, scales)
        err_sq, ref_sq = err_sq + e.err_sq, ref_sq + e.ref_sq
        vals, idx = e.max_abs.topk(min(top, e.max_abs.numel()))
        found += [
            {"layer": s.layer, "row": int(r), "max_abs_error": float(v), "relative_error": float(e.rel[r])}
            for v, r in zip(vals, idx, strict=True)
        ]
    found.sort(key=lambda d: (-d["max_abs_error"], d["layer"], d["row"]))
    return found[:top], math.sqrt(err_sq / ref_sq) if ref_sq > 0 else 0.0


def sizes(fmt: RowFormat | None, dim: int, float_bytes: int = 4) -> dict[str, Any]:
    """Bytes a row of width `dim` in `fmt` (None: float of `float_bytes` a value), the same at V4.1's
    rows (head_dim 256) and V4.1's two tables in GB (10^9 B): its total rows x bytes a row."""
    v41 = EngramConfig.preset(V41)
    rows = Layout(v41).total_rows
    here = dim * float_bytes if fmt is None else fmt.row_bytes(dim)
    there = v41.head_dim * float_bytes if fmt is None else fmt.row_bytes(v41.head_dim)
    return {"bytes_per_row": here, "v41_bytes_per_row": there, "v41_table_gb": rows * there / 1e9}


# ------------------------------------------------------------------------------------------ scoring
@dataclass
class _Scorer:
    """What one folder's evaluation needs: the model, its tables, `score()` (held-out loss and next-token
    accuracy split by the memory mask), and what the result says about the data."""

    model: nn.Module
    slots: list[TableSlot]
    score: Callable[[], dict[str, Any]]
    info: dict[str, Any]


def _run_scorer(
    model_path: str | Path,
    batch_size: int,
    max_tokens: int | None,
    ngram: int | None,
    device: torch.device,
    precision: Precision,
) -> _Scorer:
    """A training run's newest checkpoint, scored on its own held-out split as `engram eval` scores it
    (`evaluate`'s windows and sums: the float table's loss is `engram eval`'s)."""
    from engram.apps.lm.evaluation import eval_summary, score_windows
    from engram.apps.lm.run_checkpoint import check_run_tokenizer, checkpoint_tokenizer, load_trained_model
    from engram.apps.lm.train import prepare_data

    cfg, model, state = load_trained_model(model_path, device=device)
    if not model.needs_rows:
        raise ValueError(
            f"{state['path']} is a model without Engram (a baseline): there is no table to quantise"
        )
    saved = checkpoint_tokenizer(state["path"], model.config.vocab_size)
    data = prepare_data(cfg)
    check_run_tokenizer(Path(state["path"]), saved, data.tokenizer, cfg.tokenizer)
    stream, rows, seq = data.held_out, data.held_rows, cfg.seq_len
    n = _ngram(model.config.engram, ngram)
    starts = stream.eval_starts(seq, max_tokens)
    blocks = torch.from_numpy(stream.ids[starts[:, None] + np.arange(seq + 1)])  # (N, T+1): inputs, targets
    mask = seen_mask(blocks, ngram_set([data.train.ids.tolist()], n), n)

    @torch.no_grad()
    def score() -> dict[str, Any]:
        was = model.training
        model.eval()
        k = len(stream.categories)
        loss_sum, count = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
        preds = []
        with autocast(device, precision):
            for i in range(0, len(starts), batch_size):
                logits = score_windows(
                    model, stream, rows, starts[i : i + batch_size], seq, loss_sum, count, 1.0, device
                )
                preds.append(logits.argmax(-1).cpu())
        model.train(was)
        ev = eval_summary(stream, loss_sum, count)
        return {
            "loss": ev["loss"],
            "tokens": ev["tokens"],
            "next_token": split_accuracy(torch.cat(preds), blocks, mask),
        }

    info = {
        "checkpoint": state["path"],
        "step": state["step"],
        "ngram": n,
        "text": "the run's held-out split",
    }
    return _Scorer(model, lm_slots(model), score, info)


def _ngram(config: EngramConfig | None, ngram: int | None) -> int:
    """The memory probe's n-gram length: given, else Engram's longest key and the target."""
    if ngram is not None:
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 2:
            raise ValueError(f"--ngram {ngram!r}: give a whole number >= 2 (context tokens and the target)")
        return ngram
    assert config is not None
    return config.max_ngram_size + 1


def _hf_scorer(
    folder: str | Path,
    corpus: str | None,
    held_text: str | None,
    seq_len: int | None,
    held_out: float | None,
    max_blocks: int | None,
    batch_size: int,
    ngram: int | None,
    device: torch.device,
    precision: Precision,
) -> _Scorer:
    """An engram.hf folder, scored on `corpus`'s held-out blocks (split as `hf-train` split it: the
    folder's engram_train.json gives the corpus, seq_len, held_out and eval_blocks not given), or with
    `held_text` on that file's blocks, the whole corpus then the training text (`study pretrained`)."""
    from engram.apps.hf.corpus import HELD_OUT, read_corpus, read_documents, split_blocks
    from engram.apps.hf.folder import EVAL_BLOCKS, RUN_FILE, check_folder, load_model, load_tokenizer
    from engram.hf.attach import get_attachment

    check_folder(folder)
    if path_kind(Path(folder) / "engram") != "a folder":
        raise ValueError(
            f"{folder} has no Engram part (engram/): there is no table to quantise; give the folder "
            "`engram hf-train` wrote"
        )
    run_file = Path(folder) / RUN_FILE
    saved = json.loads(run_file.read_text())["settings"] if path_kind(run_file) == "a file" else {}
    corpus = corpus or saved.get("corpus")
    if corpus is None:
        raise ValueError(f"{folder} records no training corpus ({RUN_FILE}): give --corpus FILE")
    seq_len = seq_len or saved.get("seq_len", 128)
    max_blocks = saved.get("eval_blocks", EVAL_BLOCKS) if max_blocks is None else max_blocks
    tok = load_tokenizer(str(folder))
    if held_text is not None:
        # as `study pretrained` reads its corpus/{train,held}.txt: documents joined by blank lines, no EOS
        texts = ["\n\n".join(read_documents(f)) for f in (corpus, held_text)]
        train_ids, held_ids = tok(texts, add_special_tokens=False)["input_ids"]
        blocks = split_blocks(held_ids, seq_len, 0.0)[0]
        where = f"{held_text} (trained on {corpus})"
    else:
        held_out = saved.get("held_out", HELD_OUT) if held_out is None else held_out
        if held_out == 0:
            raise ValueError(
                f"{folder}'s run held nothing out of {corpus} (held_out 0): give --held-text FILE (for a "
                "`study pretrained` run: OUT/corpus/held.txt) or --held-out FRACTION"
            )
        c = read_corpus(corpus, tok, seq_len, held_out)
        train_ids, blocks = c.train.flatten().tolist(), c.held
        where = f"the held-out {held_out:g} of {corpus}"
    blocks = blocks[: max_blocks or None]
    if blocks.shape[0] == 0:
        raise ValueError(f"{held_text or corpus} gives no held-out block of {seq_len} tokens: give more text")
    model = load_model(str(folder), tokenizer=tok)
    model.to(device)
    n = _ngram(get_attachment(model).config, ngram)
    mask = seen_mask(blocks, ngram_set([train_ids], n), n)

    def score() -> dict[str, Any]:
        with autocast(device, precision):
            pred, loss = greedy_predictions_and_loss(model, blocks, batch_size)
        return {
            "loss": loss["loss"],
            "tokens": loss["tokens"],
            "next_token": split_accuracy(pred, blocks, mask),
        }

    info = {"ngram": n, "text": where, "seq_len": seq_len, "blocks": int(blocks.shape[0])}
    return _Scorer(model, hf_slots(model), score, info)


def check_folder(
    folder: str | Path,
    formats: Sequence[RowFormat] = tuple(RowFormat),
    *,
    top: int = 5,
    ngram: int | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    corpus: str | None = None,
    held_text: str | None = None,
    seq_len: int | None = None,
    held_out: float | None = None,
    max_blocks: int | None = None,
    device: torch.device | None = None,
    precision: Precision = Precision.FLOAT32,
) -> dict[str, Any]:
    """The float reference, then each of `formats`, on one folder (a training run or an engram.hf
    folder: `folder_kind`), `batch_size` sequences a forward (default: `engram eval`'s 32 for a run,
    `hf-eval`'s 8 for an HF folder). `max_tokens` applies to a run (a fixed sample of its held-out split; None:
    all of it), `corpus`, `held_text`, `seq_len`, `held_out`, `max_blocks` to an HF folder."""
    device = torch.device("cpu") if device is None else device
    record = describe(folder, seq_len)
    check_ngram(ngram, record)  # before any work: a long n-gram's set outgrows memory
    kind = record.kind
    if kind == FolderKind.RUN:
        hf_only = {
            "corpus": corpus,
            "held_text": held_text,
            "seq_len": seq_len,
            "held_out": held_out,
            "max_blocks": max_blocks,
        }
        given = [k for k, v in hf_only.items() if v is not None]
        if given:
            raise ValueError(
                f"{folder} is a training run, scored on its own held-out split: drop "
                f"{', '.join('--' + k.replace('_', '-') for k in given)} (for HF folders)"
            )
        sc = _run_scorer(folder, batch_size or 32, max_tokens, ngram, device, precision)
    else:
        if max_tokens is not None:
            raise ValueError(f"{folder} is an HF folder: drop --max-tokens (a run's), use --max-blocks")
        if held_text is not None and held_out is not None:
            raise ValueError(
                f"--held-out {held_out:g} splits --corpus, but --held-text gives the held-out text (the whole "
                "corpus then the training text): drop one"
            )
        sc = _hf_scorer(
            folder,
            corpus,
            held_text,
            seq_len,
            held_out,
            max_blocks,
            batch_size or 8,
            ngram,
            device,
            precision,
        )
    if top < 0:
        raise ValueError(f"--worst {top}: give a whole number >= 0")
    dim = sc.slots[0].weight.shape[1]
    stored = sorted({s.stored for s in sc.slots})
    with tables_as(sc.slots, None):
        ref = sc.score()
    rows: list[dict[str, Any]] = [
        {
            "format": REFERENCE,
            "stored": ", ".join(stored),
            **sizes(None, dim),
            **ref,
            "loss_change": 0.0,
            "table_relative_error": 0.0,
            "worst_rows": [],
        }
    ]
    for fmt in dict.fromkeys(formats):
        stored_as = quantised(sc.slots, fmt)
        with tables_as(sc.slots, fmt, stored_as):
            r = sc.score()
        worst, rel = worst_rows(sc.slots, stored_as, top)
        del stored_as  # one format's tables at a time: freed before the next is quantised
        rows.append(
            {
                "format": fmt.value,
                **sizes(fmt, dim),
                **r,
                "loss_change": r["loss"] - ref["loss"],
                "table_relative_error": rel,
                "worst_rows": worst,
            }
        )
    tables = [
        {"layer": s.layer, "rows": s.weight.shape[0], "dim": s.weight.shape[1], "stored": s.stored}
        for s in sc.slots
    ]
    seed = None if record.seed is None else dict(record.seed)
    return {"folder": str(folder), "kind": kind, "seed": seed, **sc.info, "tables": tables, "formats": rows}
