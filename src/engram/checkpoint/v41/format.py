"""The V4.1 checkpoint format itself: its file and tensor names, the metadata each shard records, and
the rules a folder's tensors must follow for a config (which tensors, their dtypes and shapes, the
layout fingerprint). Knows names, configs and module shapes; reads and writes nothing (that is
`engram.checkpoint.v41.reader`'s and `.writer`'s). Design: docs/checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import torch

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.files import TensorEntry, member_path
from engram.config import EngramConfig
from engram.model.module import Engram
from engram.model.table import EngramTable
from engram.rowformat.fp8 import BLOCK
from engram.storage.integrity import table_fingerprint

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "FLOAT_DTYPES",
    "INDEX_FILE",
    "LAYOUT_FINGERPRINT_KEY",
    "TABLE_FINGERPRINT_KEY",
    "LayerPlan",
    "TableFormat",
    "config_diffs",
    "foreign_config",
    "is_shard_name",
    "layer_prefix",
    "layout_problems",
    "plan_layers",
    "shard_metadata",
    "shard_names",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size
LAYOUT_FINGERPRINT_KEY = "engram_layout_fingerprint"  # shard metadata: `layout_fingerprint` of the config
TABLE_FINGERPRINT_KEY = "engram_table_fingerprint"  # + ".{layer_id}": `table_fingerprint` of an FP8 table
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # the safetensors dtypes a float tensor may have
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_ENGRAM_RE = re.compile(r"^layers\.(\d+)\.engram\.(.+)$")


class TableFormat(enum.StrEnum):
    """How a checkpoint stores a table."""

    FP8 = "fp8"  # F8_E4M3 values + F8_E8M0 scales (V4.1)
    FLOAT = "float"  # one float embed.weight (a trainable table)


def layer_prefix(layer_id: int) -> str:
    """`layers.{L}.engram.`: the prefix of every tensor of layer L's Engram module."""
    return f"layers.{layer_id}.engram."


def shard_names(n: int) -> list[str]:
    """The file names of a checkpoint of `n` shards (Hugging Face's: model-00001-of-0000n.safetensors)."""
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def is_shard_name(name: str) -> bool:
    """Whether `name` is a shard's file name (of any shard count)."""
    return _SHARD_RE.match(name) is not None


def config_diffs(a: EngramConfig, b: EngramConfig, *, stored_only: bool = False) -> list[str]:
    """Fields where a and b differ ("field: a vs b"), ignoring names; `stored_only`: only what config.json
    records (to_hf_dict keeps neither norm_eps nor gate_clamp)."""
    skip = {"name", "tokenizer", "declared_num_embeddings"}
    if stored_only:
        skip |= {"norm_eps", "gate_clamp"}
    return [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(EngramConfig)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    ]


