"""The V4.1 checkpoint format itself: its file and tensor names, the metadata each shard records (the
layout fingerprint, FP8 tables' content fingerprints, a CRC32 of every tensor, what the part was
trained on, and a seal over all of these), and the rules a folder's tensors must follow for a config
(which tensors, their dtypes and shapes, the layout fingerprint). Knows names, configs and module shapes; reads and writes nothing (that is
`engram.checkpoint.v41.reader`'s and `.writer`'s). Design: docs/checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.files import TensorEntry, member_path
from engram.config import EngramConfig
from engram.model.module import Engram
from engram.model.table import EngramTable
from engram.rowformat.formats import RowFormat, format_of
from engram.rowformat.fp8 import BLOCK
from engram.storage.integrity import table_fingerprint, tensor_crc32

__all__ = [
    "BASE_MODEL_KEY",
    "CONFIG_FILE",
    "CRC32_KEY",
    "DEFAULT_MAX_SHARD_BYTES",
    "FLOAT_DTYPES",
    "INDEX_FILE",
    "LAYOUT_FINGERPRINT_KEY",
    "SEALED_ONLY_DTYPES",
    "SEALED_ONLY_KEYS",
    "SEAL_KEY",
    "TABLE_FINGERPRINT_KEY",
    "TABLE_FORMAT_KEY",
    "UNLISTED",
    "LayerPlan",
    "TableFormat",
    "config_diffs",
    "crc32_entry",
    "file_crc32s",
    "foreign_config",
    "format_problems",
    "is_row_file_name",
    "is_shard_name",
    "layer_prefix",
    "layout_problems",
    "plan_layers",
    "row_file_name",
    "seal_of",
    "shard_metadata",
    "shard_names",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size
LAYOUT_FINGERPRINT_KEY = "engram_layout_fingerprint"  # shard metadata: `layout_fingerprint` of the config
TABLE_FINGERPRINT_KEY = "engram_table_fingerprint"  # + ".{layer_id}": `table_fingerprint` of a stored table
TABLE_FORMAT_KEY = (
    "engram_table_format"  # + ".{layer_id}": the RowFormat of a table not in FP8 (int8, int4, ...)
)
CRC32_KEY = "engram_crc32"  # JSON {tensor name: 8 hex digits}: the CRC32 of each tensor's bytes in the file
BASE_MODEL_KEY = "engram_base_model"  # JSON: the model the part was trained on (`engram.hf.base`)
SEAL_KEY = "engram_seal"  # sha256 of the file's other engram_* metadata: an edited header is refused
UNLISTED = "*"  # in `plan_layers`' explained names: an unreadable file whose tensors are not known
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # the safetensors dtypes a float tensor may have
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_ROW_FILE_RE = re.compile(r"^engram_layer\d+\.rows$")
_ENGRAM_RE = re.compile(r"^layers\.(\d+)\.engram\.(.+)$")


class TableFormat(enum.StrEnum):
    """How a checkpoint stores a table: in a row format (`RowFormat`), or as one float tensor."""

    FP8 = "fp8"  # F8_E4M3 values + F8_E8M0 scales (V4.1)
    INT8 = "int8"  # I8 values [rows, dim] + BF16 scales [rows, dim / 32]
    INT8_ROW = "int8-row"  # I8 values [rows, dim] + BF16 scales [rows, 1]
    INT4 = "int4"  # U8 values [rows, dim / 2] (two 4-bit ints a byte) + BF16 scales [rows, dim / 32]
    FLOAT = "float"  # one float embed.weight (a trainable table)

    @property
    def row_format(self) -> RowFormat | None:
        """The row format of a quantised table, None for a float one."""
        return None if self is TableFormat.FLOAT else RowFormat(self.value)


# a quantised table's values dtype -> its format (I8 with one scale a row: INT8_ROW)
_QUANT_DTYPES = {"F8_E4M3": TableFormat.FP8, "I8": TableFormat.INT8, "U8": TableFormat.INT4}


def layer_prefix(layer_id: int) -> str:
    """`layers.{L}.engram.`: the prefix of every tensor of layer L's Engram module."""
    return f"layers.{layer_id}.engram."


def shard_names(n: int) -> list[str]:
    """The file names of a checkpoint of `n` shards (Hugging Face's: model-00001-of-0000n.safetensors)."""
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def is_shard_name(name: str) -> bool:
    """Whether `name` is a shard's file name (of any shard count)."""
    return _SHARD_RE.match(name) is not None


def row_file_name(layer_id: int) -> str:
    """The file name of layer `layer_id`'s SSD row file beside a checkpoint's shards."""
    return f"engram_layer{layer_id}.rows"


