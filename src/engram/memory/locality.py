"""Where a patch can act: the positions of a text whose n-grams reach one of its rows.

Engram adds to a position only what its own rows hold, so a position none of whose rows a patch
writes gets exactly what it got before; through attention, every later position can see the change.
`patch_hits` marks the positions that read a patched row; a text with none is unchanged to the last
bit (tests check it), and the study counts them per 1,000 held-out tokens.
"""

from __future__ import annotations

import numpy as np

from engram.addressing.hashing import NgramHasher
from engram.memory.patch import MemoryPatch

__all__ = ["patch_hits"]


def patch_hits(
    hasher: NgramHasher, patches: MemoryPatch | list[MemoryPatch], ids: list[int] | np.ndarray
) -> np.ndarray:
    """Which positions of a token sequence read a row that the patches write.

    A position that reads none gets exactly what it got without the patches (module docstring).

    Args:
        hasher: The hasher of the model the patches are for (`EngramLayers.of(model).hasher`).
        patches: A patch, or several.
        ids: The token ids of one sequence [T], read from its start.

    Returns:
        bool [T]: True where the position reads a patched row in some layer.
    """
    ps = [patches] if isinstance(patches, MemoryPatch) else list(patches)
    ids = np.asarray(ids, dtype=np.int64)
    hit = np.zeros(ids.shape[0], dtype=bool)
    if ids.size == 0:
        return hit
    rows = np.asarray(hasher.hash(ids))  # (T, layers, heads)
    for i, lid in enumerate(hasher.config.layer_ids):
        for p in ps:
            lr = p.layers.get(lid)
            if lr is not None and lr.rows.numel():
                hit |= np.isin(rows[:, i], lr.rows.numpy()).any(axis=-1)
    return hit
