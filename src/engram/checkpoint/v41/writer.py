"""Writing V4.1 checkpoints: Engram modules to safetensors shards + config.json (+ the index for
several shards), atomically, each shard recording the format's metadata (`engram.checkpoint.v41
.format`). Safetensors I/O is `engram.checkpoint.files`'s. Never writes over another model's files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.files import save_tensors
from engram.checkpoint.hf_config import to_hf_dict
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.checkpoint.temporaries import clear_dead_temporaries, temporary_path
from engram.checkpoint.v41.format import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    config_diffs,
    foreign_config,
    is_row_file_name,
    is_shard_name,
    layer_prefix,
    shard_metadata,
    shard_names,
)
from engram.config import EngramConfig
from engram.model.module import Engram
from engram.model.table import QuantTable, TrainableTable, quantize_table, requantize_table
from engram.rowformat.formats import RowFormat, as_row_format

__all__ = ["engram_state_dict", "save_checkpoint"]


def engram_state_dict(
    modules: Mapping[int, Engram],
    fp8: bool,
    *,
    float_dtype: torch.dtype | None = None,
    row_format: RowFormat | str | None = None,
) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} for the modules {layer_id: Engram}.

    fp8=True stores every table quantised, values + scales: in `row_format` (`RowFormat`: fp8, int8,
    int8-row, int4; a trainable table quantised, a stored table of another format requantised chunk by
    chunk), or with None a stored table in its own format and a trainable one in FP8
    (`FP8Table.from_float`). fp8=False stores one float `embed.weight` (a trainable table as is, or cast
    to `float_dtype`; a quantised table dequantised to `float_dtype`, default float32). Tensors are
    detached and may share memory with the modules (an `MmapFP8Table`'s are views of its file).
    """
    target = None if row_format is None else as_row_format(row_format, "row_format")
    out: dict[str, torch.Tensor] = {}
    for layer_id in sorted(modules):
        m = modules[layer_id]
        if not isinstance(m, Engram):
            raise TypeError(
                f"modules[{layer_id}] is a {type(m).__name__}, expected engram.model.module.Engram"
            )
        if m.layer_id != layer_id:
            raise ValueError(
                f"modules[{layer_id}] is the Engram module of layer {m.layer_id}; key it by that"
            )
        p = layer_prefix(layer_id)
        table = m.table
        if not isinstance(table, QuantTable | MmapQuantTable | TrainableTable):
            raise TypeError(f"layer {layer_id}: cannot store a table of type {type(table).__name__}")
        if fp8:
            if isinstance(table, TrainableTable):
                values, scales = quantize_table(table.weight, target or RowFormat.FP8)
            elif target is not None:
                values, scales = requantize_table(table.weight, table.scale, target)
            else:
                values, scales = table.weight, table.scale
            out[p + "embed.weight"], out[p + "embed.scale"] = values, scales
        elif isinstance(table, TrainableTable):
            w = table.weight.detach()
            out[p + "embed.weight"] = w if float_dtype is None else w.to(float_dtype)
        else:
            out[p + "embed.weight"] = table.to_float(float_dtype or torch.float32)
        for k, v in m.state_dict().items():
            if not k.startswith("table."):
                out[p + k] = v
    return out


def _shard(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy shards in name order; a table's values and scales stay in one shard."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in state.items():
        key = name[: -len("scale")] + "weight" if name.endswith(".embed.scale") else name
        groups.setdefault(key, []).append((name, t))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for group in groups.values():
        g_bytes = sum(t.numel() * t.element_size() for _, t in group)
        if shards[-1] and size + g_bytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(group)
        size += g_bytes
    return shards


def _check_not_foreign(out_dir: Path) -> None:
    """Refuse to save into a folder whose config.json is not an Engram checkpoint's (an HF model's,
    say): saving would overwrite it and remove that model's weight shards and index."""
    path = out_dir / CONFIG_FILE
    if not foreign_config(out_dir):
        return
    raise ValueError(
        f"{path} is not an Engram checkpoint's config.json (another model's, e.g. HF's save_pretrained): "
        "saving here would overwrite it and remove that model's weight files; save into an empty folder "
        "(engram.hf.save_engram puts the part in the model folder's engram/ subfolder)"
    )


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    config: EngramConfig,
    modules: Mapping[int, Engram],
    fp8: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    float_dtype: torch.dtype | None = None,
    row_format: RowFormat | str | None = None,
    extra_metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write `config.json`, the safetensors shard(s) and (for several shards) the index; return the shards.

    Each file is written to a temporary name in `ckpt_dir` (`.{name}.tmp-{pid}`, removed again if the
    write fails) and moved into place with os.replace, so a reader never sees a half-written file; the
    temporaries of a killed earlier save are removed first, and the files of an earlier save that this one
    does not describe (shards of another shard count, row files of the old tables) afterwards. `fp8`, `float_dtype` and `row_format` as in `engram_state_dict`. Each shard
    records the CRC32 of every tensor it holds and a seal over its metadata (`shard_metadata`), plus
    `extra_metadata` (engram_* keys: the base model a part was trained on).
    """
    if set(modules) != set(config.layer_ids):
        raise ValueError(
            f"modules cover layers {sorted(modules)} but config {config.name!r} has Engram layers "
            f"{list(config.layer_ids)}; pass one module per layer"
        )
    for layer_id, m in modules.items():
        diffs = config_diffs(m.config, config) if isinstance(m, Engram) else []
        if diffs:
            raise ValueError(f"modules[{layer_id}] was built for another config: " + "; ".join(diffs))
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    state = engram_state_dict(modules, fp8, float_dtype=float_dtype, row_format=row_format)
    shards = _shard(state, max_shard_bytes)

    out_dir = Path(ckpt_dir)
    _check_not_foreign(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_dead_temporaries(out_dir)
    n = len(shards)
    names = shard_names(n)
    tmp = {name: temporary_path(out_dir / name) for name in [*names, INDEX_FILE, CONFIG_FILE]}
    try:
        total = 0
        weight_map: dict[str, str] = {}
        layout_fp = layout_fingerprint(Layout(config))
        for name, shard in zip(names, shards, strict=True):
            total += save_tensors(tmp[name], shard, shard_metadata(layout_fp, shard, extra_metadata))
            weight_map.update(dict.fromkeys(shard, name))
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            tmp[INDEX_FILE].write_text(json.dumps(index, indent=2) + "\n")
        tmp[CONFIG_FILE].write_text(json.dumps(to_hf_dict(config), indent=2) + "\n")
        for name in names:
            os.replace(tmp[name], out_dir / name)
        if n > 1:
            os.replace(tmp[INDEX_FILE], out_dir / INDEX_FILE)
        else:
            (out_dir / INDEX_FILE).unlink(missing_ok=True)
        os.replace(tmp[CONFIG_FILE], out_dir / CONFIG_FILE)
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    for old in out_dir.iterdir():  # shards of an earlier save with another shard count; row files of its
        # tables (they record those tables' fingerprint: `write_row_files` writes them anew for these)
        if (is_shard_name(old.name) and old.name not in names) or is_row_file_name(old.name):
            old.unlink()
    return [out_dir / name for name in names]