def is_row_file_name(name: str) -> bool:
    """Whether `name` is a row file's name (of any layer)."""
    return _ROW_FILE_RE.match(name) is not None


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
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        RecursionError,
    ):  # not ours: reported on reading
        return True
    return not (isinstance(d, dict) and any(k.startswith(("engram_", "ple_")) for k in d))


# ------------------------------------------------------------------------------------------ metadata


def crc32_entry(crcs: Mapping[str, int]) -> str:
    """The CRC32_KEY value of {tensor name: CRC32}: fixed width (8 hex digits each), so a writer can
    reserve it before the rows are written (`engram.checkpoint.laid_out.set_metadata`)."""
    return json.dumps({k: f"{crcs[k]:08x}" for k in sorted(crcs)}, separators=(",", ":"))


def seal_of(meta: Mapping[str, str]) -> str:
    """The seal of a file's metadata: sha256 (64 hex digits) of its engram_* entries but the seal."""
    body = {k: v for k, v in meta.items() if k.startswith("engram_") and k != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# What only a writer that seals its files writes (both came with seals: no file from before holds them):
# a file showing one without its seal and CRC32s had them removed.
SEALED_ONLY_KEYS = (TABLE_FORMAT_KEY, BASE_MODEL_KEY)  # metadata entries (TABLE_FORMAT_KEY: + ".{L}")
SEALED_ONLY_DTYPES = frozenset({"I8", "U8"})  # the values of an INT8 / 4-bit table (`TableFormat`)


def file_crc32s(meta: Mapping[str, str], where: str, dtypes: Iterable[str] = ()) -> dict[str, int] | None:
    """{tensor name: CRC32} a file's metadata records, after checking its seal; None for a file that
    records none (DeepSeek's own, or a part written before parts carried them). ValueError naming
    `where` for a seal that does not match (the header was edited or damaged), a damaged entry, or a
    file without seal and CRC32s that shows it was written with them (`SEALED_ONLY_KEYS` in its
    metadata, or a tensor of `dtypes`, the file's, in `SEALED_ONLY_DTYPES`): they were removed."""
    fix = "the file was damaged or edited after it was written: re-copy it, or save the part again"
    if SEAL_KEY not in meta and CRC32_KEY not in meta:
        shows = sorted(k for k in meta if k.split(".", 1)[0] in SEALED_ONLY_KEYS)
        shows += sorted({f"a table of {d} values" for d in dtypes if d in SEALED_ONLY_DTYPES})
        if shows:
            raise ValueError(
                f"{where}: no {SEAL_KEY} and no {CRC32_KEY}, but it holds {shows[0]}, which only a version "
                f"of engram that seals its files writes: its seal was removed; {fix}"
            )
        return None
    if meta.get(SEAL_KEY) != seal_of(meta):
        raise ValueError(f"{where}: its metadata does not match its seal ({SEAL_KEY}); {fix}")
    try:
        raw = json.loads(meta[CRC32_KEY])
        return {str(k): int(v, 16) for k, v in raw.items()}
    except (KeyError, ValueError, TypeError, AttributeError, RecursionError):
        raise ValueError(
            f"{where}: its {CRC32_KEY} metadata is not {{tensor: 8 hex digits}}; {fix}"
        ) from None


def shard_metadata(
    layout_fp: str, shard: Mapping[str, torch.Tensor], extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """A shard's metadata: the layout fingerprint `layout_fp` (`layout_fingerprint` of the config), the
    content fingerprint of each quantised table the shard holds (one pass over the table's bytes: what a
    row file written from it records) and the row format of each that is not FP8 (checked at load
    against its tensors' dtypes and shapes: `format_problems`), the CRC32 of every tensor (another pass, about 3 GB/s), `extra`
    engram_* entries (the base model), and the seal over them all."""
    meta = {LAYOUT_FINGERPRINT_KEY: layout_fp, **(extra or {})}
    for name, scale in shard.items():
        mt = _ENGRAM_RE.match(name)
        if mt and mt.group(2) == "embed.scale":  # a table's values always sit beside its scales
            weight = shard[name.removesuffix("scale") + "weight"]
            meta[f"{TABLE_FINGERPRINT_KEY}.{mt.group(1)}"] = table_fingerprint(weight, scale)
            fmt = format_of(weight, scale)
            if fmt is not RowFormat.FP8:  # FP8 files stay as they were (V4.1's own carry no such key)
                meta[f"{TABLE_FORMAT_KEY}.{mt.group(1)}"] = fmt.value
    meta[CRC32_KEY] = crc32_entry({name: tensor_crc32(t) for name, t in shard.items()})
    meta[SEAL_KEY] = seal_of(meta)
    return meta


def format_problems(plans: Mapping[int, LayerPlan], metas: Mapping[Path, Mapping[str, str]]) -> list[str]:
    """One problem for each table whose file records another row format than its tensors are (a file
    edited or damaged since it was written); a file that records none (DeepSeek's, an FP8 table) has
    nothing to compare."""
    problems = []
    for layer_id, plan in sorted(plans.items()):
        recorded = metas.get(plan.weight.path, {}).get(f"{TABLE_FORMAT_KEY}.{layer_id}")
        rf = plan.fmt.row_format
        if recorded is None or rf is None:
            continue
        known = recorded in {f.value for f in RowFormat}
        if not known or not RowFormat(recorded).same_bytes(rf, rf.dim_of(plan.weight.shape[1])):
            problems.append(
                f"{plan.weight.path.name}: layer {layer_id}'s table is recorded as format {recorded!r} "
                f"({TABLE_FORMAT_KEY}.{layer_id}) but its tensors are {plan.fmt.value} ({plan.weight.name}: "
                f"{plan.weight.dtype} {list(plan.weight.shape)}); the file was changed since it was written: "
                "re-convert it from the source checkpoint (`engram convert SRC DST --format ...`)"
            )
    return problems


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
    file was reported unreadable; `UNLISTED` in it: a file whose header lists nothing was, so no tensor
    is reported missing: one line for one damaged file); return the per-layer plans of the layers
    without problems."""
    layout = Layout(config)
    declared = config.declared_num_embeddings
    dim, block = config.head_dim, BLOCK
    expected_names: set[str] = set()
    plans: dict[int, LayerPlan] = {}

    def problem(name: str, what: str) -> None:
        problems.append(f"{name}: {what}")

    def missing(name: str, what: str) -> None:
        if name not in explained and UNLISTED not in explained:
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
            if w.dtype in _QUANT_DTYPES:
                fmt = _QUANT_DTYPES[w.dtype]
                one_scale = s is not None and len(s.shape) == 2 and s.shape[1] == 1
                if fmt is TableFormat.INT8 and one_scale and dim != block:
                    fmt = TableFormat.INT8_ROW  # one scale a row (a row of one block: int8, the same bytes)
            elif w.dtype in FLOAT_DTYPES:
                fmt = TableFormat.FLOAT
            else:
                problem(
                    wname,
                    f"dtype {w.dtype}, expected F8_E4M3, I8 (int8), U8 (int4) "
                    f"(or {'/'.join(FLOAT_DTYPES)} for a float table)",
                )
                ok = False
            rf = fmt.row_format
            width = dim if rf is None or dim % rf.values_per_byte else dim // rf.values_per_byte
            width_rows_txt = (
                rows_txt
                if width == dim
                else " or ".join(f"[{r}, {width}] ({why})" for r, why in rows_ok.items())
            )
            if len(w.shape) != 2 or w.shape[1] != width or w.shape[0] not in rows_ok:
                problem(
                    wname,
                    f"shape {list(w.shape)}, expected {width_rows_txt}"
                    + ("" if rf is None else f" ({rf.value})"),
                )
                ok = False
        rf = fmt.row_format
        if w is not None and rf is not None:
            if dim % block:
                problem(wname, f"a {rf.value} table needs head_dim % {block} == 0, but head_dim={dim}")
                ok = False
            nb = rf.scales_per_row(dim) if dim % block == 0 and dim > 0 else max(1, dim // block)
            sdt = "F8_E8M0" if rf is RowFormat.FP8 else "BF16"
            what = "ue8m0 scale" if rf is RowFormat.FP8 else "bfloat16 scale"
            per = "row" if rf is RowFormat.INT8_ROW else f"{block} values"
            if len(w.shape) == 2 and w.shape[0] in rows_ok:
                want_txt = f"[{w.shape[0]}, {nb}] (one {what} per {per} of {wname})"
                want_rows = {w.shape[0]}
            else:
                want_txt = " or ".join(f"[{r}, {nb}] ({why})" for r, why in rows_ok.items())
                want_rows = set(rows_ok)
            if s is None:
                missing(sname, f"{sdt} {want_txt}")
                ok = False
            else:
                if s.dtype != sdt:
                    problem(sname, f"dtype {s.dtype}, expected {sdt} (the scales of a {rf.value} table)")
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
            plans[layer_id] = LayerPlan(fmt, w, s if fmt.row_format is not None else None, others)

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
