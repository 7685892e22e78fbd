"""`EngramCollator`: a Hugging Face data collator that pads a batch and hashes its Engram rows in
the data pipeline (DataLoader workers), so that the forward pass only gathers rows.

Its output (`input_ids`, `attention_mask`, `labels`, `engram_rows` [B, T, n_layers, heads]) goes
straight to `model(**batch)` or the `Trainer`; the model's hook takes `engram_rows` instead of
hashing. Padding is dead (never inside an n-gram window), as in the forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from engram.addressing.hashing import NgramHasher

__all__ = ["EngramCollator"]


class EngramCollator:
    """A data collator: pad `input_ids` of a list of features and add their `engram_rows`.

    Padding is dead (never inside an n-gram window), as in the forward pass. The output goes straight
    to `model(**batch)` or the `Trainer`; the model's hook takes `engram_rows` instead of hashing.

    Args:
        source: A model with Engram attached (its hasher and boundary rule are used) or an NgramHasher.
        pad_token_id: The id padding is filled with.
        padding_side: "right" (training) or "left".
        labels: Add `labels` (input ids, -100 at padding) when the features have none.
        max_length: Cut longer sequences.

    Raises:
        ValueError: `source` has no Engram, or another argument is out of range.

    Examples:
        >>> from engram import EngramConfig, NgramHasher
        >>> from engram.hf import EngramCollator
        >>> config = EngramConfig.preset("tiny").replace(vocab_size=1000, compressed_vocab_size=1000)
        >>> collate = EngramCollator(NgramHasher(config), pad_token_id=0)
        >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> {key: tuple(value.shape) for key, value in batch.items()}
        {'input_ids': (2, 3), 'attention_mask': (2, 3), 'engram_rows': (2, 3, 1, 8), 'labels': (2, 3)}
        >>> batch["labels"].tolist()
        [[5, 6, 7], [8, 9, -100]]
    """

    def __init__(
        self,
        source: nn.Module | NgramHasher,
        *,
        pad_token_id: int,
        padding_side: str = "right",
        labels: bool = True,
        max_length: int | None = None,
    ) -> None:
        if isinstance(source, NgramHasher):
            self.hasher, self.rows = source, None
        else:
            att = getattr(source, "engram", None)
            rows = getattr(att, "rows", None)
            if rows is None:
                raise ValueError(
                    f"source must be a model with Engram attached (engram.hf.add_engram) or an NgramHasher, "
                    f"got {type(source).__name__}"
                )
            self.hasher, self.rows = rows.hasher, rows
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}: use 'left' or 'right'")
        if not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a token id (int >= 0), got {pad_token_id!r}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length={max_length} must be >= 1")
        self.pad_token_id, self.padding_side = pad_token_id, padding_side
        self.labels, self.max_length = labels, max_length

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Collate a batch.

        Args:
            features: Each a mapping with `input_ids` (and optionally `labels`, and `position_ids`,
                which "position_ids" boundaries need), or the ids themselves.

        Returns:
            `input_ids`, `attention_mask`, `engram_rows` [B, T, n_layers, heads], `labels` (with
                `labels`, or when a feature has them) and `position_ids` (for "position_ids"
                boundaries).

        Raises:
            ValueError: No features, a feature without ids, or missing `position_ids`.
        """
        if not features:
            raise ValueError("EngramCollator got an empty list of features")
        seqs, extra_labels, positions = [], [], []
        for i, f in enumerate(features):
            ids = f["input_ids"] if isinstance(f, Mapping) else f
            arr = np.asarray(ids.tolist() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(
                -1
            )
            if arr.size == 0:
                raise ValueError(f"feature {i} has no input_ids")
            if self.max_length is not None:
                arr = arr[: self.max_length]
            seqs.append(arr)
            pos = f.get("position_ids") if isinstance(f, Mapping) else None
            positions.append(None if pos is None else np.asarray(pos, dtype=np.int64).reshape(-1)[: arr.size])
            lab = f.get("labels") if isinstance(f, Mapping) else None
            extra_labels.append(
                None if lab is None else np.asarray(lab, dtype=np.int64).reshape(-1)[: arr.size]
            )
        b, t = len(seqs), max(s.size for s in seqs)
        ids = np.full((b, t), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((b, t), dtype=np.int64)
        labels = np.full((b, t), -100, dtype=np.int64)
        for i, s in enumerate(seqs):
            sl = slice(t - s.size, t) if self.padding_side == "left" else slice(0, s.size)
            ids[i, sl], mask[i, sl] = s, 1
            labels[i, sl] = s if extra_labels[i] is None else extra_labels[i]
        dead = mask == 0
        ids_t = torch.from_numpy(ids)
        extra: dict[str, torch.Tensor] = {}
        starts = None
        if self.rows is not None and self.rows.boundaries == "position_ids":
            if any(p is None or p.size != s.size for p, s in zip(positions, seqs, strict=True)):
                raise ValueError(
                    "boundaries='position_ids': every feature needs position_ids (0 where a packed document "
                    "begins), as long as its input_ids"
                )
            pos = np.zeros((b, t), dtype=np.int64)
            for i, (p, s) in enumerate(zip(positions, seqs, strict=True)):
                pos[i, slice(t - s.size, t) if self.padding_side == "left" else slice(0, s.size)] = p
            extra["position_ids"] = torch.from_numpy(pos)
            starts = self.rows.starts(ids_t, extra["position_ids"]).numpy()
        rows = self.hasher.hash(ids, dead if dead.any() else None, starts=starts)
        out = {
            "input_ids": ids_t,
            "attention_mask": torch.from_numpy(mask),
            "engram_rows": torch.from_numpy(rows),
            **extra,
        }
        if self.labels or any(lab is not None for lab in extra_labels):
            out["labels"] = torch.from_numpy(labels)
        return out
