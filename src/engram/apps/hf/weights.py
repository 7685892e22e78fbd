"""An HF model folder's files checked before transformers reads any (`engram hf-train` / `hf-eval`):
no file of the folder a symlink out of it (the checkpoint readers' rule, `member_path`), every
safetensors weight file's header against its size (a truncated or cut file), and config.json against
the weights: the model config.json describes, built on the meta device (no memory, no weights), must
have each tensor's shape, every parameter and no more blocks than the files hold. A folder
transformers would refuse with a traceback, or load with random weights where the files lack them, is
one ValueError naming the file, the value and the fix. Knows files and configs, not training.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from engram.checkpoint.files import member_path, open_tensors
from engram.hf.base import SHAPE_FIELDS, weight_files

__all__ = ["check_links", "check_weights", "reason"]

_BLOCK = re.compile(r"^(.*?)\.(\d+)\.")  # "model.layers.5.mlp..." -> ("model.layers", "5")


def check_links(folder: str | os.PathLike[str]) -> None:
    """Refuse a folder any of whose entries is a symlink resolving outside it: transformers reads
    config.json, the weights and the tokenizer's files by name, and a checkpoint reads only files
    inside its folder (`engram.checkpoint.files.member_path`)."""
    d = Path(folder)
    for entry in sorted(os.listdir(d)):
        member_path(d, entry, f"the model folder {d} holds")


def reason(e: BaseException) -> str:
    """What a library's refusal says, on one line: the innermost cause's message (huggingface_hub wraps
    a config's ValueError in a validation error whose own first line says nothing)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return " ".join(str(e).split()) or type(e).__name__


def _dims(config: Any) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [f"{k} {getattr(text, k)}" for k in SHAPE_FIELDS if isinstance(getattr(text, k, None), int)]
    return ", ".join(found)


def _meta_model(folder: Path, config: Any) -> torch.nn.Module:
    """The model config.json describes, on the meta device: shapes without memory (an Engram model's
    backbone: its `engram/` part is checked by its reader)."""
    import transformers

    try:
        with torch.device("meta"):
            if getattr(config, "model_type", None) == "engram":  # its backbone: the part is checked apart
                from engram.hf.auto import base_model_class

                return base_model_class(config)._from_config(config)
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers' own refusals of a config (ValueError and others): the input's
        raise ValueError(
            f"{folder / 'config.json'} describes a model transformers cannot build ({reason(e)}): restore the "
            "config.json the weights were saved with"
        ) from None


def check_weights(folder: str | os.PathLike[str], config: Any) -> None:
    """Check an HF folder's safetensors weights before they load: each file's header against its size
    (safetensors refuses a file its header does not cover: truncated, cut by a byte), and `config`
    (the folder's config.json, read) against them: each tensor the model and the files share has the
    model's shape, no parameter of the model is missing from the files (transformers would initialise it
    at random), no block (`model.layers.N`) of the files is beyond the model's. ValueError naming the
    file, the tensor, the values and the fix. Names the model and the files do not share at all (a
    checkpoint saved under other names, which transformers maps itself) are not compared."""
    d = Path(folder)
    files = weight_files(d)
    if not files:
        return
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in files:
        f = open_tensors(path)  # header against size: a truncated file is refused here, naming it
        for name, e in f.entries().items():
            shapes[name] = (e.shape, path)
    model = _meta_model(d, config)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    shared = sorted(set(shapes) & set(expected))
    if not shared:
        return
    fix = f"config.json ({_dims(config)}) does not describe these weights: restore the config.json they were saved with"
    for name in shared:
        (got, path), want = shapes[name], expected[name]
        if got != want:
            raise ValueError(
                f"{path}: tensor {name!r} is {list(got)}, but {fix} (it makes {name} {list(want)})"
            )
    aliases: dict[int, list[str]] = defaultdict(list)  # tied parameters: one tensor, several names
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(n)
    missing = sorted(names[0] for names in aliases.values() if not any(n in shapes for n in names))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(
            f"{files[0] if len(files) == 1 else d}: no tensor {missing[0]!r}{more} of the model, so transformers "
            f"would draw them at random: {fix}"
        )
    model_blocks, file_blocks = defaultdict(set), defaultdict(set)
    for names, blocks in ((expected, model_blocks), (shapes, file_blocks)):
        for n in names:
            m = _BLOCK.match(n)
            if m:
                blocks[m.group(1)].add(int(m.group(2)))
    for container in sorted(set(model_blocks) & set(file_blocks)):
        extra = sorted(file_blocks[container] - model_blocks[container])
        if extra:
            raise ValueError(
                f"{files[0] if len(files) == 1 else d}: the weights hold {container}.{extra[0]}"
                f"{f' .. {extra[-1]}' if len(extra) > 1 else ''}, which the model lacks ({container} "
                f"{min(model_blocks[container])}..{max(model_blocks[container])}), so transformers would drop "
                f"them: {fix}"
            )
