"""The models of `engram study memorize` (engram.apps.study.memorize): `Subject` (a base model, its
tokenizer and held-out blocks, how to get its logits, its last decoder layer and LoRA's targets, for
an HF model with Engram and for the demo's `EngramLM` alike), and where each comes from: the HF folder
(--model; else `engram study pretrained`'s Engram-alone run under OUT; else Engram trained on a
backbone as that arm trains it) and the demo LM (--demo-run; else a preset trained once here).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.apps.hf.folder import RUN_FILE, check_folder, load_engram_folder, load_model, model_depth
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
from engram.apps.study.memorize_probes import Logits
from engram.apps.study.pretrained import base_folder, pretrained_plan
from engram.checkpoint.input_files import path_kind
from engram.memory import EngramLayers, Fact
from engram.memory.memorize import encode_facts

__all__ = [
    "Subject",
    "demo_folder",
    "demo_subject",
    "encode_text",
    "held_blocks",
    "hf_folder",
    "hf_subject",
    "pretrained_engram_run",
]


def encode_text(tok: Any, text: str, special: bool) -> list[int]:
    if hasattr(tok, "encode_batch"):  # tokenizers' Tokenizer (the demo's)
        return list(tok.encode(text, add_special_tokens=special).ids)
    return list(tok.encode(text, add_special_tokens=special))


def _fingerprint(*paths: Path) -> str:
    """A hash of the files under `paths` (names, sizes; the JSON files' contents)."""
    h = hashlib.sha256(b"memorize-v1")
    for p in paths:
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{f.stat().st_size}\n".encode())
            if f.suffix == ".json" or not p.is_dir():
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class Subject:
    """A model under study: the base model (CPU, eval mode), its tokenizer, the demo's hasher (its rows
    are hashed outside it; None for an HF model), and its held-out blocks."""

    key: str  # "hf" or "demo"
    name: str
    source: str
    how: str
    model: nn.Module
    tokenizer: Any
    hasher: NgramHasher | None
    fingerprint: str
    max_len: int
    held: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))

    @property
    def pad(self) -> int:
        return getattr(getattr(self.model, "config", None), "pad_token_id", None) or 0  # memorize's

    def layers(self, model: nn.Module) -> EngramLayers:
        return EngramLayers.of(model, self.hasher)

    def logits(self, model: nn.Module) -> Logits:
        if self.hasher is None:
            return lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits
        hasher = self.hasher

        def demo(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            dead = mask == 0
            rows = torch.as_tensor(np.asarray(hasher.hash(ids.numpy(), dead.numpy())))
            return model(ids, rows, dead_mask=dead)

        return demo

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        if self.hasher is not None:
            return list(model.blocks)  # type: ignore[arg-type]
        from engram.hf import find_decoder_layers

        return find_decoder_layers(model)

    def lora_targets(self, model: nn.Module) -> str:
        if self.hasher is None:
            return lora_targets(model)
        names = {
            n.rpartition(".")[2]
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("blocks.")
        }
        return rf"^blocks\.\d+\..*\.({'|'.join(sorted(names))})$"

    def questions(self, facts: Sequence[Fact]) -> list[Any]:
        return encode_facts(self.tokenizer, facts, self.max_len)


def pretrained_engram_run(out: Path) -> str | None:
    """The Engram-alone run of `engram study pretrained --out OUT` (its first seed's folder), if the
    study finished there (`<out>/pretrained/results.json` names its runs)."""
    try:
        results = json.loads((out / "pretrained" / "results.json").read_text())
        runs = [r for r in results["runs"] if r.get("arm") == "Engram"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for r in sorted(runs, key=lambda r: r.get("seed", 0)):
        d = out / "runs" / str(r.get("key"))
        if path_kind(d / "engram") == "a folder" and path_kind(d / RUN_FILE) == "a file":
            return str(d)
    return None


def _train_engram(
    out: Path,
    backbone: str,
    train: Path,
    quick: bool,
    progress: bool,
    say: Callable[[str], None],
    device: torch.device | None,
) -> str:
    """Engram on `backbone` trained as `engram study pretrained`'s Engram-alone arm (its plan, seed 0,
    the default layers and rows); `<out>/runs/memorize-engram-<key>/`, resumed if killed."""
    p = pretrained_plan(quick)
    depth, hidden = model_depth(check_folder(backbone))
    params = sum(q.numel() for q in load_model(backbone, engram=False).parameters())
    layers = default_layers(depth)
    s = HFTrainSettings(
        folder=backbone, corpus=str(train), out="-", layers=layers,
        table_rows=default_table_rows(params, len(layers), default_head_dim(hidden)), heads=p.heads,
        mode=TrainMode.FROZEN, lora_rank=p.lora_rank, engram=True, steps=p.steps, batch_size=p.batch_size,
        seq_len=p.seq_len, lr=p.engram_lr, table_lr=p.table_lr, seed=0,
        checkpoint_every=p.checkpoint_every if p.steps >= 2 * p.checkpoint_every > 0 else 0, held_out=0.0,
        eval_blocks=0,
    )  # fmt: skip
    d = {k: v for k, v in s.to_dict().items() if k not in ("out", "folder", "corpus")}
    blob = json.dumps({"s": d, "fp": _fingerprint(Path(backbone), train)}, sort_keys=True)
    run = out / "runs" / f"memorize-engram-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    if path_kind(run / RUN_FILE) != "a file":
        resume = path_kind(partial_folder(run)) is not None
        say(f"Engram on {backbone}: training {p.steps} steps, once" + (" (resuming)" if resume else ""))
        run.parent.mkdir(parents=True, exist_ok=True)
        train_folder(replace(s, out=str(run)), resume=resume, progress=progress, say=say, device=device)
    return str(run)


def hf_folder(
    out: Path,
    model: str | None,
    train: Path,
    *,
    quick: bool,
    progress: bool,
    say: Callable[[str], None],
    device: torch.device | None,
) -> tuple[str, str]:
    """(the HF folder with Engram, how it was found): module docstring."""
    if model is not None:
        check_folder(model)
        if path_kind(Path(model) / "engram") == "a folder":
            return str(model), "given (--model)"
        run = _train_engram(out, str(model), train, quick, progress, say, device)
        return run, f"Engram trained on {model} (--model) as `engram study pretrained`'s Engram arm"
    found = pretrained_engram_run(out)
    if found is not None:
        return found, "`engram study pretrained`'s Engram-alone run under OUT (its first seed)"
    backbone = base_folder(out, None, progress)
    run = _train_engram(out, backbone, train, quick, progress, say, device)
    return (
        run,
        f"Engram trained on {backbone} as `engram study pretrained`'s Engram arm (no pretrained study under OUT)",
    )


def demo_folder(
    out: Path, demo_run: str | None, config: Any, quick: bool, say: Callable[[str], None]
) -> tuple[str, str]:
    """(the demo LM's run folder, how it was found): --demo-run, else `config` (default: the demo preset,
    --quick the tiny one) trained once into `<out>/runs/memorize-demo-<key>/` (written whole, renamed)."""
    if demo_run is not None:
        return str(demo_run), "given (--demo-run)"
    from engram.apps.lm.train import TRAIN_PRESETS, Trainer, build_model, prepare_data

    preset = "tiny" if quick else "demo"
    cfg = config if config is not None else TRAIN_PRESETS[preset]
    key = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
    d = out / "runs" / f"memorize-demo-{key}"
    if not d.is_dir():
        work = d.with_name(d.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)  # a run killed before its end: trained again (minutes)
        say(
            f"demo LM: training {'the given config' if config is not None else f'the {preset} preset'}, {cfg.steps} steps, once"
        )
        data = prepare_data(cfg)
        Trainer(cfg, data, build_model(cfg, data), out_dir=work).run()
        (work / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        os.replace(work, d)
    what = "the given config" if config is not None else f"`engram train --preset {preset}`"
    return str(d), f"{what}, trained here (no --demo-run)"


def held_blocks(s: Subject, text: str, tokens: int, block_len: int, what: str = "held-out") -> torch.Tensor:
    """The first `tokens` of `text` (the `what` text) as blocks of `block_len` (fewer where the model's
    context is shorter); ValueError for a text shorter than one block."""
    ids = encode_text(s.tokenizer, text[: tokens * 8], False)  # 8 characters a token is plenty
    L = min(block_len, s.max_len)
    n = min(tokens, len(ids)) // L
    if n == 0:
        raise ValueError(
            f"the {what} text gives {len(ids)} tokens for {s.name}, fewer than one block of {L}: give a "
            "larger corpus"
        )
    return torch.tensor(ids[: n * L], dtype=torch.long).view(n, L)


def _hf_name(folder: str) -> str:
    """ "<backbone> + Engram" for a folder hf-train wrote (its record names the backbone), else its name."""
    try:
        backbone = json.loads((Path(folder) / RUN_FILE).read_text())["settings"]["folder"]
        return f"{Path(backbone).name} + Engram"
    except (OSError, ValueError, KeyError, TypeError):
        return Path(folder).name


def hf_subject(folder: str, how: str, held: str, tokens: int, block_len: int) -> Subject:
    """An HF Engram folder as the study's subject, its tables in memory (FP8 ones too: patches write
    rows, `engram memorize` loads it so)."""
    model, tok = load_engram_folder(folder)
    model.eval()
    max_len = getattr(model.config, "max_position_embeddings", None) or block_len
    fp = _fingerprint(Path(folder))
    s = Subject("hf", _hf_name(folder), folder, how, model, tok, None, fp, max_len)
    s.held = held_blocks(s, held, tokens, block_len)
    return s


def demo_subject(run: str, how: str, held: str, tokens: int, block_len: int) -> Subject:
    from engram.apps.lm.generate import load_generator

    model, tok, hasher, state = load_generator(run)
    if hasher is None:
        raise ValueError(f"--demo-run {run}: a model without Engram; give the run folder of an Engram model")
    s = Subject(
        "demo",
        "demo LM",
        run,
        how,
        model.eval(),
        tok,
        hasher,
        _fingerprint(Path(state["path"])),
        model.config.max_seq_len,
    )
    s.held = held_blocks(s, held, tokens, block_len)
    return s
