"""The folder vLLM serves: an HF model's files plus the Engram part `engram.hf` wrote beside them.

`read_part` finds the part (`<folder>/engram/`, as `engram.hf.save_engram` / `export_fp8` put it
after `model.save_pretrained(folder)`), and checks it against the backbone vLLM is about to build
before anything is loaded: its hidden size, its layers, its variant (the V4.1 module: the others
carry a convolution over past hidden states, which vLLM's KV cache does not keep), its tokenizer
(the compression map's fingerprint against the folder's tokenizer.json) and its vocabulary. Every
refusal names the value and the fix. Knows files and configs, nothing of vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engram.addressing.compression import TokenizerCompression
from engram.checkpoint.tokenizer_fit import COMPRESSION_FILE
from engram.checkpoint.v41 import read_checkpoint_config, stored_tables
from engram.config import EngramConfig, Variant
from engram.hf.attach import boundary_config
from engram.hf.io import OPTIONS_FILE, PART_FOLDER, read_options

__all__ = ["TOKENIZER_FILE", "EngramPart", "PartError", "read_part"]

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class EngramPart:
    """A checked Engram part: where it is, its addressing (with the attachment's restart rule applied,
    as `engram.hf.load_engram` applies it) and its compression map."""

    folder: Path  # the served folder (HF's files)
    part: Path  # its Engram part (`folder/engram`)
    config: EngramConfig
    compression: TokenizerCompression
    boundaries: str | None
    eos_token_id: int | None
    fp8: bool  # the part stores its tables in FP8 (export_fp8), else float (save_engram)


class PartError(ValueError):
    """A served folder whose Engram part cannot serve the backbone (the message names value and fix)."""


def read_part(
    folder: str | os.PathLike[str],
    *,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> EngramPart:
    """Find and check the Engram part of `folder` for a backbone of `hidden_size`, `num_layers` decoder
    layers and `vocab_size` ids; the tokenizer is `tokenizer_dir/tokenizer.json` (default: the folder's)
    when there is one. Raises PartError (or FileNotFoundError) naming the value and the fix."""
    d = Path(folder)
    part = d / PART_FOLDER
    if not part.is_dir():
        raise FileNotFoundError(
            f"{d} has no Engram part ({part} is missing), so it would serve without Engram: write it with "
            f"engram.hf.save_engram(model, {str(d)!r}) after model.save_pretrained({str(d)!r}); to serve the "
            "backbone alone, drop the Engram architecture name from vLLM's hf_overrides"
        )
    try:
        config = read_checkpoint_config(part)
    except (ValueError, FileNotFoundError) as e:
        raise PartError(f"{part}: not a readable Engram part: {e}") from None
    if config.variant is not Variant.V4_1:
        raise PartError(
            f"{part} holds Engram variant {config.variant.value!r}; the vLLM plugin serves "
            f"{Variant.V4_1.value!r} only (the other variants convolve past positions' hidden states, which "
            "vLLM's KV cache does not keep): serve this model with engram.hf and HF generate()"
        )
    if config.hc_mult != 1:
        raise PartError(f"{part}: hc_mult={config.hc_mult}, but an HF backbone has one residual stream (1)")
    if config.hidden_size != hidden_size:
        raise PartError(
            f"{part} holds Engram for hidden size {config.hidden_size}, but the backbone in {d} has hidden size "
            f"{hidden_size}: serve the part with the backbone it was trained with"
        )
    bad = [i for i in config.layer_ids if i >= num_layers]
    if bad:
        raise PartError(
            f"{part} holds Engram for layers {list(config.layer_ids)}, but the backbone in {d} has {num_layers} "
            f"decoder layers (ids 0..{num_layers - 1})"
        )
    if config.vocab_size > vocab_size:
        raise PartError(
            f"{part} hashes ids of a vocabulary of {config.vocab_size}, larger than the backbone's "
            f"{vocab_size}: it was built for another tokenizer; save the part of this model again"
        )
    comp_path = part / COMPRESSION_FILE
    if not comp_path.is_file():
        raise FileNotFoundError(f"{comp_path}: missing (the tokenizer compression map save_engram writes)")
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else d
    tok_file = tok / TOKENIZER_FILE
    try:
        compression = TokenizerCompression.load(comp_path, str(tok_file) if tok_file.is_file() else None)
    except ValueError as e:
        raise PartError(
            f"{part}'s compression map does not fit the tokenizer {tok_file}: {e}; serve the part with the "
            "tokenizer it was saved with"
        ) from None
    try:
        options = read_options(part)
    except (ValueError, OSError) as e:
        raise PartError(str(e)) from None
    boundaries, eos = options.get("boundaries"), options.get("eos_token_id")
    try:  # as engram.hf.load_engram attaches it: 'eos' becomes the hasher's restart rule
        config = boundary_config(config, boundaries, eos)
    except ValueError as e:
        raise PartError(f"{part / OPTIONS_FILE}: {e}") from None
    try:
        _, fp8_tables = stored_tables(part, config)
    except ValueError as e:
        raise PartError(f"{part}: {e}") from None
    fp8 = bool(fp8_tables)
    if fp8 and len(fp8_tables) != len(config.layer_ids):
        raise PartError(f"{part}: some layers' tables are FP8 and some float; save the part again")
    return EngramPart(d, part, config, compression, boundaries, eos, fp8)
