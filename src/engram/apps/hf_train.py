"""`engram hf-train`: Engram on a Hugging Face causal-LM folder without writing Python (the command
lives in `engram.cli.hf`; the corpus is `engram.apps.hf_corpus`'s, the folder checks, loading and
held-out loss `engram.apps.hf_folder`'s).

Holds `train_folder`: the checks before anything heavy (`engram.apps.hf_train_settings`: the run's
settings, defaults from the model, table memory, OUT, a run to resume), then load, attach with
`engram.hf.add_engram` (zero-init), train with the HF `Trainer` (backbone frozen, LoRA via peft or
full; checkpoints and resume), and write one folder atomically (HF's files with LoRA merged, the
Engram part, the tokenizer; the summary and card: `engram.apps.hf_train_out`). Everything
Engram-specific is `engram.hf`'s (attach, collator, optimizer, save / load): no second implementation
here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.apps.hf_corpus import read_corpus, read_documents
from engram.apps.hf_folder import (
    check_folder,
    held_out_loss,
    load_model,
    load_tokenizer,
    model_depth,
)
from engram.apps.hf_train_out import CARD_FILE, write_out
from engram.apps.hf_train_settings import (
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
from engram.apps.input_files import path_kind

__all__ = [  # the settings and checks re-exported: `engram.apps.hf_train` is the command's one import
    "CARD_FILE",
    "HFTrainSettings",
    "TrainMode",
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
_ENGRAM_STATE = "engram_state.safetensors"  # in a LoRA run's checkpoints: peft saves the adapters only
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
@dataclass
class _Log:
    losses: list[tuple[int, float]] = field(default_factory=list)


def _callbacks(progress: bool, log: _Log, save_engram_state: bool) -> list[Any]:
    import transformers
    from tqdm.auto import tqdm

    class Progress(transformers.TrainerCallback):
        """A tqdm bar on stderr (the training loss beside it); the losses kept for the card."""

        bar: Any = None

        def on_train_begin(self, args, state, control, **kw):
            self.bar = tqdm(
                total=state.max_steps,
                initial=state.global_step,
                desc="hf-train",
                unit="step",
                disable=not progress,
                file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 10,
            )

        def on_step_end(self, args, state, control, **kw):
            self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                log.losses.append((state.global_step, float(logs["loss"])))
                self.bar.set_postfix(loss=f"{logs['loss']:.3f}")

        def on_train_end(self, args, state, control, **kw):
            self.bar.close()

    class EngramState(transformers.TrainerCallback):
        """peft's checkpoints hold the adapters only: the Engram part goes beside them."""

        def on_save(self, args, state, control, model=None, **kw):
            from safetensors.torch import save_file

            from engram.hf.attach import get_attachment

            att = get_attachment(model)
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            tmp = ckpt / (_ENGRAM_STATE + ".tmp")
            save_file({k: v.detach().contiguous() for k, v in att.state_dict().items()}, str(tmp))
            os.replace(tmp, ckpt / _ENGRAM_STATE)

    return [Progress(), *([EngramState()] if save_engram_state else [])]


def _latest_checkpoint(folder: Path, need: str | None) -> Path | None:
    """The newest complete checkpoint-N in `folder` (trainer_state.json written last; `need` too)."""
    found = []
    for p in folder.glob("checkpoint-*") if folder.is_dir() else []:
        step = p.name.partition("-")[2]
        if step.isdigit() and (p / "trainer_state.json").is_file() and (need is None or (p / need).is_file()):
            found.append((int(step), p))
    return max(found)[1] if found else None


def _collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
    return {"input_ids": ids, "labels": ids.clone()}


