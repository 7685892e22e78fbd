"""Saving and loading the Engram part of an HF model alone, in the V4.1 checkpoint format.

`save_engram` writes the modules (float tables and projections) as safetensors with a config.json
of DeepSeek-V4.1's `engram_*` keys (`engram.checkpoint.v41`), the tokenizer compression map and
the attachment options (into `engram/` when the folder is an HF model's: HF's files are never
touched); `export_fp8` writes the same with FP8 tables (values + ue8m0 scales),
which `MmapFP8Table` and the `engram.systems` tiers serve from host memory or SSD; `load_engram`
attaches either to a backbone (checked before anything is attached).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.addressing.compression import TokenizerCompression
from engram.checkpoint.files import member_file
from engram.checkpoint.json_file import read_json
from engram.checkpoint.tokenizer_fit import COMPRESSION_FILE
from engram.checkpoint.v41 import foreign_config, load_engram_modules, read_checkpoint_config, save_checkpoint
from engram.hf.attach import add_engram, find_decoder_layers, get_attachment, model_hidden_size

__all__ = [
    "COMPRESSION_FILE",
    "OPTIONS_FILE",
    "PART_FOLDER",
    "engram_part",
    "export_fp8",
    "load_engram",
    "read_options",
    "save_engram",
]

OPTIONS_FILE = "engram_hf.json"  # how the part was attached: boundaries, eos_token_id
PART_FOLDER = "engram"  # the part's folder inside an HF model folder (`save_pretrained`'s)


def engram_part(directory: str | os.PathLike[str]) -> Path:
    """The folder of the Engram part for `directory`: `directory` itself, or its `engram/` subfolder
    when it is an HF model folder (`model.save_pretrained(directory)`), so that the part sits beside
    HF's files without touching them."""
    d = Path(directory)
    return d / PART_FOLDER if foreign_config(d) else d


def _save(model: nn.Module, directory: str | os.PathLike[str], fp8: bool) -> Path:
    att = get_attachment(model)
    for lid, m in att.layers.items():
        w = getattr(m.table, "weight", None)
        if isinstance(w, torch.Tensor) and w.shape[0] != m.table.num_rows:
            raise ValueError(
                f"layer {lid}'s table holds {w.shape[0]} of its {m.table.num_rows} rows (row-sharded across "
                "processes): save it with engram.distributed.save_engram / export_fp8, which every rank calls"
            )
    out = engram_part(directory)
    modules = {int(k): m for k, m in att.layers.items()}
    save_checkpoint(out, att.config, modules, fp8=fp8)
    att.compression.save(out / COMPRESSION_FILE)
    options = {"boundaries": att.rows.boundaries, "eos_token_id": att.rows.eos_token_id}
    (out / OPTIONS_FILE).write_text(json.dumps(options, indent=2) + "\n")
    return out


def save_engram(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write the Engram part of `model` (tables in their float dtype) to `directory`; return the part's
    folder. Into an HF model folder (after `model.save_pretrained(directory)`) the part goes to
    `directory/engram/`: no file of HF's is touched, and `load_engram(AutoModelForCausalLM
    .from_pretrained(directory), directory)` loads both."""
    return _save(model, directory, fp8=False)


def export_fp8(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write the Engram part with its tables quantised to V4.1's FP8 (e4m3 values, one ue8m0 scale per
    32), readable by `MmapFP8Table` and `engram.systems.offload_engram`; return the part's folder (as
    `save_engram`: `directory/engram/` inside an HF model folder)."""
    return _save(model, directory, fp8=True)


def read_options(part: str | os.PathLike[str]) -> dict[str, Any]:
    """The attachment options (`boundaries`, `eos_token_id`) an Engram part's folder records; {} for a
    part saved before there were any. Present but unreadable is refused, never skipped."""
    d = Path(part)
    if not os.path.lexists(d / OPTIONS_FILE):
        return {}
    try:  # a folder, a FIFO (never opened: that blocks), a link out of the part: refused
        path = member_file(d, OPTIONS_FILE, f"{d}: the Engram part's attachment options")
    except ValueError as e:
        raise ValueError(
            f"{e}. It records how the part was attached (boundaries, eos_token_id): restore the "
            "JSON file save_engram wrote, or save the part again"
        ) from None
    options = read_json(path)
    if not isinstance(options, dict):
        raise ValueError(
            f"{path}: expected a JSON object ({{'boundaries': ..., 'eos_token_id': ...}}), got "
            f"{type(options).__name__}; restore the file save_engram wrote, or save the part again"
        )
    return options


def load_engram(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    mmap: bool = True,
    decoder_layers: Any = None,
) -> nn.Module:
    """Attach the Engram part saved in `directory` to `model` (a backbone without Engram); returns it.

    `directory` is the part's folder, or an HF model folder whose `engram/` holds it (what
    `save_pretrained` then `save_engram` into one folder give). Refuses, before attaching anything, a
    part saved for another hidden size or for more layers than the model has, and (with `tokenizer`) a
    compression map built for another tokenizer. FP8 tables load memory-mapped (`mmap=True`) or into
    memory; float tables load trainable.
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory}: no such directory (write one with engram.hf.save_engram)")
    d = engram_part(directory)
    if not d.is_dir():
        raise FileNotFoundError(
            f"{directory} is an HF model folder without an Engram part ({d} is missing): save it with "
            f"engram.hf.save_engram(model, {str(directory)!r})"
        )
    config = read_checkpoint_config(d)
    hidden = model_hidden_size(model)
    if hidden is not None and hidden != config.hidden_size:
        raise ValueError(
            f"{d} holds Engram for hidden size {config.hidden_size}, but {type(model).__name__} has "
            f"hidden size {hidden}: load it into the backbone it was trained with"
        )
    n_layers = len(find_decoder_layers(model, decoder_layers))
    if max(config.layer_ids) >= n_layers:
        raise ValueError(
            f"{d} holds Engram for layers {list(config.layer_ids)}, but {type(model).__name__} has "
            f"{n_layers} decoder layers"
        )
    comp_path = d / COMPRESSION_FILE
    if not comp_path.is_file():
        raise FileNotFoundError(f"{comp_path}: missing (the tokenizer compression map save_engram writes)")
    compression = TokenizerCompression.load(comp_path, tokenizer)
    options = read_options(d)
    p = next(iter(model.parameters()), None)
    dtype = p.dtype if p is not None and p.dtype in (torch.float32, torch.bfloat16) else torch.float32
    config, modules = load_engram_modules(d, config, mmap=mmap, dtype=dtype)
    decoder = find_decoder_layers(model, decoder_layers)
    for lid, m in modules.items():
        lp = next(iter(decoder[lid].parameters()), None)
        if lp is not None and lp.device.type != "cpu":
            m.to(lp.device)
    return add_engram(
        model,
        config,
        compression=compression,
        modules=modules,
        decoder_layers=decoder_layers,
        boundaries=options.get("boundaries"),
        eos_token_id=options.get("eos_token_id"),
    )
