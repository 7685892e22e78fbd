"""engram-lm: Engram, conditional memory for language models, exact to DeepSeek-V4.1.

Public names: `EngramConfig` (and its presets), `Layout`, `TokenizerCompression`, `NgramHasher`,
`HashStream` (decode-time hashing with rollback), the `Engram` module and its tables, the sparse
table optimizers. Importing the package compiles nothing and sets no global state, but for one: the
`engram` model type joins transformers' Auto classes once transformers is imported (`engram.integrations`).
Design notes, one page per subsystem: docs/ (addressing, storage, model, kernels, systems,
distributed).
"""

from engram.addressing.compression import TokenizerCompression
from engram.addressing.hashing import HashBackend, NgramHasher
from engram.addressing.layout import Layout
from engram.addressing.stream import HashStream
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.config import PRESETS, EngramConfig, Variant
from engram.integrations import register_with_transformers
from engram.model.module import Engram
from engram.model.optim import SparseRowAdagrad, SparseRowAdam, split_param_groups
from engram.model.table import EngramTable, FP8Table, TrainableTable

__all__ = [
    "PRESETS",
    "Engram",
    "EngramConfig",
    "EngramTable",
    "FP8Table",
    "HashBackend",
    "HashStream",
    "Layout",
    "MmapFP8Table",
    "NgramHasher",
    "SparseRowAdagrad",
    "SparseRowAdam",
    "TokenizerCompression",
    "TrainableTable",
    "Variant",
    "split_param_groups",
]
__version__ = "0.1.0"

register_with_transformers()  # Engram folders load with Engram through transformers' Auto classes
