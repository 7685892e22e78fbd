"""`engram hf-train`: Engram on a Hugging Face causal-LM folder without writing Python (the command
lives in `engram.cli.hf`; the corpus is `engram.apps.hf_corpus`'s, the folder checks, loading and
held-out loss `engram.apps.hf_folder`'s).

Holds the run's settings and defaults (layers from the model's depth, table rows from its size), the
checks before anything heavy (table memory estimated before allocating, OUT, a run to resume), and
`train_folder`: load, attach with `engram.hf.add_engram` (zero-init), train with the HF `Trainer`
(backbone frozen, LoRA via peft or full; checkpoints and resume), write one folder atomically (HF's
files with LoRA merged, the Engram part, the tokenizer, a model card). Everything Engram-specific is
`engram.hf`'s (attach, collator, optimizer, save / load): no second implementation here.
"""

from __future__ import annotations

import enum
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.apps.hf_corpus import HELD_OUT, read_corpus, read_documents
from engram.apps.hf_folder import (
    EVAL_BLOCKS,
    RUN_FILE,
    check_folder,
    held_out_loss,
    load_model,
    load_tokenizer,
    model_depth,
)
from engram.apps.input_files import path_kind

__all__ = [
    "CARD_FILE",
    "HFTrainSettings",
    "TrainMode",
    "check_layers",
    "check_out",
    "check_table_memory",
    "default_layers",
    "default_table_rows",
    "partial_folder",
    "table_bytes",
    "train_folder",
]

CARD_FILE = "README.md"  # in OUT: the model card
_SETTINGS_FILE = "settings.json"  # in the partial folder: what --resume must match
_ENGRAM_STATE = "engram_state.safetensors"  # in a LoRA run's checkpoints: peft saves the adapters only
_ORDERS = 2  # n-gram orders 2 and 3 (max_ngram_size 3)


class TrainMode(enum.Enum):
    FROZEN = "frozen"  # the backbone frozen: Engram alone trains
    LORA = "lora"  # LoRA adapters (peft) on the backbone's linear layers, merged into OUT's weights
    FULL = "full"  # every parameter


