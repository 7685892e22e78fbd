"""An HF causal-LM folder for `engram hf-train` / `hf-eval`: the checks that read nothing heavy
(config.json, a tokenizer, weights; depth and width), loading its tokenizer and model with errors that
name the folder, the held-out loss of a model, and `evaluate_folder` (a folder with or without its
Engram part, and with memory patches applied, on a corpus split as `hf-train` split it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engram.apps.hf.corpus import HELD_OUT, SEQ_LEN_ONE, read_corpus, read_documents
from engram.apps.hf.weights import check_links, check_weights, reason
from engram.apps.memory.files import apply_patches, describe, read_patches
from engram.checkpoint.files import member_file
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.json_file import read_json
from engram.device import Precision, autocast

__all__ = [
    "EVAL_BLOCKS",
    "RUN_FILE",
    "check_folder",
    "evaluate_folder",
    "held_out_loss",
    "load_engram_folder",
    "load_model",
    "load_tokenizer",
    "model_depth",
]

EVAL_BLOCKS = 64  # held-out blocks evaluated before and after training (8K tokens at 128): bounded cost
RUN_FILE = "engram_train.json"  # in a folder hf-train wrote: the settings and results of the run
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_folder(folder: str | os.PathLike[str]) -> Any:
    """The HF config of a causal-LM folder, after checking it holds config.json, a tokenizer and weights,
    no file linked from outside it, and weights whose headers cover their files and whose shapes are
    the config's (`engram.apps.hf.weights`); no tensor is read."""
    d = Path(folder)
    kind = path_kind(d)
    if kind is None:
        raise FileNotFoundError(
            f"{folder}: no such folder; give an HF model folder (config.json, weights, tokenizer)"
        )
    if kind != "a folder":
        raise ValueError(f"{folder} is {kind}: give an HF model folder (config.json, weights, tokenizer)")
    if path_kind(d / "config.json") != "a file":
        raise ValueError(
            f"{folder} has no config.json, so it is not an HF model folder: give the folder "
            "model.save_pretrained() wrote"
        )
    if not any(path_kind(d / f) == "a file" for f in _TOKENIZER_FILES):
        raise ValueError(
            f"{folder} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): save the model's tokenizer "
            f"into it (tokenizer.save_pretrained({str(folder)!r}))"
        )
    if not any(path_kind(d / f) == "a file" for f in _WEIGHT_FILES):
        raise ValueError(
            f"{folder} has no weights (none of {', '.join(_WEIGHT_FILES)}): save the model into it "
            f"(model.save_pretrained({str(folder)!r}))"
        )
    check_links(d)  # no file read from outside the folder
    import transformers

    read_json(d / "config.json")  # damaged JSON: one line naming the file
    try:
        config = transformers.AutoConfig.from_pretrained(str(d))
    except Exception as e:  # transformers' refusals of a config come in several types: all the input's
        raise ValueError(
            f"{folder}/config.json cannot be read by transformers ({reason(e)}); restore the config.json of "
            "the model, or give an HF model folder"
        ) from None
    check_weights(d, config)  # truncated files, a config that does not fit the weights
    return config


def model_depth(config: Any) -> tuple[int, int]:
    """(decoder layers, hidden size) of an HF config (`engram.hf.io.config_sizes`)."""
    from engram.hf.io import config_sizes

    depth, hidden, _ = config_sizes(config)
    return depth, hidden


def load_tokenizer(folder: str) -> Any:
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file
        raise ValueError(
            f"{folder}: its tokenizer cannot be read "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
            "save the model's tokenizer into it again (tokenizer.save_pretrained(folder))"
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
    return tok


def load_model(
    folder: str, *, engram: bool = True, tokenizer: Any = None, part: Any = None, verify: bool = False
) -> nn.Module:
    """The causal LM of an HF folder in float32, with its Engram part when it has one: a folder engram-lm
    wrote (model type `engram`) through `from_pretrained`, an older one (a plain config.json beside
    `engram/`) through `load_engram`. `part`: the part `read_engram` read already (checked before the
    model loads). `engram=False`: the backbone of a plain folder, for attaching a new part (an Engram
    model's folder is refused: its part would be dropped)."""
    import transformers

    from engram.hf.io import folder_model_type

    has_part = path_kind(Path(folder) / "engram") == "a folder"
    engram_model = has_part and folder_model_type(folder) == "engram"  # the callers checked the folder
    if not engram and has_part:
        raise ValueError(
            f"{folder} holds an Engram model (its engram/ part): Engram is attached to a plain backbone; give "
            "the backbone's folder (the one the Engram model was trained from)"
        )
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if engram_model:
        kwargs["engram_part" if part is not None else "engram_verify"] = part if part is not None else verify
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except MemoryError:
        raise
    except (ValueError, FileNotFoundError) as e:
        if engram_model:  # our refusal of the part: already one line naming the file and the fix
            raise
        raise _cannot_load(folder, e) from None
    except Exception as e:  # what check_folder could not foresee: transformers' refusal, in one line
        raise _cannot_load(folder, e) from None
    if has_part and not engram_model:  # a folder written before Engram models had their own type
        from engram.hf.io import attach_part, load_engram, warn_if_older_folder

        warn_if_older_folder(folder)
        if part is not None:
            attach_part(model, part)
        else:
            load_engram(model, folder, tokenizer=tokenizer, verify=verify)
    return model


def _require_engram(folder: str, why: str) -> None:
    """Refuse a folder without an Engram part (engram/) for `why` (what needs one), with the fix."""
    if path_kind(Path(folder) / "engram") != "a folder":
        raise ValueError(
            f"{folder} has no Engram part (engram/), so {why}: train one with `engram hf-train {folder} "
            "--corpus TEXT --out DIR` first, and give DIR"
        )


def load_engram_folder(folder: str, *, verify: bool = False) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of an HF folder with its Engram part, its tables in memory (quantised ones
    too: rows a memory patch writes); a folder without Engram is refused, naming the fix. The part is
    checked before the backbone loads, as `evaluate_folder` checks it."""
    from engram.hf.io import read_folder_engram

    hf_config = check_folder(folder)
    _require_engram(folder, "it has no Engram rows to write facts into")
    tok = load_tokenizer(folder)
    read = read_folder_engram(folder, hf_config, tokenizer=tok, verify=verify, mmap=False)
    return load_model(folder, part=read), tok


def _cannot_load(folder: str, e: BaseException) -> ValueError:
    return ValueError(
        f"{folder}: transformers cannot load it as a causal LM ({reason(e)}): give a folder "
        "AutoModelForCausalLM.from_pretrained reads"
    )


@torch.no_grad()
def held_out_loss(
    model: nn.Module, blocks: torch.Tensor, batch_size: int = 8, precision: Precision = Precision.FLOAT32
) -> dict[str, float]:
    """Mean next-token cross-entropy (nats/token) over `blocks` [n, T], and its perplexity, on the
    model's device (`precision` bf16: the forwards under autocast; the loss in float64)."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        ids = blocks[i : i + batch_size].to(device)
        with autocast(device, precision):
            logits = model(input_ids=ids).logits
        logits = logits[:, :-1].double()
        total += float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        )
        count += ids[:, 1:].numel()
    model.train(was)
    if count == 0:
        raise ValueError("no held-out tokens to evaluate: give a larger corpus or a larger --held-out")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}


