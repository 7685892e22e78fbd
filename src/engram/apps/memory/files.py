"""Memory patch files as the commands take them: `read_patches` (several, each once), `describe` (what
`engram patch info` prints) and `apply_patches` (in the order given, a refusal naming the file). Knows
files and `engram.memory`'s patches; nothing of folders or commands.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.memory import MemoryPatch, apply_patch, load_patch

__all__ = ["PatchFile", "apply_patches", "describe", "read_patches"]


@dataclasses.dataclass(frozen=True)
class PatchFile:
    """A patch and the file it was read from (named in every refusal)."""

    path: str
    patch: MemoryPatch


def read_patches(paths: Sequence[str | os.PathLike[str]]) -> list[PatchFile]:
    """The patches of `paths`, in order, each checked as `load_patch` checks it; the same patch given
    twice (the same fingerprint, under any name) is refused naming both files."""
    out: list[PatchFile] = []
    seen: dict[str, str] = {}
    for p in paths:
        patch = load_patch(p)
        fp = patch.fingerprint
        if fp in seen:
            raise ValueError(
                f"{p} is the same patch as {seen[fp]} (fingerprint {fp[:12]}): a patch is applied once; "
                "give it once"
            )
        seen[fp] = str(p)
        out.append(PatchFile(str(p), patch))
    return out


def describe(f: PatchFile) -> dict[str, Any]:
    """What a patch file holds: its name, facts, rows per layer, bytes (the file's, and its rows'), row
    format, fingerprint and what it fits (layout, tokenizer, table sizes)."""
    p = f.patch
    return {
        "path": f.path,
        "name": p.name,
        "facts": p.facts,
        "rows": p.num_rows,
        "rows_per_layer": {str(lid): int(lr.rows.numel()) for lid, lr in sorted(p.layers.items())},
        "bytes": os.path.getsize(f.path),
        "row_bytes": p.nbytes,
        "row_format": p.row_format,
        "dim": p.dim,
        "table_rows": {str(lid): n for lid, n in sorted(p.table_rows.items())},
        "fingerprint": p.fingerprint,
        "layout": p.layout,
        "tokenizer": p.tokenizer,
    }


def apply_patches(model: nn.Module, files: Sequence[PatchFile], *, hasher: NgramHasher | None = None) -> None:
    """Apply each patch to `model` in order (`engram.memory.apply_patch`; `hasher` for an `EngramLM`);
    a patch that does not fit is refused, ValueError naming its file (the ones before it stay applied).
    Rows two patches share warn (`PatchOverlapWarning`)."""
    for f in files:
        try:
            apply_patch(model, f.patch, hasher=hasher)
        except ValueError as e:
            raise ValueError(f"{f.path}: {e}") from None
