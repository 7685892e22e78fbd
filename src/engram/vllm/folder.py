"""The folder vLLM serves: an HF model's files plus the Engram part `engram.hf` wrote beside them.

`read_part` finds the part (`<folder>/engram/`, as `engram.hf.save_engram` / `export_fp8` put it
after `model.save_pretrained(folder)`), and checks it against the backbone vLLM is about to build
before anything is loaded: `engram.hf.io.check_part`'s checks (hidden size, layers, vocabulary, the
compression map's fingerprint against the tokenizer.json, attachment options: the ones `load_engram`
runs), then what serving adds: the variant (the V4.1 module: the others carry a convolution over past
hidden states, which vLLM's KV cache does not keep) and the tables' storage. Every refusal names the
value and the fix; a part recorded for another base model than the folder's weights is served with a
`BaseModelWarning` (`engram.hf.base`). Knows files and configs, nothing of vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engram.addressing.compression import TokenizerCompression
from engram.checkpoint.input_files import path_kind
from engram.checkpoint.v41 import BASE_MODEL_KEY, recorded_metadata, stored_tables
from engram.config import EngramConfig, Variant
from engram.hf.base import check_folder_base
from engram.hf.io import PART_FOLDER, TOKENIZER_FILE, check_part, part_folder

__all__ = ["TOKENIZER_FILE", "EngramPart", "PartError", "read_part"]


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
    fp8: bool  # the part stores its tables quantised (export_fp8, or export_quantised: INT8 / 4-bit), else float
    tokenizer: str | None = None  # the tokenizer.json the compression map was checked against; None: none


class PartError(ValueError):
    """A served folder whose Engram part cannot serve the backbone (the message names value and fix)."""


def _tokenizer_file(d: Path, tokenizer_dir: str | os.PathLike[str] | None) -> Path:
    """The tokenizer.json to check the compression map against: in `tokenizer_dir` (vLLM's tokenizer
    folder), else in the served folder. A tokenizer folder that is missing or not a folder is refused."""
    if tokenizer_dir is None:
        return d / TOKENIZER_FILE
    tok = Path(tokenizer_dir)
    kind = path_kind(tok)
    if kind != "a folder":
        raise PartError(
            f"the tokenizer folder {tok} is {kind or 'missing'}, so the Engram part of {d} cannot be checked "
            "against its tokenizer: give vLLM the folder that holds the model's tokenizer.json"
        )
    return tok / TOKENIZER_FILE


def read_part(
    folder: str | os.PathLike[str],
    *,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> EngramPart:
    """Find and check the Engram part of `folder` for a backbone of `hidden_size`, `num_layers` decoder
    layers and `vocab_size` ids (`engram.hf.io.check_part`, then the variant and the tables' storage).
    The compression map is checked against `tokenizer_dir/tokenizer.json` (default: the folder's); with
    no tokenizer.json there (vLLM with skip_tokenizer_init serves token ids) it is not checked, and a
    TokenizerNotCheckedWarning says so. Raises PartError (or FileNotFoundError for a missing part or
    file) naming the value and the fix; nothing is loaded."""
    d = Path(folder)
    missing = (
        f"{d} has no Engram part ({d / PART_FOLDER} is missing), so it would serve without Engram: write it "
        f"with engram.hf.save_engram(model, {str(d)!r}) after model.save_pretrained({str(d)!r}); to serve the "
        "backbone alone, drop the Engram architecture name from vLLM's hf_overrides"
    )
    try:
        part = part_folder(d / PART_FOLDER, missing, inside=d)
        checked = check_part(
            part,
            backbone=f"the backbone in {d}",
            hidden_size=hidden_size,
            num_layers=num_layers,
            vocab_size=vocab_size,
            tokenizer_file=_tokenizer_file(d, tokenizer_dir),
        )
        config = checked.config
        if config.variant is not Variant.V4_1:
            raise PartError(
                f"{part} holds Engram variant {config.variant.value!r}; the vLLM plugin serves "
                f"{Variant.V4_1.value!r} only (the other variants convolve past positions' hidden states, "
                "which vLLM's KV cache does not keep): serve this model with engram.hf and HF generate()"
            )
        _, fp8_tables = stored_tables(part, config)
        # the backbone vLLM loads from the folder's files: the one the part was trained on? (a warning)
        check_folder_base(recorded_metadata(part, BASE_MODEL_KEY), d, str(part))
    except PartError:
        raise
    except ValueError as e:
        raise PartError(str(e)) from None
    fp8 = bool(fp8_tables)
    if fp8 and len(fp8_tables) != len(config.layer_ids):
        raise PartError(f"{part}: some layers' tables are quantised and some float; save the part again")
    return EngramPart(
        d, part, config, checked.compression, checked.boundaries, checked.eos_token_id, fp8, checked.tokenizer
    )