def evaluate_folder(
    folder: str,
    corpus: str,
    *,
    seq_len: int | None = None,
    held_out: float | None = None,
    max_blocks: int | None = None,
    batch_size: int = 8,
    device: torch.device | None = None,
    precision: Precision = Precision.FLOAT32,
    verify: bool = False,
    patches: Sequence[str] = (),
) -> dict[str, Any]:
    """Loss of an HF folder (with its Engram part when it has `engram/`) on a corpus's held-out blocks:
    the split of `hf-train`, its `seq_len`, `held_out` and `eval_blocks` read from the folder's
    engram_train.json when not given (else 128, 5% and 64). `held_out=0`: the whole corpus;
    `max_blocks=0`: every block. On `device` (default the CPU) in `precision`. The part is checked as
    `load_engram` checks it (every tensor's CRC32, tables over 256 MiB only with `verify`; another base
    model: a `BaseModelWarning`). `patches`: memory patch files applied in that order before the
    evaluation (`engram.memory`; one that does not fit the model is refused, naming its file)."""
    if seq_len == 1:
        raise ValueError(SEQ_LEN_ONE)
    files = read_patches(patches)  # checked before anything heavy is read
    docs = read_documents(corpus)
    hf_config = check_folder(folder)
    if files:
        _require_engram(folder, "a memory patch has no rows to write")
    saved = {}
    if os.path.lexists(Path(folder) / RUN_FILE):
        run = read_json(member_file(folder, RUN_FILE, "the model folder's record of its training run"))
        saved = run.get("settings") if isinstance(run, dict) else None
        if not isinstance(saved, dict):
            raise ValueError(
                f"{Path(folder) / RUN_FILE}: no 'settings' object (the record hf-train writes); restore the "
                "file, or remove it and give --seq-len and --held-out"
            )
    seq_len = seq_len or saved.get("seq_len", 128)
    held_out = saved.get("held_out", HELD_OUT) if held_out is None else held_out
    max_blocks = saved.get("eval_blocks", EVAL_BLOCKS) if max_blocks is None else max_blocks
    tok = load_tokenizer(folder)
    c = read_corpus(corpus, tok, seq_len, held_out, docs)
    blocks = (c.held if held_out > 0 else c.train)[: max_blocks or None]
    if blocks.shape[0] == 0:
        raise ValueError(
            f"{corpus} gives no block of {seq_len} tokens to evaluate ({c.tokens:,} tokens): give more text "
            "or a smaller --seq-len"
        )
    has_engram = path_kind(Path(folder) / "engram") == "a folder"
    read = None
    if has_engram:  # checked and read before the backbone loads: a damaged part costs no model load
        from engram.hf.io import read_folder_engram

        read = read_folder_engram(folder, hf_config, tokenizer=tok, verify=verify, mmap=not files)
    model = load_model(folder, part=read)
    apply_patches(model, files)  # on the CPU, before the move: the tables' original rows stay there
    if device is not None:
        model.to(device)
    result = held_out_loss(model, blocks, batch_size, precision)
    return {
        "folder": str(folder),
        "engram": has_engram,
        "device": str(next(model.parameters()).device),
        "precision": precision.value,
        "corpus": str(corpus),
        "seq_len": seq_len,
        "held_out": held_out,
        "blocks": blocks.shape[0],
        "patches": [
            {k: d[k] for k in ("path", "name", "facts", "rows", "fingerprint")} for d in map(describe, files)
        ],
        **result,
    }