@dataclass(frozen=True)
class HFTrainSettings:
    """One `engram hf-train` run. `layers` / `table_rows` None: the defaults of the model's depth and size."""

    folder: str
    corpus: str
    out: str
    layers: tuple[int, ...] | None = None
    table_rows: int | None = None
    heads: int = 4
    head_dim: int | None = None  # None: 32 below hidden size 256, else 64
    mode: TrainMode = TrainMode.FROZEN
    lora_rank: int = 8
    engram: bool = True
    steps: int | None = None
    tokens: int | None = None
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-4
    table_lr: float = 1e-2
    seed: int = 0
    checkpoint_every: int = 0
    held_out: float = HELD_OUT
    eval_blocks: int = EVAL_BLOCKS  # the held-out blocks evaluated, from the first (0: all)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TrainMode):
            if self.mode not in {m.value for m in TrainMode}:
                raise ValueError(f"mode={self.mode!r}: give one of {[m.value for m in TrainMode]}")
            object.__setattr__(self, "mode", TrainMode(self.mode))
        for name in ("heads", "lora_rank", "batch_size", "seq_len", "steps", "tokens", "table_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a whole number >= 1")
        for name in ("checkpoint_every", "eval_blocks", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a whole number >= 0")
        for name in ("lr", "table_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a finite number > 0")
        if self.steps is not None and self.tokens is not None:
            raise ValueError("give --steps or --tokens, not both")
        if not self.engram and self.mode is TrainMode.FROZEN:
            raise ValueError(
                "--no-engram with --mode frozen trains nothing: give --mode lora or --mode full for a "
                "baseline"
            )
        if not self.engram and (self.layers is not None or self.table_rows is not None):
            raise ValueError("--layers and --table-rows describe Engram: drop them with --no-engram")
        if not 0 <= self.held_out < 1:
            raise ValueError(f"--held-out {self.held_out}: give a fraction in [0, 1), e.g. 0.05")

    @property
    def num_steps(self) -> int:
        if self.tokens is not None:
            return max(1, math.ceil(self.tokens / (self.batch_size * self.seq_len)))
        return 200 if self.steps is None else self.steps

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = self.mode.value
        d["layers"] = None if self.layers is None else list(self.layers)
        return d


# ------------------------------------------------------------------------------------------- checks
def default_layers(depth: int) -> tuple[int, ...]:
    """Engram early and in the middle, as V4.1 (layers 1 and 14 of 30 or more): one layer below 8 layers."""
    if depth < 2:
        return (0,)
    return (1,) if depth < 8 else (1, depth // 2 - 1)


def check_layers(layers: Sequence[int], depth: int, folder: str) -> tuple[int, ...]:
    bad = [i for i in layers if not 0 <= i < depth]
    if bad:
        raise ValueError(
            f"--layers {','.join(map(str, layers))}: {bad} out of range: {folder} has {depth} decoder layers "
            f"(ids 0..{depth - 1}); give ids in that range, e.g. --layers "
            f"{','.join(map(str, default_layers(depth)))}"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"--layers {','.join(map(str, layers))} names a layer twice; give each once")
    return tuple(sorted(layers))


def default_head_dim(hidden: int) -> int:
    return 32 if hidden < 256 else 64


def default_table_rows(backbone_params: int, n_layers: int, head_dim: int) -> int:
    """Rows per layer so that the tables hold about half as many parameters as the backbone (at least
    4096 rows a layer): Engram's memory grows with the model it serves."""
    return max(4096, backbone_params // (2 * n_layers * head_dim))


def table_bytes(rows: int, n_layers: int, head_dim: int) -> int:
    """Bytes the tables take while training: float32 weights and SparseRowAdam's state (a float32
    momentum per value, a second moment and a step per row)."""
    return n_layers * rows * (8 * head_dim + 8)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_table_memory(rows: int, n_layers: int, head_dim: int, available: int | None = None) -> None:
    """Refuse tables that would not fit in the memory available now (estimated before any allocation)."""
    need = table_bytes(rows, n_layers, head_dim)
    available = available_memory() if available is None else available
    if available is not None and need > available:
        fit = max(1, available // (2 * n_layers * (8 * head_dim + 8)))
        raise ValueError(
            f"--table-rows {rows:,}: {n_layers} table(s) of {rows:,} rows x {head_dim} need about "
            f"{need / 1e9:.3g} GB to train (float32 weights + Adam state), but this machine has "
            f"{available / 1e9:.3g} GB available: give --table-rows {fit:,} or fewer"
        )


def partial_folder(out: str | os.PathLike[str]) -> Path:
    """Where a run writes before OUT exists: checkpoints, then OUT's files, renamed to OUT at the end."""
    o = Path(out)
    return o.parent / f".{o.name}.engram-partial"


def check_out(out: str | os.PathLike[str]) -> None:
    o = Path(out)
    kind = path_kind(o)
    if kind is None:
        return
    if kind != "a folder":
        raise ValueError(f"--out {out} is {kind}: give a new folder")
    if any(o.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty: give a new folder (or remove this one)")


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
    (stage / RUN_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    (stage / CARD_FILE).write_text(_card(summary))
    out = Path(s.out)
    if out.is_dir():
        out.rmdir()  # empty (checked): the rename below replaces it
    os.replace(stage, out)
    shutil.rmtree(work)
    return summary


def _card(r: dict[str, Any]) -> str:
    s, b, e = r["settings"], r["backbone"], r["engram"]
    mode = {
        "frozen": "backbone frozen (Engram alone trained)",
        "lora": f"LoRA rank {r['lora_rank']} on the decoder layers' linear layers, merged into the weights",
        "full": "every parameter trained",
    }[r["mode"]]
    lines = [
        f"# {Path(r['out']).name}",
        "",
        f"`{b['class']}` from `{b['folder']}` ({b['layers']} layers, hidden {b['hidden_size']}, "
        f"{b['parameters']:,} parameters), continued by `engram hf-train` on `{s['corpus']}`.",
        "",
    ]
    if e is None:
        lines.append("- Engram: none (`--no-engram`: the baseline)")
    else:
        lines.append(
            f"- Engram attached at decoder layer(s) {e['layers']}: {e['rows_per_layer']:,} table rows "
            "a layer "
            f"(n-gram orders {e['orders']}, {e['heads']} hash heads, rows {e['head_dim']} wide), "
            f"{e['table_parameters']:,} table parameters, {e['parameters']:,} in all; the value projection "
            "started at zero (the model unchanged at step 0)"
            + (
                "; n-gram windows restart after EOS (documents are packed)"
                if e["boundaries"] == "eos"
                else ""
            )
            + ". The part is in `engram/`."
        )
    held = r["held_out"]
    lines += [
        f"- Training: {mode}; {r['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens = "
        f"{r['tokens']:,} "
        f"tokens ({r['tokens'] / max(r['train_seconds'], 1e-9):.0f} tokens/s); lr {s['lr']:g}"
        + (f", table lr {s['table_lr']:g}" if e else "")
        + f", seed {s['seed']}.",
        f"- Final training loss: {r['final_train_loss']:.4f}." if r["final_train_loss"] is not None else "",
        (
            f"- Held-out loss (last {s['held_out']:.0%} of the corpus): {held['loss']:.4f} nats/token "
            f"(perplexity {held['perplexity']:.2f}) over {held['tokens']:,} tokens; before training "
            f"{r['held_out_before']['loss']:.4f}."
        )
        if held
        else "",
        "",
        "Load it:",
        "",
        "```python",
        "import transformers",
        "from engram.hf import load_engram",
        f'model = transformers.AutoModelForCausalLM.from_pretrained("{Path(r["out"]).name}")',
    ]
    if e is not None:
        lines.append(f'model = load_engram(model, "{Path(r["out"]).name}")')
    lines += [
        "```",
        "",
        f"`engram hf-eval {Path(r['out']).name} --corpus {s['corpus']}` measures it again.",
        "",
    ]
    return "\n".join(line for line in lines if line is not None) + "\n"
