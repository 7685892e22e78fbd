"""The V4.1 checkpoint format for Engram modules: safetensors shards + config.json, no pickle. Writes
atomically, validates every expected tensor before building modules, refuses NaN / Inf and any file
outside the folder. Each shard written records the layout fingerprint in its metadata (and each FP8
table's content fingerprint), so tables are never loaded under another layout (an edited seed);
DeepSeek's files record none and load as they are. Safetensors I/O is `engram.checkpoint.files`'s, conversions
`engram.checkpoint.convert`'s. Design: docs/checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.files import (
    TensorEntry,
    TensorFile,
    listed_names,
    member_file,
    open_tensors,
    save_tensors,
)
from engram.checkpoint.hf_config import from_hf_dict, to_hf_dict
from engram.checkpoint.integrity import check_finite, check_fp8_table, scan_table, table_fingerprint
from engram.checkpoint.json_file import read_json
from engram.config import EngramConfig
from engram.model.module import Engram
from engram.model.table import EngramTable, FP8Table, MmapFP8Table, TrainableTable
from engram.storage.fp8 import BLOCK

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "LAYOUT_FINGERPRINT_KEY",
    "TABLE_FINGERPRINT_KEY",
    "StoredTable",
    "TableFormat",
    "engram_state_dict",
    "foreign_config",
    "layer_prefix",
    "load_engram_modules",
    "read_checkpoint_config",
    "save_checkpoint",
    "stored_tables",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size
LAYOUT_FINGERPRINT_KEY = "engram_layout_fingerprint"  # shard metadata: `layout_fingerprint` of the config
TABLE_FINGERPRINT_KEY = "engram_table_fingerprint"  # + ".{layer_id}": `table_fingerprint` of an FP8 table
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_ENGRAM_RE = re.compile(r"^layers\.(\d+)\.engram\.(.+)$")
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class TableFormat(enum.StrEnum):
    """How a checkpoint stores a table."""

    FP8 = "fp8"  # F8_E4M3 values + F8_E8M0 scales (V4.1)
    FLOAT = "float"  # one float embed.weight (a trainable table)


def layer_prefix(layer_id: int) -> str:
    """`layers.{L}.engram.`: the prefix of every tensor of layer L's Engram module."""
    return f"layers.{layer_id}.engram."


# ----------------------------------------------------------------------------------------- state dict


