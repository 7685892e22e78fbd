"""Engram on Hugging Face causal LMs (transformers is needed only here: `import engram` works without it).

`add_engram` attaches Engram modules to decoder layers of a decoder-only model and makes a transformers
model an Engram model (`engram.hf.auto`: `save_pretrained` writes a folder that `from_pretrained`, pipelines,
lm-eval, PEFT and TRL load with Engram); `EngramCollator`
hashes rows in the data pipeline; `build_optimizer` gives the tables sparse row optimizers and the
rest AdamW (usable with the HF `Trainer`); `save_engram` / `load_engram` / `export_fp8` /
`export_quantised` (INT8, 4-bit) write and read the Engram part alone; `gguf_to_folder` turns a GGUF file into a plain HF folder. Design and
usage: docs/hf.md.
"""

from __future__ import annotations

from engram.hf.api import add_engram, load_engram, remove_engram
from engram.hf.attach import (
    DECODER_LAYER_PATHS,
    EngramAttachment,
    find_decoder_layers,
    get_attachment,
    set_engram_trainable,
)
from engram.hf.collator import EngramCollator
from engram.hf.gguf import gguf_to_folder, smollm2_gguf_path
from engram.hf.io import export_fp8, export_quantised, save_engram
from engram.hf.optim import EngramOptimizer, build_optimizer

__all__ = [
    "DECODER_LAYER_PATHS",
    "EngramAttachment",
    "EngramCollator",
    "EngramOptimizer",
    "add_engram",
    "build_optimizer",
    "export_fp8",
    "export_quantised",
    "find_decoder_layers",
    "get_attachment",
    "gguf_to_folder",
    "load_engram",
    "remove_engram",
    "save_engram",
    "set_engram_trainable",
    "smollm2_gguf_path",
]
