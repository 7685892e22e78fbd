"""What an Engram part was trained on: the base model's architecture (its config's sizes) and a sampled
fingerprint of its weights (`SAMPLES` values of every tensor, at fixed positions), recorded by every
part writer (`save_engram`, `export_fp8`, the row-sharded writers of `engram.distributed`) in the
part's sealed metadata (`BASE_MODEL_KEY`), and compared by `load_engram` (with the model it attaches
to) and the vLLM plugin (with the served folder's weight files).

A part on another base of the same shapes (a freshly initialised model, another fine-tune) loads, with a
`BaseModelWarning` naming what differs: a warning, not a refusal, since a part moved on purpose to a
close relative of its base (a further fine-tune) may still help; Engram's rows and projections were
fitted to its base's hidden states and mean little on an unrelated model's. The comparison allows a
cast (saved in float32, loaded in bfloat16): values within `RTOL` are the same. Sampled, not a hash:
a few changed weights go unnoticed, another model or initialisation does not; its cost is a few reads
per tensor (SmolLM2: 272 tensors), never a pass over the weights.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from engram.checkpoint.files import member_file, open_tensors
from engram.checkpoint.json_file import read_json

__all__ = [
    "CONFIG_FIELDS",
    "INDEX_FILE",
    "RTOL",
    "SAMPLES",
    "SHAPE_FIELDS",
    "WEIGHTS_FILE",
    "BaseModelWarning",
    "base_differences",
    "base_record",
    "check_folder_base",
    "check_model_base",
    "config_fields",
    "file_weights",
    "model_weights",
    "weight_files",
]

SAMPLES = 8  # values of each tensor recorded
RTOL = 1e-2  # a sampled value within 1 % is the same (bfloat16 rounds by at most 0.4 %)
SHAPE_FIELDS = (  # the config's sizes that the weights' shapes follow
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# the config values that make an architecture: compared when both sides have them
CONFIG_FIELDS = ("model_type", *SHAPE_FIELDS, "hidden_act", "tie_word_embeddings")
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class BaseModelWarning(UserWarning):
    """An Engram part was attached to (or served with) another base model than the one it was trained on."""


# ------------------------------------------------------------------------------------------- recording
def _positions(numel: int) -> list[int]:
    """SAMPLES flat positions spread over a tensor, first and last included (fewer for a small one)."""
    k = min(SAMPLES, numel)
    return [0] if k == 1 else sorted({i * (numel - 1) // (k - 1) for i in range(k)})


def _samples(t: torch.Tensor) -> list[float]:
    if isinstance(t, DTensor):  # sharded by FSDP2: a collective, every rank samples in the same order
        t = t.full_tensor()
    flat = t.detach().reshape(-1)
    idx = torch.tensor(_positions(flat.numel()), device=flat.device)
    return [float(f"{v:.6g}") for v in flat[idx].to(torch.float64).cpu().tolist()]


def _plain_name(name: str) -> str | None:
    """A parameter's name as the plain model has it: a peft wrapper's prefix and base layer dropped,
    its adapters (lora_*) skipped (None)."""
    if "lora_" in name:
        return None
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def model_weights(model: nn.Module) -> dict[str, tuple[list[int], list[float]]]:
    """{name: (shape, samples)} of the base model's parameters: Engram's own left out, a tied parameter
    once (its first name), a peft model's under the plain model's names."""
    engram = getattr(model, "engram", None)
    skip = {id(p) for p in engram.parameters()} if isinstance(engram, nn.Module) else set()
    out: dict[str, tuple[list[int], list[float]]] = {}
    for n, p in model.named_parameters():
        name = _plain_name(n)
        if name is None or id(p) in skip or p.is_meta or p.numel() == 0:
            continue
        out[name] = (list(p.shape), _samples(p))
    return out


def config_fields(config: Any) -> dict[str, Any]:
    """The CONFIG_FIELDS of an HF config (an object or the dict of its config.json; a multimodal one's
    text config), those it has; an Engram model's `model_type` is its base's."""
    if isinstance(config, Mapping):
        d = config.get("text_config", config) if isinstance(config.get("text_config"), Mapping) else config
        out = {k: d[k] for k in CONFIG_FIELDS if k in d and isinstance(d[k], str | int | float | bool)}
        base = d.get("base_model_type")
    elif config is None:
        return {}
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        out = {}
        for k in CONFIG_FIELDS:
            v = getattr(text, k, None)
            if isinstance(v, str | int | float | bool):
                out[k] = v
        base = getattr(text, "base_model_type", None)
    if isinstance(base, str):  # an Engram model (engram.hf.auto): the architecture is its base's
        out["model_type"] = base
    return out


def base_record(model: nn.Module) -> str:
    """The BASE_MODEL_KEY value a part written from `model` records: JSON of its config's sizes and its
    weights' samples (`model_weights`). Every rank of a row-sharded write calls it (FSDP2 parameters are
    sampled by a collective)."""
    return json.dumps(
        {"config": config_fields(getattr(model, "config", None)), "weights": model_weights(model)},
        separators=(",", ":"),
    )


# ------------------------------------------------------------------------------------------ comparing
def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))


def base_differences(
    saved: Mapping[str, Any], config: Mapping[str, Any], weights: Mapping[str, tuple[list[int], list[float]]]
) -> list[str]:
    """What differs between a part's record (`saved`, the parsed base_record) and a base model (its
    `config_fields` and `{name: (shape, samples)}` of the tensors the record names): [] when it is the
    same model."""
    diffs = []
    want_cfg = saved.get("config", {})
    cfg = [
        f"{k} {want_cfg[k]!r} then, {config[k]!r} now"
        for k in sorted(want_cfg)
        if k in config and config[k] != want_cfg[k]
    ]
    if cfg:
        diffs.append("config.json: " + ", ".join(cfg))
    want_w = saved.get("weights", {})
    missing = [n for n in want_w if n not in weights]
    if missing:
        diffs.append(f"{len(missing)} of its {len(want_w)} tensors are not there (e.g. {missing[0]})")
    shapes = [n for n in want_w if n in weights and list(weights[n][0]) != list(want_w[n][0])]
    if shapes:
        n = shapes[0]
        diffs.append(
            f"{len(shapes)} tensors have other shapes (e.g. {n}: {list(want_w[n][0])} then, {list(weights[n][0])} now)"
        )
    values = [
        n
        for n in want_w
        if n in weights
        and n not in shapes
        and not all(_same(a, b) for a, b in zip(want_w[n][1], weights[n][1], strict=False))
    ]
    if values:
        n = values[0]
        i = next(
            i for i, (a, b) in enumerate(zip(want_w[n][1], weights[n][1], strict=False)) if not _same(a, b)
        )
        diffs.append(
            f"{len(values)} of {len(want_w)} tensors hold other values (e.g. {n}: {want_w[n][1][i]:.6g} then, "
            f"{weights[n][1][i]:.6g} now, at one of {SAMPLES} sampled positions)"
        )
    return diffs


def _parsed(raw: str, part: str) -> dict[str, Any]:
    try:
        saved = json.loads(raw)
        if not isinstance(saved, dict) or not isinstance(saved.get("weights", {}), dict):
            raise TypeError
    except (ValueError, TypeError, RecursionError):
        raise ValueError(
            f"{part}: its base-model record is not the JSON a part writer records: save the part again"
        ) from None
    return saved


def _warn(saved: Mapping[str, Any], config: Any, weights: Mapping[str, Any], part: str, base: str) -> None:
    diffs = base_differences(saved, config_fields(config), weights)
    if diffs:
        warnings.warn(
            f"{part} was trained on another base model than {base}: {'; '.join(diffs)}. Engram's rows and "
            "projections were fitted to the hidden states of the model it was trained with: attach it to that "
            "model (or train a part for this one)",
            BaseModelWarning,
            stacklevel=4,
        )


def check_model_base(raw: str | None, model: nn.Module, part: str) -> None:
    """A BaseModelWarning when the record `raw` (a part's BASE_MODEL_KEY; None: the part records none,
    nothing to compare) names another base than `model` (its config, a sample of its weights)."""
    if raw is not None:
        _warn(
            _parsed(raw, part),
            getattr(model, "config", None),
            model_weights(model),
            part,
            type(model).__name__,
        )


def check_folder_base(raw: str | None, folder: str | os.PathLike[str], part: str) -> None:
    """`check_model_base` against the model an HF folder holds, from its files: config.json and a sample
    of the tensors its safetensors files hold (those the record names), without loading the model."""
    if raw is None:
        return
    saved = _parsed(raw, part)
    config = read_json(member_file(folder, "config.json", "the model folder's"))
    weights = file_weights(folder, saved.get("weights", {}))
    _warn(saved, config if isinstance(config, dict) else {}, weights, part, f"the model in {folder}")


# --------------------------------------------------------------------------------- weights from files
def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of an HF folder: the shards its model.safetensors.index.json names, else
    its model.safetensors; [] for a folder of other weights (pytorch_model.bin). Each a regular file
    inside the folder (`member_file`)."""
    d = Path(folder)
    if os.path.lexists(d / INDEX_FILE):
        index_path = member_file(d, INDEX_FILE, "the model folder's")
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(
                f"{index_path}: no 'weight_map' of tensor names to file names; restore the index the weights "
                "were saved with"
            )
        return [
            member_file(d, name, f"{index_path} maps tensors to") for name in sorted(set(weight_map.values()))
        ]
    if os.path.lexists(d / WEIGHTS_FILE):
        return [member_file(d, WEIGHTS_FILE, "the model folder's")]
    return []


def file_weights(
    folder: str | os.PathLike[str], names: Iterable[str]
) -> dict[str, tuple[list[int], list[float]]]:
    """{name: (shape, samples)} of the tensors `names` that an HF folder's safetensors files hold (read
    through the files' mappings: a few pages each)."""
    wanted = set(names)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for path in weight_files(folder):
        f = open_tensors(path)
        for name in f:
            if name in wanted:
                t = f.tensor(name)
                out[name] = (list(t.shape), _samples(t))
    return out