def engram_state_dict(
    modules: Mapping[int, Engram], fp8: bool, *, float_dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} for the modules {layer_id: Engram}.

    fp8=True stores every table as FP8 values + scales (quantising a trainable table with
    `FP8Table.from_float`); fp8=False stores one float `embed.weight` (a trainable table as is, or cast
    to `float_dtype`; an FP8 table dequantised to `float_dtype`, default float32). Tensors are detached
    and may share memory with the modules (an `MmapFP8Table`'s are views of its file).
    """
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
        if not isinstance(table, FP8Table | MmapFP8Table | TrainableTable):
            raise TypeError(f"layer {layer_id}: cannot store a table of type {type(table).__name__}")
        if fp8:
            if isinstance(table, TrainableTable):
                table = FP8Table.from_float(table.weight)
            assert isinstance(table, FP8Table | MmapFP8Table)
            out[p + "embed.weight"], out[p + "embed.scale"] = table.weight, table.scale
        elif isinstance(table, TrainableTable):
            w = table.weight.detach()
            out[p + "embed.weight"] = w if float_dtype is None else w.to(float_dtype)
        else:
            out[p + "embed.weight"] = table.to_float(float_dtype or torch.float32)
        for k, v in m.state_dict().items():
            if not k.startswith("table."):
                out[p + k] = v
    return out


# ------------------------------------------------------------------------------------------- writing


def _shard(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy shards in name order; a table's values and scales stay in one shard."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in state.items():
        key = name[: -len("scale")] + "weight" if name.endswith(".embed.scale") else name
        groups.setdefault(key, []).append((name, t))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for group in groups.values():
        g_bytes = sum(t.numel() * t.element_size() for _, t in group)
        if shards[-1] and size + g_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += g_bytes
    return shards


def _shard_metadata(layout_fp: str, shard: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """A shard's metadata: the layout fingerprint, and the content fingerprint of each FP8 table it holds
    (one pass over the table's bytes: what a row file written from it records)."""
    meta = {LAYOUT_FINGERPRINT_KEY: layout_fp}
    tensors = dict(shard)
    for name, scale in shard:
        mt = _ENGRAM_RE.match(name)
        if mt and mt.group(2) == "embed.scale":  # _shard keeps a table's values beside its scales
            weight = tensors[name.removesuffix("scale") + "weight"]
            meta[f"{TABLE_FINGERPRINT_KEY}.{mt.group(1)}"] = table_fingerprint(weight, scale)
    return meta


def _config_diffs(a: EngramConfig, b: EngramConfig, *, stored_only: bool = False) -> list[str]:
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


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    config: EngramConfig,
    modules: Mapping[int, Engram],
    fp8: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    float_dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write `config.json`, the safetensors shard(s) and (for several shards) the index; return the shards.

    Each file is written to a temporary name in `ckpt_dir` and moved into place with os.replace, so a
    reader never sees a half-written file; shards of an earlier save that this one does not write are
    removed afterwards. `fp8` and `float_dtype` as in `engram_state_dict`.
    """
    if set(modules) != set(config.layer_ids):
        raise ValueError(
            f"modules cover layers {sorted(modules)} but config {config.name!r} has Engram layers "
            f"{list(config.layer_ids)}; pass one module per layer"
        )
    for layer_id, m in modules.items():
        diffs = _config_diffs(m.config, config) if isinstance(m, Engram) else []
        if diffs:
            raise ValueError(f"modules[{layer_id}] was built for another config: " + "; ".join(diffs))
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    state = engram_state_dict(modules, fp8, float_dtype=float_dtype)
    shards = _shard(state, max_shard_bytes)

    out_dir = Path(ckpt_dir)
    _check_not_foreign(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tmp = {name: out_dir / f".{name}.tmp-{os.getpid()}" for name in [*names, INDEX_FILE, CONFIG_FILE]}
    try:
        total = 0
        weight_map: dict[str, str] = {}
        layout_fp = layout_fingerprint(Layout(config))
        for name, shard in zip(names, shards, strict=True):
            total += save_tensors(tmp[name], dict(shard), _shard_metadata(layout_fp, shard))
            weight_map.update({t: name for t, _ in shard})
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
    for old in out_dir.iterdir():  # shards of an earlier save with another shard count
        if _SHARD_RE.match(old.name) and old.name not in names:
            old.unlink()
    return [out_dir / name for name in names]


def foreign_config(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` has a config.json that is not an Engram checkpoint's (no `engram_*` or
    `ple_*` key: an HF model's, say, or a file that is not a JSON object): its files are never
    overwritten."""
    path = Path(directory) / CONFIG_FILE
    if not os.path.lexists(path):
        return False
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not (isinstance(d, dict) and any(k.startswith(("engram_", "ple_")) for k in d))


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


# ------------------------------------------------------------------------------------------- reading


def read_checkpoint_config(ckpt_dir: str | os.PathLike[str], *, tokenizer: str | None = None) -> EngramConfig:
    """The EngramConfig of a checkpoint's config.json (refuses a num_embeddings its primes contradict)."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no config.json; pass config=... or save the checkpoint with one")
    member_file(ckpt_dir, CONFIG_FILE, "the checkpoint's")  # a regular file, inside the folder
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return from_hf_dict(data, name=Path(ckpt_dir).name, tokenizer=tokenizer)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def _scan(ckpt_dir: Path) -> tuple[dict[str, TensorEntry], list[str], set[str], dict[Path, dict[str, str]]]:
    """Headers of the checkpoint's files: ({tensor: entry}, problems, tensors whose file is unreadable,
    {file: its metadata})."""
    found: dict[str, TensorEntry] = {}
    problems: list[str] = []
    explained: set[str] = set()
    metas: dict[Path, dict[str, str]] = {}
    index_path = ckpt_dir / INDEX_FILE
    if os.path.lexists(index_path):
        member_file(ckpt_dir, INDEX_FILE, "the checkpoint's")  # a regular file, inside the folder
        try:
            weight_map = read_json(index_path)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not {tensor name: file name}")
        except (KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: not a safetensors index ({e!r})") from None
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            try:
                # refuses "../x", absolute paths, links out of the folder, FIFOs: before anything is opened
                path = member_file(
                    ckpt_dir, file, f"{index_path} maps {len(names)} tensor(s) (e.g. {names[0]}) to"
                )
                opened = open_tensors(path)
                entries, metas[path] = opened.entries(), opened.metadata
            except FileNotFoundError:
                problems.append(
                    f"{INDEX_FILE} maps {len(names)} tensor(s) (e.g. {names[0]}) to {file}, "
                    f"which does not exist in {ckpt_dir}"
                )
                explained.update(names)
                continue
            except ValueError as e:
                problems.append(str(e))
                explained.update(names)
                continue
            for name in names:
                if name in entries:
                    found[name] = entries[name]
                else:
                    problems.append(f"{name}: {INDEX_FILE} maps it to {file}, which does not hold it")
                    explained.add(name)
        return found, problems, explained, metas

    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors files and no {INDEX_FILE}: not a checkpoint")
    for path in files:
        try:
            member_file(ckpt_dir, path.name, f"the checkpoint {ckpt_dir} holds")
            opened = open_tensors(path)
            entries, metas[path] = opened.entries(), opened.metadata
        except ValueError as e:
            problems.append(str(e))
            explained.update(listed_names(path))  # what the damaged file held: unreadable, not "missing"
            continue
        for name, entry in entries.items():
            if name in found:
                problems.append(
                    f"{name}: in both {found[name].path.name} and {path.name}; remove one of them"
                )
            found[name] = entry
    return found, problems, explained, metas


class _ShapeOnlyTable(EngramTable):
    """A stand-in table with a size and no data: lets `Engram` be built on the meta device for its shapes."""

    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.num_rows, self.dim = num_rows, dim


@dataclasses.dataclass
class _LayerPlan:
    fmt: TableFormat
    weight: TensorEntry
    scale: TensorEntry | None
    others: dict[str, TensorEntry]  # module state_dict key -> entry


def _validate(
    config: EngramConfig,
    found: Mapping[str, TensorEntry],
    problems: list[str],
    explained: set[str],
) -> dict[int, _LayerPlan]:
    """Check every expected tensor against `config`; append problems; return per-layer plans when clean."""
    layout = Layout(config)
    declared = config.declared_num_embeddings
    dim, block = config.head_dim, BLOCK
    expected_names: set[str] = set()
    plans: dict[int, _LayerPlan] = {}

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
            elif w.dtype in _FLOAT_DTYPES:
                fmt = TableFormat.FLOAT
            else:
                problem(
                    wname,
                    f"dtype {w.dtype}, expected F8_E4M3 (or {'/'.join(_FLOAT_DTYPES)} for a float table)",
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
            if e.dtype not in _FLOAT_DTYPES:
                problem(name, f"dtype {e.dtype}, expected one of {', '.join(_FLOAT_DTYPES)}")
                ok = False
            if list(e.shape) != list(t.shape):
                problem(name, f"shape {list(e.shape)}, expected {list(t.shape)}")
                ok = False
            others[key] = e
        if ok and w is not None:
            plans[layer_id] = _LayerPlan(fmt, w, s if fmt is TableFormat.FP8 else None, others)

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


def _check_layout(config: EngramConfig, metas: Mapping[Path, Mapping[str, str]], problems: list[str]) -> None:
    """Append a problem for each file that records another layout fingerprint than `config`'s (a file
    save_checkpoint did not write, e.g. DeepSeek's, records none: nothing to compare)."""
    want = layout_fingerprint(Layout(config))
    for path in sorted(metas):
        got = metas[path].get(LAYOUT_FINGERPRINT_KEY)
        if got is not None and got != want:
            problems.append(
                f"{path.name}: its tables were saved for the layout with fingerprint {got}, but config "
                f"{config.name!r} has layout fingerprint {want}: the primes, multipliers (engram_seed), "
                "compressed vocabulary or pad id differ, so every row would be read for other n-grams; "
                "load it with the config it was saved with (restore the checkpoint's config.json)"
            )


def _plan(
    ckpt_dir: Path, config: EngramConfig | None
) -> tuple[EngramConfig, dict[int, _LayerPlan], dict[Path, dict[str, str]]]:
    """(config, per-layer plans, {file: metadata}) of a checkpoint, every check of `load_engram_modules`
    but the data scans done: the config against config.json, every tensor, the layout fingerprint."""
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
    file_config = read_checkpoint_config(ckpt_dir) if (ckpt_dir / CONFIG_FILE).is_file() else None
    if config is None:
        if file_config is None:
            raise FileNotFoundError(f"{ckpt_dir / CONFIG_FILE}: no config.json; pass config=...")
        config = file_config
    elif file_config is not None:
        diffs = _config_diffs(config, file_config, stored_only=True)
        if diffs:
            raise ValueError(
                f"config {config.name!r} disagrees with {ckpt_dir / CONFIG_FILE} (given vs file): "
                + "; ".join(diffs)
            )
        if config.declared_num_embeddings is None:
            config = dataclasses.replace(config, declared_num_embeddings=file_config.declared_num_embeddings)

    found, problems, explained, metas = _scan(ckpt_dir)
    plans = _validate(config, found, problems, explained)
    _check_layout(config, metas, problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"checkpoint {ckpt_dir} does not match config {config.name!r} "
            f"({len(problems)} problem(s)):\n{lines}"
        )
    return config, plans, metas


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """One layer's FP8 table as a checkpoint stores it: its two tensors (nothing read) and the content
    fingerprint save_checkpoint recorded (`table_fingerprint`; None in a file it did not write)."""

    weight: TensorEntry
    scale: TensorEntry
    fingerprint: str | None


def stored_tables(
    ckpt_dir: str | os.PathLike[str], config: EngramConfig | None = None
) -> tuple[EngramConfig, dict[int, StoredTable]]:
    """(config, {layer_id: StoredTable}) of a checkpoint's FP8 tables (float tables are left out), checked
    as `load_engram_modules` checks them (every tensor, the layout fingerprint); no data is read."""
    config, plans, metas = _plan(Path(ckpt_dir), config)
    out = {}
    for layer_id, plan in plans.items():
        if plan.fmt is TableFormat.FP8:
            assert plan.scale is not None
            fp = metas.get(plan.weight.path, {}).get(f"{TABLE_FINGERPRINT_KEY}.{layer_id}")
            out[layer_id] = StoredTable(plan.weight, plan.scale, fp)
    return config, out


def load_engram_modules(
    ckpt_dir: str | os.PathLike[str],
    config: EngramConfig | None = None,
    *,
    mmap: bool = True,
    dtype: torch.dtype | None = torch.float32,
    verify: bool = False,
) -> tuple[EngramConfig, dict[int, Engram]]:
    """Load the Engram modules of a checkpoint: (config, {layer_id: Engram}).

    `config` defaults to the checkpoint's config.json (a given one must agree with it). Every expected
    tensor is checked (present, dtype, shape) before anything is built, and so is the layout fingerprint
    each file we wrote records (a config.json whose seed was edited is refused); all problems are
    reported in one ValueError. FP8 tables load as `MmapFP8Table` (mmap=True) or `FP8Table` (in
    memory), float tables as `TrainableTable`. The module weights (and float tables) are cast to `dtype`; None keeps the stored dtypes.
    NaN / Inf (for FP8 tables, NaN bytes) is refused in every module weight and in every table up to
    `SCAN_LIMIT_BYTES`; larger tables are scanned with `verify=True` only (else an `UnscannedTableWarning`).
    """
    config, plans, _ = _plan(Path(ckpt_dir), config)

    opened: dict[Path, TensorFile] = {}

    def read(e: TensorEntry, to: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `e` copied into memory (cast to `to`): the file's mapping is only read from."""
        f = opened.get(e.path) or opened.setdefault(e.path, open_tensors(e.path))
        return f.tensor(e.name).to(to, copy=True)

    def check(e: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        check_finite(t, f"{e.path}: tensor {e.name!r}")
        return t

    modules: dict[int, Engram] = {}
    for layer_id, plan in plans.items():
        state = {k: check(e, read(e, dtype)) for k, e in plan.others.items()}  # wkv, q_weight, k_weight
        table: FP8Table | MmapFP8Table | TrainableTable
        if plan.fmt is TableFormat.FP8:
            assert plan.scale is not None
            if mmap:
                table = MmapFP8Table(
                    plan.weight.path, plan.weight.name, plan.scale.name, scale_path=plan.scale.path
                )
            else:
                table = FP8Table(read(plan.weight), read(plan.scale))
            assert isinstance(table.weight, torch.Tensor) and isinstance(table.scale, torch.Tensor)
            nbytes = table.weight.numel() + table.scale.numel()  # one byte each
            where = f"{plan.weight.path}: table {plan.weight.name!r} (with {plan.scale.name!r})"
            if scan_table(nbytes, verify, where):
                check_fp8_table(table.weight, table.scale, where)
        else:
            data = read(plan.weight)
            where = f"{plan.weight.path}: table {plan.weight.name!r}"
            if scan_table(data.numel() * data.element_size(), verify, where):
                check_finite(data, where)
            want = dtype if dtype is not None else data.dtype
            if want not in (torch.float32, torch.bfloat16, torch.float64):
                want = torch.float32  # a TrainableTable is fp32/bf16/fp64
            rows, dim = data.shape
            table = TrainableTable(rows, dim, dtype=want, device="meta")
            table.weight = nn.Parameter(data.to(want))
        module = Engram(config, layer_id, table=table, device="meta", dtype=dtype or torch.float32)
        result = module.load_state_dict(state, strict=False, assign=True)
        assert not result.unexpected_keys and all(k.startswith("table.") for k in result.missing_keys), result
        assert not any(t.is_meta for t in module.state_dict().values()), (
            "a weight was left on the meta device"
        )
        modules[layer_id] = module
    return config, modules