def train_folder(
    s: HFTrainSettings,
    *,
    resume: bool = False,
    progress: bool = True,
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> dict[str, Any]:
    """Run `engram hf-train`: every check first, then load, attach, train, write `s.out`; the summary."""
    import transformers

    # ---- the checks that read nothing heavy
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "0", "1"):
        raise ValueError(
            f"engram hf-train runs in one process, but WORLD_SIZE={world} (a torchrun launch?): run it "
            "without "
            "torchrun; on several processes use engram.distributed with the HF Trainer (docs/distributed.md)"
        )
    check_out(s.out)
    work = partial_folder(s.out)
    if path_kind(work) is not None and not resume:
        raise ValueError(
            f"{work} holds an earlier run for {s.out} (interrupted?): pass --resume to continue it, or "
            "remove it"
        )
    if resume and path_kind(work) is not None and path_kind(work / _SETTINGS_FILE) == "a file":
        saved = json.loads((work / _SETTINGS_FILE).read_text())
        diff = sorted(k for k, v in s.to_dict().items() if saved.get(k) != v)
        if diff:
            raise ValueError(
                f"--resume: the run in {work} was started with other settings ({', '.join(diff)}: "
                f"{', '.join(f'{saved.get(k)!r}' for k in diff)}): give the same options, or remove {work}"
            )
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
    # ---- load and attach
    torch.manual_seed(s.seed)
    model = load_model(s.folder)
    backbone_params = sum(p.numel() for p in model.parameters())
    rows = s.table_rows or default_table_rows(backbone_params, len(layers), head_dim)
    cfg = None
    if s.engram:
        check_table_memory(rows, len(layers), head_dim)
        from engram.addressing.compression import TokenizerCompression
        from engram.hf import add_engram

        compression = TokenizerCompression.from_tokenizer(tok)
        cfg = engram_config(model, compression, layers, rows, s.heads, head_dim, tok.pad_token_id)
        # zero-init: the model's outputs unchanged at step 0; documents are packed with EOS between them,
        # so n-gram windows restart after it (recorded with the part: load_engram and vLLM do the same)
        eos = tok.eos_token_id
        add_engram(
            model, cfg, compression=compression, boundaries=None if eos is None else "eos", eos_token_id=eos
        )
    held = corpus.held[: s.eval_blocks or None]
    start_loss = held_out_loss(model, held, s.batch_size) if held.shape[0] else None
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
    optimizers: tuple[Any, Any] = (None, None)
    if s.engram:
        from engram.hf import EngramCollator, build_optimizer

        opt = build_optimizer(
            train_model, lr=s.lr, table_lr=s.table_lr, freeze_backbone=s.mode is not TrainMode.FULL
        )
        optimizers = (opt, None)
        collate: Any = EngramCollator(model, pad_token_id=tok.pad_token_id)
    else:
        collate = _collate

    # ---- train
    work.mkdir(parents=True, exist_ok=True)
    (work / _SETTINGS_FILE).write_text(json.dumps(s.to_dict(), indent=1) + "\n")
    ckpts = work / "checkpoints"
    steps = s.num_steps
    args = transformers.TrainingArguments(
        output_dir=str(ckpts),
        max_steps=steps,
        per_device_train_batch_size=s.batch_size,
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
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    log = _Log()
    lora_engram = s.engram and s.mode is TrainMode.LORA
    trainer = transformers.Trainer(
        model=train_model,
        args=args,
        train_dataset=[{"input_ids": b} for b in corpus.train],
        data_collator=collate,
        optimizers=optimizers,
        callbacks=_callbacks(progress, log, lora_engram),
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    ckpt = _latest_checkpoint(ckpts, _ENGRAM_STATE if lora_engram else None) if resume else None
    if ckpt is not None:
        if lora_engram:
            from safetensors.torch import load_file

            from engram.hf.attach import get_attachment

            get_attachment(model).load_state_dict(load_file(str(ckpt / _ENGRAM_STATE)))
        say(f"resuming from {ckpt}")
    elif resume:
        say(f"no checkpoint in {ckpts} to resume: training from the start")
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
    seconds = time.perf_counter() - t0

    # ---- write OUT: HF's files (LoRA merged), the Engram part, the tokenizer, the card
    if s.mode is TrainMode.LORA:
        model = train_model.merge_and_unload()  # type: ignore[operator]
    model.eval()
    end_loss = held_out_loss(model, held, s.batch_size) if held.shape[0] else None
    stage = work / "out"
    if stage.exists():
        shutil.rmtree(stage)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("engram.")}
    model.save_pretrained(str(stage), state_dict=state)
    tok.save_pretrained(str(stage))
    if s.engram:
        from engram.hf import save_engram

        save_engram(model, stage)
    tokens = trainer.state.global_step * s.batch_size * s.seq_len
    summary = {
        "out": str(s.out),
        "backbone": {
            "folder": str(s.folder),
            "class": type(model).__name__,
            "layers": depth,
            "hidden_size": hidden,
            "parameters": backbone_params,
        },
        "engram": None
        if cfg is None
        else {
            "layers": list(cfg.layer_ids),
            "rows_per_layer": rows,
            "heads": s.heads,
            "head_dim": head_dim,
            "orders": list(cfg.orders),
            "boundaries": model.engram.rows.boundaries,
            "table_parameters": sum(p.numel() for p in model.engram.tables()),
            "parameters": sum(p.numel() for p in model.engram.parameters()),
        },
        "mode": s.mode.value,
        "lora_rank": s.lora_rank if s.mode is TrainMode.LORA else None,
        "steps": trainer.state.global_step,
        "tokens": tokens,
        "train_seconds": round(seconds, 3),  # this process's (a resumed run: since the resume)
        "final_train_loss": log.losses[-1][1] if log.losses else None,
        "held_out_before": start_loss,
        "held_out": end_loss,
        "settings": s.to_dict(),
    }
    write_out(stage, s.out, summary, work)
    return summary
