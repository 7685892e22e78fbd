"""`engram hf-train`: Engram on a Hugging Face causal-LM folder without writing Python (the command
lives in `engram.cli.hf`; the corpus is `engram.apps.hf.corpus`'s, the folder checks, loading and
held-out loss `engram.apps.hf.folder`'s).

Holds `train_folder`: the checks before anything heavy (`hf_train_settings`: the run's settings,
defaults from the model, table memory, OUT, a run to resume), then load, attach with
`engram.hf.add_engram` (zero-init), train with the HF `Trainer` (backbone frozen, LoRA via peft or
full; checkpoints and resume: `callbacks`), and write one folder atomically (HF's files with
LoRA merged, the Engram part, the tokenizer; the summary and card: `out`). On the ranks of a
torchrun launch (`ranks`) the same run is data-parallel through `engram.distributed`'s public
API: the tables row-sharded or replicated, checkpointed sharded, OUT written by rank 0. Everything
Engram-specific is `engram.hf`'s and `engram.distributed`'s: no second implementation here.

One concept past 500 lines: the one program `engram hf-train` runs, check to folder; its settings,
corpus, output, callbacks, ranks and model-folder checks are their own files in this room.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.apps.hf.callbacks import ENGRAM_STATE, TrainLog, latest_checkpoint, trainer_callbacks
from engram.apps.hf.corpus import read_corpus, read_documents
from engram.apps.hf.folder import (
    check_folder,
    held_out_loss,
    load_model,
    load_tokenizer,
    model_depth,
)
from engram.apps.hf.out import CARD_FILE, write_out
from engram.apps.hf.ranks import LAUNCH, Ranks
from engram.apps.hf.settings import (
    HFTrainSettings,
    TrainMode,
    check_layers,
    check_out,
    check_table_memory,
    default_head_dim,
    default_layers,
    default_table_rows,
    partial_folder,
    table_bytes,
)
from engram.checkpoint.folder_lock import write_lock
from engram.checkpoint.input_files import path_kind
from engram.device import Precision, check_precision, resolve_device

__all__ = [  # the settings and checks re-exported: `engram.apps.hf.train` is the command's one import
    "CARD_FILE",
    "HFTrainSettings",
    "TrainMode",
    "attach_engram",
    "check_layers",
    "check_out",
    "check_table_memory",
    "default_head_dim",
    "default_layers",
    "default_table_rows",
    "engram_config",
    "lora_targets",
    "partial_folder",
    "table_bytes",
    "train_folder",
]

_SETTINGS_FILE = "settings.json"  # in the partial folder: what --resume must match
_ORDERS = 2  # n-gram orders 2 and 3 (max_ngram_size 3)


# ------------------------------------------------------------------------------------------- models
def engram_config(
    model: nn.Module,
    compression: Any,
    layers: tuple[int, ...],
    rows: int,
    heads: int,
    head_dim: int,
    pad: int,
) -> Any:
    """The EngramConfig of a run: orders 2-3, `heads` heads a order, about `rows` rows a layer."""
    from engram.config import EngramConfig
    from engram.hf.attach import model_hidden_size

    base = max(2, math.ceil(rows / (_ORDERS * heads)))
    return EngramConfig(
        name="hf-train",
        layer_ids=layers,
        max_ngram_size=_ORDERS + 1,
        n_heads=heads,
        engram_vocab_size=(base,) * _ORDERS,
        vocab_size=compression.vocab_size,
        compressed_vocab_size=compression.size,
        pad_token_id=pad,
        tokenizer=None,
        head_dim=head_dim,
        hidden_size=model_hidden_size(model),
        hc_mult=1,
    )


def attach_engram(
    model: nn.Module, tok: Any, layers: tuple[int, ...], rows: int, heads: int, head_dim: int
) -> Any:
    """Engram attached as hf-train attaches it (the table's memory checked first, the compression map
    from `tok`, zero-init so the model's outputs are unchanged at step 0); returns its EngramConfig.
    Documents are packed with EOS between them, so n-gram windows restart after it (recorded with the
    part: load_engram and vLLM do the same)."""
    from engram.addressing.compression import TokenizerCompression
    from engram.hf import add_engram

    check_table_memory(rows, len(layers), head_dim)
    compression = TokenizerCompression.from_tokenizer(tok)
    cfg = engram_config(model, compression, layers, rows, heads, head_dim, tok.pad_token_id)
    eos = tok.eos_token_id
    add_engram(
        model, cfg, compression=compression, boundaries=None if eos is None else "eos", eos_token_id=eos
    )
    return cfg


def lora_targets(model: nn.Module) -> str:
    """peft's target_modules: every nn.Linear of the backbone's decoder layers (not Engram's, not the
    LM head), as one regular expression over module names."""
    from engram.hf import find_decoder_layers

    inside = {id(m) for layer in find_decoder_layers(model) for m in layer.modules()}
    names = {
        n.rpartition(".")[2]
        for n, m in model.named_modules()
        if id(m) in inside and type(m).__name__ in ("Linear", "Conv1D")  # Conv1D: GPT-2's linear layers
    }
    if not names:
        raise ValueError(f"{type(model).__name__}: found no linear layers in its decoder layers for LoRA")
    return rf"^(?!engram\.).*\.({'|'.join(sorted(names))})$"


# ------------------------------------------------------------------------------------------- training
def _collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
    return {"input_ids": ids, "labels": ids.clone()}


@dataclass
class _Run:
    """What the checks and the loading found, for the training and the writing."""

    work: Path
    tok: Any
    corpus: Any
    held: torch.Tensor
    model: nn.Module
    train_model: nn.Module  # the model, or its peft wrapper
    depth: int
    hidden: int
    head_dim: int
    rows: int
    backbone_params: int
    cfg: Any  # the EngramConfig (None: --no-engram)
    engram_params: tuple[int, int]  # (table parameters, all Engram parameters): whole tables, any rank
    start_loss: dict[str, float] | None


def _engram_parameters(model: nn.Module) -> tuple[int, int]:
    """(the tables' parameters, all of Engram's): counted whole from the tables' shapes, without
    drawing a lazy table's rows (add_engram under a process group) or reading a shard."""
    tables = sum(m.table.num_rows * m.table.dim for m in model.engram.layers.values())
    other = sum(p.numel() for n, p in model.engram.named_parameters() if not n.endswith(".table.weight"))
    return tables, tables + other


def _record(s: HFTrainSettings, ranks: Ranks) -> dict[str, Any]:
    """What the partial folder records of a run, and a resume must match: the settings and the processes."""
    return {**s.to_dict(), "processes": ranks.world}


def _check_and_load(
    s: HFTrainSettings, ranks: Ranks, resume: bool, device: torch.device, precision: Precision
) -> _Run:
    """Every check (nothing heavy read before they pass), then the model loaded with Engram attached and
    moved to `device`, its held-out loss, LoRA's adapters: this process's own work, no collective."""
    check_out(s.out)
    work = partial_folder(s.out)
    if resume and path_kind(work) is None:  # a mistyped --out, most likely: nothing to continue there
        raise ValueError(
            f"--resume: no earlier run for {s.out} (looked in {work}): check --out, or give "
            "--resume-if-possible to start afresh where there is none"
        )
    if path_kind(work) is not None and not resume:
        raise ValueError(
            f"{work} holds an earlier run for {s.out} (interrupted?): pass --resume to continue it, or "
            "remove it"
        )
    if resume and path_kind(work) is not None and path_kind(work / _SETTINGS_FILE) == "a file":
        saved = {"processes": 1, **json.loads((work / _SETTINGS_FILE).read_text())}
        record = _record(s, ranks)
        diff = sorted(k for k, v in record.items() if saved.get(k) != v)
        if diff:
            raise ValueError(
                f"--resume: the run in {work} was started with other settings ({', '.join(diff)}: "
                f"{', '.join(f'{saved.get(k)!r}' for k in diff)}): give the same options"
                + (" and processes" if "processes" in diff else "")
                + f", or remove {work}"
            )
    ranks.per_rank_batch(s.batch_size)
    docs = read_documents(s.corpus)  # empty / binary / not UTF-8: refused before the model is read
    hf_config = check_folder(s.folder)
    depth, hidden = model_depth(hf_config)
    head_dim = s.head_dim or default_head_dim(hidden)
    layers = check_layers(s.layers, depth, s.folder) if s.layers is not None else default_layers(depth)
    if s.engram and s.table_rows is not None:
        check_table_memory(s.table_rows, len(layers), head_dim)
    tok = load_tokenizer(s.folder)
    corpus = read_corpus(s.corpus, tok, s.seq_len, s.held_out, docs)
    if corpus.train.shape[0] < s.batch_size:
        raise ValueError(
            f"{s.corpus} is smaller than one batch: {corpus.tokens:,} tokens give {corpus.train.shape[0]} "
            f"training block(s) of {s.seq_len} (after holding out {corpus.held.shape[0]}), a batch needs "
            f"{s.batch_size}: give more text, or a smaller --batch-size / --seq-len"
        )
    # ---- load and attach (every rank alike: the same seed, so the same initial tables)
    torch.manual_seed(s.seed)
    model = load_model(s.folder, engram=False)
    backbone_params = sum(p.numel() for p in model.parameters())
    rows = s.table_rows or default_table_rows(backbone_params, len(layers), head_dim)
    cfg = None
    engram_params = (0, 0)
    if s.engram:
        cfg = attach_engram(model, tok, layers, rows, s.heads, head_dim)
        engram_params = _engram_parameters(model)
    # before the optimizer is built; across processes before the tables are sharded, so that their rows
    # are drawn and exchanged on the rank's device (a lazy table moves as its recipe: nothing drawn)
    model.to(device)
    held = corpus.held[: s.eval_blocks or None]
    # across processes, after prepare_data_parallel: a table still to be drawn (add_engram's lazy tables
    # under a process group) is then drawn as the rank's shard only, never whole
    start_loss = (
        held_out_loss(model, held, s.batch_size, precision)
        if held.shape[0] and not ranks.distributed
        else None
    )
    train_model: nn.Module = model
    if s.mode is TrainMode.LORA:
        import peft

        lcfg = peft.LoraConfig(
            r=s.lora_rank, lora_alpha=2 * s.lora_rank, lora_dropout=0.0, target_modules=lora_targets(model)
        )
        with (
            warnings.catch_warnings()
        ):  # peft 0.21 reads a property transformers 5 deprecated: not the user's
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            train_model = peft.get_peft_model(model, lcfg)
    return _Run(
        work, tok, corpus, held, model, train_model, depth, hidden, head_dim, rows, backbone_params, cfg,
        engram_params, start_loss,
    )  # fmt: skip


def train_folder(
    s: HFTrainSettings,
    *,
    resume: bool = False,
    resume_if_possible: bool = False,
    progress: bool = True,
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    distributed: bool = False,
    timeout: float | None = None,
    device: torch.device | None = None,
    precision: Precision = Precision.FLOAT32,
) -> dict[str, Any]:
    """Run `engram hf-train`: every check first, then load, attach, train, write `s.out`; the summary.

    `device` (one process): where to train, default the GPU when there is one (the HF Trainer's own
    choice); across processes each rank's own (its GPU under NCCL, the CPU under gloo), whatever is
    given. `precision` bf16: the Trainer's bf16 mixed precision (autocast; float32 weights and
    optimizer state), the held-out losses under autocast too. Neither is among the settings a resume
    must match: a run resumes on another device, in either precision.
    `resume`: continue the run interrupted for `s.out` (its partial folder), refused where there is none
    (a mistyped OUT, most likely); `resume_if_possible`: continue it if there is one, else start afresh.

    `distributed`: this process is one rank of a torchrun launch whose default process group is started
    (`engram.distributed.init_distributed`); every rank calls this with the same settings. The ranks
    split the global batch (`s.batch_size`), keep the Engram tables one table through
    `engram.distributed.prepare_data_parallel` (`s.table_sync`: row-sharded by default, or replicated;
    the table exchanges bounded by `timeout` seconds, default 300), checkpoint them sharded
    (`EngramShardsCallback`), and rank 0 alone writes OUT; a check that fails on any rank fails on
    every rank (`RefusedOnEveryRank`). Returns the summary on every rank."""
    ranks = Ranks.of_run(distributed)
    if s.table_sync is not None and not ranks.distributed:
        raise ValueError(
            f"--table-sync {s.table_sync} applies across processes: add --distributed ({LAUNCH})"
        )
    if resume and resume_if_possible:
        raise ValueError("give --resume or --resume-if-possible, not both")
    device = resolve_device(ranks.device or device or "auto", "device")
    precision = check_precision(precision, device, "precision")
    launch = {
        **s.to_dict(),
        "resume": resume,
        "resume_if_possible": resume_if_possible,
        "dtype": precision.value,
    }
    ranks.check_same({f"--{k.replace('_', '-')}": v for k, v in launch.items()})
    if not ranks.is_main:
        say = _quiet
    with contextlib.ExitStack() as held:
        # one writer an OUT (its partial folder beside it too): rank 0 holds the lock for the launch,
        # which alone writes OUT; a refusal is every rank's
        with ranks.agreed():
            if ranks.is_main:
                held.enter_context(write_lock(s.out, f"engram hf-train --out {shlex.quote(str(s.out))}"))
        if resume_if_possible:  # continue an earlier run if there is one (every rank sees the same folder)
            resume = path_kind(partial_folder(s.out)) is not None
            if not resume:
                say(
                    f"--resume-if-possible: no earlier run for {s.out} (in {partial_folder(s.out)}): training "
                    "from the start"
                )
        # one process on cuda:N: the Trainer places the model on the current CUDA device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return _train_folder(s, ranks, resume, progress, say, timeout, device, precision)


def _train_folder(
    s: HFTrainSettings,
    ranks: Ranks,
    resume: bool,
    progress: bool,
    say: Callable[[str], None],
    timeout: float | None,
    device: torch.device,
    precision: Precision,
) -> dict[str, Any]:
    """train_folder's work, its arguments checked."""
    import transformers

    with ranks.agreed():
        run = _check_and_load(s, ranks, resume, device, precision)
    model, train_model, work = run.model, run.train_model, run.work
    sync = None
    if s.engram and ranks.distributed:
        from engram.distributed import DEFAULT_COLLECTIVE_TIMEOUT, prepare_data_parallel

        # the ranks' Engram compared (config, initial tables' digests) and the tables kept out of DDP
        sync = prepare_data_parallel(
            train_model, s.table_sync, timeout=DEFAULT_COLLECTIVE_TIMEOUT if timeout is None else timeout
        )
    sharded = sync is not None and sync.value == "sharded"
    if ranks.distributed and run.held.shape[0]:  # every rank: a forward of row-sharded tables is a collective
        run.start_loss = held_out_loss(model, run.held, s.batch_size, precision)
    optimizers: tuple[Any, Any] = (None, None)
    if s.engram:
        from engram.hf import EngramCollator, build_optimizer

        opt = build_optimizer(
            train_model, lr=s.lr, table_lr=s.table_lr, freeze_backbone=s.mode is not TrainMode.FULL
        )
        optimizers = (opt, None)
        collate: Any = EngramCollator(model, pad_token_id=run.tok.pad_token_id)
    else:
        collate = _collate

    # ---- train
    ckpts = work / "checkpoints"
    with ranks.agreed():
        if ranks.is_main:
            work.mkdir(parents=True, exist_ok=True)
            (work / _SETTINGS_FILE).write_text(json.dumps(_record(s, ranks), indent=1) + "\n")
    ckpt = ranks.from_main(latest_checkpoint(ckpts) if resume else None)  # one choice for every rank
    steps = s.num_steps
    args = transformers.TrainingArguments(
        output_dir=str(ckpts),
        max_steps=steps,
        per_device_train_batch_size=ranks.per_rank_batch(s.batch_size),
        learning_rate=s.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        seed=s.seed,
        data_seed=s.seed,
        dataloader_drop_last=True,
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="steps" if s.checkpoint_every else "no",
        save_steps=s.checkpoint_every or 500,
        save_only_model=False,
        save_total_limit=2,  # a checkpoint holds the tables and their Adam state: keep the newest two
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=device.type == "cuda",
        # the CPU by choice, or across processes on gloo (else accelerate sees no distributed launch and
        # every rank would train a model of its own on the whole batch)
        use_cpu=device.type == "cpu",
        bf16=precision is Precision.BF16,
        # frozen and LoRA train Engram's and the adapters' parameters, all used by every forward: DDP
        # need not search the graph for unused ones (full: the architecture's own, so it searches)
        ddp_find_unused_parameters=s.mode is TrainMode.FULL,
    )
    log = TrainLog()
    lora_engram = s.engram and s.mode is TrainMode.LORA
    trainer = transformers.Trainer(
        model=train_model,
        args=args,
        train_dataset=[{"input_ids": b} for b in run.corpus.train],
        data_collator=collate,
        optimizers=optimizers,
        callbacks=trainer_callbacks(progress and ranks.is_main, log, lora_engram, sharded),
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    if trainer.args.world_size != ranks.world:  # an internal invariant: the Trainer must see every rank
        raise RuntimeError(f"the Trainer sees {trainer.args.world_size} process(es) of {ranks.world}")
    if ckpt is not None:
        if lora_engram:
            from safetensors.torch import load_file

            from engram.hf.attach import get_attachment

            # row-sharded tables: their rows are in the checkpoint's shard files (EngramShardsCallback)
            get_attachment(model).load_state_dict(load_file(str(ckpt / ENGRAM_STATE)), strict=not sharded)
        say(f"resuming from {ckpt}")
    elif resume:
        say(f"no checkpoint in {ckpts} to resume: training from the start")
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
    seconds = time.perf_counter() - t0

    # ---- write OUT (rank 0): HF's files (LoRA merged), the Engram part, the tokenizer, the card
    if s.mode is TrainMode.LORA:
        model = train_model.merge_and_unload()  # type: ignore[operator]
    model.eval()
    # every rank: a forward of row-sharded tables is a collective
    end_loss = held_out_loss(model, run.held, s.batch_size, precision) if run.held.shape[0] else None
    stage = work / "out"
    with ranks.agreed():
        if ranks.is_main:
            if stage.exists():
                shutil.rmtree(stage)
            if s.engram:  # an Engram model: HF's files, the part in engram/ (row-sharded: written below)
                model.save_pretrained(str(stage), save_part=not sharded)
            else:
                model.save_pretrained(str(stage))
            run.tok.save_pretrained(str(stage))
    if sharded:
        from engram.distributed import save_engram as save_sharded_engram

        with ranks.agreed():
            try:
                save_sharded_engram(model, stage)  # the tables gathered to rank 0, which writes the part
            except RuntimeError as e:
                if ranks.is_main:
                    raise
                raise ValueError(str(e)) from e  # rank 0 failed to write: its own error is the one agreed
    summary = _summary(s, run, model, ranks, sync, trainer.state.global_step, seconds, log, end_loss)
    summary["device"], summary["precision"] = str(device), precision.value
    with ranks.agreed():
        if ranks.is_main:
            write_out(stage, s.out, summary, work)
    return summary


def _quiet(message: str) -> None:
    """`say` on the ranks other than 0: rank 0 speaks for the launch."""


def _summary(
    s: HFTrainSettings,
    run: _Run,
    model: nn.Module,
    ranks: Ranks,
    sync: Any,
    steps: int,
    seconds: float,
    log: TrainLog,
    end_loss: dict[str, float] | None,
) -> dict[str, Any]:
    cfg = run.cfg
    return {
        "out": str(s.out),
        "backbone": {
            "folder": str(s.folder),
            "class": (getattr(model.config, "base_architectures", None) or [type(model).__name__])[0],
            "layers": run.depth,
            "hidden_size": run.hidden,
            "parameters": run.backbone_params,
        },
        "engram": None
        if cfg is None
        else {
            "layers": list(cfg.layer_ids),
            "rows_per_layer": run.rows,
            "heads": s.heads,
            "head_dim": run.head_dim,
            "orders": list(cfg.orders),
            "boundaries": model.engram.rows.boundaries,
            "table_parameters": run.engram_params[0],
            "parameters": run.engram_params[1],
        },
        "mode": s.mode.value,
        "lora_rank": s.lora_rank if s.mode is TrainMode.LORA else None,
        "processes": ranks.world,
        "table_sync": None if sync is None else sync.value,  # across processes only
        "steps": steps,
        "tokens": steps * s.batch_size * s.seq_len,
        "train_seconds": round(seconds, 3),  # rank 0's (a resumed run: since the resume)
        "final_train_loss": log.losses[-1][1] if log.losses else None,
        "held_out_before": run.start_loss,
        "held_out": end_loss,
        "settings": s.to_dict(),
    }
