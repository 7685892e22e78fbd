"""engram-lm: Engram, conditional memory for language models, exact to DeepSeek-V4.1.

Public names: `EngramConfig` (and its presets), `Layout`, `TokenizerCompression`, `NgramHasher`,
`HashStream` (decode-time hashing with rollback).
"""

from engram.compression import TokenizerCompression
from engram.config import PRESETS, EngramConfig, Variant
from engram.hashing import NgramHasher
from engram.layout import Layout
from engram.stream import HashStream

__all__ = [
    "PRESETS",
    "EngramConfig",
    "HashStream",
    "Layout",
    "NgramHasher",
    "TokenizerCompression",
    "Variant",
]
__version__ = "0.1.0"