def foreign_config(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` has a config.json that is not an Engram checkpoint's (no `engram_*` or
    `ple_*` key: an HF model's, say, or a file that is not a JSON object): its files are never
    overwritten."""
    path = Path(directory) / CONFIG_FILE
    if not os.path.lexists(path):
        return False
    member_path(directory, CONFIG_FILE, f"the folder {directory} holds")  # never read through a link out
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a folder, a FIFO (reading one blocks): not ours
            return True
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not (isinstance(d, dict) and any(k.startswith(("engram_", "ple_")) for k in d))


# ------------------------------------------------------------------------------------------ metadata


def shard_metadata(layout_fp: str, shard: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A shard's metadata: the layout fingerprint `layout_fp` (`layout_fingerprint` of the config), and
    the content fingerprint of each FP8 table the shard holds (one pass over the table's bytes: what a
    row file written from it records)."""
    meta = {LAYOUT_FINGERPRINT_KEY: layout_fp}
    for name, scale in shard.items():
        mt = _ENGRAM_RE.match(name)
        if mt and mt.group(2) == "embed.scale":  # a table's values always sit beside its scales
            weight = shard[name.removesuffix("scale") + "weight"]
            meta[f"{TABLE_FINGERPRINT_KEY}.{mt.group(1)}"] = table_fingerprint(weight, scale)
    return meta


def layout_problems(config: EngramConfig, metas: Mapping[Path, Mapping[str, str]]) -> list[str]:
    """One problem for each file that records another layout fingerprint than `config`'s (a file
    save_checkpoint did not write, e.g. DeepSeek's, records none: nothing to compare)."""
    want = layout_fingerprint(Layout(config))
    problems = []
    for path in sorted(metas):
        got = metas[path].get(LAYOUT_FINGERPRINT_KEY)
        if got is not None and got != want:
            problems.append(
                f"{path.name}: its tables were saved for the layout with fingerprint {got}, but config "
                f"{config.name!r} has layout fingerprint {want}: the primes, multipliers (engram_seed), "
                "compressed vocabulary or pad id differ, so every row would be read for other n-grams; "
                "load it with the config it was saved with (restore the checkpoint's config.json)"
            )
    return problems


# ------------------------------------------------------------------------------------ expected tensors


class _ShapeOnlyTable(EngramTable):
    """A stand-in table with a size and no data: lets `Engram` be built on the meta device for its shapes."""

    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.num_rows, self.dim = num_rows, dim


@dataclasses.dataclass
class LayerPlan:
    """One layer's tensors as a checkpoint stores them, checked against the config (nothing read)."""

    fmt: TableFormat
    weight: TensorEntry
    scale: TensorEntry | None
    others: dict[str, TensorEntry]  # module state_dict key -> entry


def plan_layers(
    config: EngramConfig,
    found: Mapping[str, TensorEntry],
    problems: list[str],
    explained: set[str],
) -> dict[int, LayerPlan]:
    """Check every tensor of `found` ({name: entry}) against what `config` expects (present, dtype,
    shape; nothing unexpected); append problems (a name in `explained` is not reported missing: its
    file was reported unreadable); return the per-layer plans of the layers without problems."""
    layout = Layout(config)
    declared = config.declared_num_embeddings
    dim, block = config.head_dim, BLOCK
    expected_names: set[str] = set()
    plans: dict[int, LayerPlan] = {}

    def problem(name: str, what: str) -> None:
        problems.append(f"{name}: {what}")

    def missing(name: str, what: str) -> None:
        if name not in explained:
            problem(name, f"missing; expected {what}")

    for layer_id in config.layer_ids:
        p = layer_prefix(layer_id)
        rows_ok = {layout.layer(layer_id).num_embeddings: f"layer {layer_id}'s prime sum"}
        if not isinstance(declared, tuple):  # the scalar (max-size) form of V4.1's config.json
            max_rows = declared if isinstance(declared, int) else max(layout.num_embeddings)
            rows_ok.setdefault(max_rows, "engram_num_embeddings")
        rows_txt = " or ".join(f"[{r}, {dim}] ({why})" for r, why in rows_ok.items())
        ok = True

        wname, sname = p + "embed.weight", p + "embed.scale"
        expected_names.update((wname, sname))
        w, s = found.get(wname), found.get(sname)
        fmt = TableFormat.FP8
        if w is None:
            missing(wname, f"F8_E4M3 {rows_txt} (with {sname}) or a float table of that shape")
            ok = False
        else:
            if w.dtype == "F8_E4M3":
                fmt = TableFormat.FP8
            elif w.dtype in FLOAT_DTYPES:
                fmt = TableFormat.FLOAT
            else:
                problem(
                    wname,
                    f"dtype {w.dtype}, expected F8_E4M3 (or {'/'.join(FLOAT_DTYPES)} for a float table)",
                )
                ok = False
            if len(w.shape) != 2 or w.shape[1] != dim or w.shape[0] not in rows_ok:
                problem(wname, f"shape {list(w.shape)}, expected {rows_txt}")
                ok = False
        if w is not None and fmt is TableFormat.FP8:
            if dim % block:
                problem(wname, f"an FP8 table needs head_dim % {block} == 0, but head_dim={dim}")
                ok = False
            nb = dim // block
            if len(w.shape) == 2 and w.shape[0] in rows_ok:
                want_txt = f"[{w.shape[0]}, {nb}] (one ue8m0 scale per {block} values of {wname})"
                want_rows = {w.shape[0]}
            else:
                want_txt = " or ".join(f"[{r}, {nb}] ({why})" for r, why in rows_ok.items())
                want_rows = set(rows_ok)
            if s is None:
                missing(sname, f"F8_E8M0 {want_txt}")
                ok = False
            else:
                if s.dtype != "F8_E8M0":
                    problem(sname, f"dtype {s.dtype}, expected F8_E8M0")
                    ok = False
                if len(s.shape) != 2 or s.shape[0] not in want_rows or s.shape[1] != nb:
                    problem(sname, f"shape {list(s.shape)}, expected {want_txt}")
                    ok = False
        elif w is not None and s is not None:
            problem(sname, f"a scale beside a {w.dtype} (float) table; a float table has no scales")
            ok = False

        others: dict[str, TensorEntry] = {}
        stand_in = _ShapeOnlyTable(layout.layer(layer_id).num_embeddings, dim)
        meta = Engram(config, layer_id, table=stand_in, device="meta")  # shapes only: allocates nothing
        for key, t in meta.state_dict().items():
            if key.startswith("table."):
                continue
            name = p + key
            expected_names.add(name)
            e = found.get(name)
            if e is None:
                missing(name, f"a float tensor {list(t.shape)}")
                ok = False
                continue
            if e.dtype not in FLOAT_DTYPES:
                problem(name, f"dtype {e.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
                ok = False
            if list(e.shape) != list(t.shape):
                problem(name, f"shape {list(e.shape)}, expected {list(t.shape)}")
                ok = False
            others[key] = e
        if ok and w is not None:
            plans[layer_id] = LayerPlan(fmt, w, s if fmt is TableFormat.FP8 else None, others)

    for name in sorted(found):
        mt = _ENGRAM_RE.match(name)
        if mt and name not in expected_names:
            layer = int(mt.group(1))
            why = (
                f"layer {layer} has no Engram module in this config (layers {list(config.layer_ids)})"
                if layer not in config.layer_ids
                else f"not a tensor of a {config.variant.value} Engram module"
            )
            problem(name, f"unexpected tensor: {why}")
    return plans
