"""Memory patches: facts written into a trained model's Engram rows, as a small file that can be
applied, removed and stacked (`memorize` writes one, `apply_patch` / `remove_patch` use it). Rows
are addressed by tokens alone, so a patch changes only what text whose n-grams reach its rows
reads. Design and measurements: docs/memory.md.
"""

from __future__ import annotations

from engram.memory.apply import (
    EngramLayers,
    PatchOverlapWarning,
    applied_patches,
    apply_patch,
    remove_patch,
)
from engram.memory.choose import RowChoice
from engram.memory.facts import Fact, read_facts
from engram.memory.locality import patch_hits
from engram.memory.memorize import MemorizeResult, MemorizeSettings, NoRowsWarning, memorize
from engram.memory.patch import MemoryPatch, load_patch, save_patch
from engram.memory.reader import ReaderResult, ReaderSettings, train_reader

__all__ = [
    "EngramLayers",
    "Fact",
    "MemorizeResult",
    "MemorizeSettings",
    "MemoryPatch",
    "NoRowsWarning",
    "PatchOverlapWarning",
    "ReaderResult",
    "ReaderSettings",
    "RowChoice",
    "applied_patches",
    "apply_patch",
    "load_patch",
    "memorize",
    "patch_hits",
    "read_facts",
    "remove_patch",
    "save_patch",
    "train_reader",
]
