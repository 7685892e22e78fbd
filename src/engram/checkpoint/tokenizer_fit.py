"""Whether a V4.1-format checkpoint's config.json fits the tokenizer its token ids come from: the
compression map that hashes them, and the check of the config against it (`check_tokenizer_fit`).
`engram run-layer` and `engram convert` both call it, so a config one refuses the other does not
write. Knows the checkpoint's files and the known tokenizers' maps, nothing of tables or modules.
"""

from __future__ import annotations

import os
from pathlib import Path

from engram.addressing.compression import TokenizerCompression, known_compression
from engram.addressing.hashing import check_compression
from engram.checkpoint.files import member_file
from engram.checkpoint.v41 import CONFIG_FILE
from engram.config import EngramConfig, Variant

__all__ = ["COMPRESSION_FILE", "V41_TOKENIZER", "check_tokenizer_fit"]

V41_TOKENIZER = "deepseek-v4"  # the tokenizer V4.1's hash is defined on
COMPRESSION_FILE = "compression.safetensors"  # the map an engram.hf part saves beside its tables


def check_tokenizer_fit(
    ckpt_dir: str | os.PathLike[str],
    config: EngramConfig,
    compression: TokenizerCompression | None = None,
    *,
    tokenizer: str | None = None,
) -> TokenizerCompression:
    """The compression map that hashes the token ids of checkpoint `ckpt_dir` (config `config`, read
    from its config.json), checked against the config (`check_compression`: its vocab_size and
    compressed_vocab_size). The map is `compression` if given (of the tokenizer named `tokenizer`, for
    the message); else the checkpoint's own
    compression.safetensors (an engram.hf part's); else the identity for a variant that hashes raw
    ids (Qwen4-Exp's PLE); else DeepSeek-V4's (`known_compression`, built once per process, ~2 s).
    ValueError naming config.json, the two sizes and the fix."""
    ckpt_dir = Path(ckpt_dir)
    source = f"the {tokenizer or 'given'} tokenizer's compression map"
    if compression is None:
        if os.path.lexists(ckpt_dir / COMPRESSION_FILE):
            source = f"the checkpoint's {COMPRESSION_FILE}"
            compression = TokenizerCompression.load(
                member_file(ckpt_dir, COMPRESSION_FILE, "the checkpoint's")
            )
        elif config.variant is not Variant.QWEN4_EXP_PLE:
            source = f"the {V41_TOKENIZER} tokenizer's compression map"
            compression = known_compression(V41_TOKENIZER)
        else:
            source = "raw token ids"
    try:
        return check_compression(config, compression)
    except ValueError as e:
        raise ValueError(
            f"{ckpt_dir / CONFIG_FILE} does not fit {source}: {e}. If config.json was edited, restore "
            "it from where the checkpoint came from"
        ) from None
