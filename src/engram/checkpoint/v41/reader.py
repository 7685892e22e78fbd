"""Reading V4.1 checkpoints: the config, then every file's header checked against the format's rules
(`engram.checkpoint.v41.format`: each expected tensor, the layout fingerprint, the seal over the
metadata) before any module is built; every tensor's bytes against the CRC32 its file records (the
dense ones always, tables as they are scanned: by size, or every one with `verify`); NaN / Inf
refused; no file outside the folder read. DeepSeek's files record no fingerprints and load as they are. Safetensors I/O is `engram.checkpoint.files`'s.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from engram.checkpoint.files import TensorEntry, TensorFile, listed_names, member_file, open_tensors
from engram.checkpoint.hf_config import from_hf_dict
from engram.checkpoint.json_file import read_json
from engram.checkpoint.mmap_table import MmapFP8Table, MmapQuantTable
from engram.checkpoint.v41.format import (
    CONFIG_FILE,
    INDEX_FILE,
    LAYOUT_FINGERPRINT_KEY,
    TABLE_FINGERPRINT_KEY,
    UNLISTED,
    LayerPlan,
    config_diffs,
    file_crc32s,
    format_problems,
    layout_problems,
    plan_layers,
)
from engram.config import EngramConfig
from engram.model.module import Engram
from engram.model.table import FP8Table, QuantTable, TrainableTable
from engram.rowformat.formats import RowFormat
from engram.storage.integrity import (
    UnscannedTableWarning,
    check_finite,
    check_quant_table,
    scan_table,
    table_fingerprint,
    tensor_crc32,
)

__all__ = [
    "StoredTable",
    "load_engram_modules",
    "read_checkpoint_config",
    "recorded_metadata",
    "stored_tables",
]


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
            # what the damaged file held: unreadable, not "missing" (all of it when its header lists nothing)
            explained.update(listed_names(path) or [UNLISTED])
            continue
        for name, entry in entries.items():
            if name in found:
                problems.append(
                    f"{name}: in both {found[name].path.name} and {path.name}; remove one of them"
                )
            found[name] = entry
    return found, problems, explained, metas


_CRCS = dict[tuple[Path, str], int]  # (file, tensor) -> the CRC32 its file records


def _crc32s(
    found: dict[str, TensorEntry], metas: dict[Path, dict[str, str]], problems: list[str], refused: set[Path]
) -> _CRCS:
    """The CRC32 of each found tensor that its file records, each file's seal checked (a problem for a
    seal that does not match, a file whose seal was removed, or a tensor of a sealed file without one).
    A file of ours that records none (a part saved before parts carried CRC32s) is loaded unchecked but
    for its FP8 tables' fingerprints, with an UnscannedTableWarning. A file refused is added to `refused`."""
    crcs: _CRCS = {}
    for path in sorted(metas):
        try:
            dtypes = [e.dtype for e in found.values() if e.path == path]
            recorded = file_crc32s(metas[path], str(path), dtypes)
        except ValueError as e:
            problems.append(str(e))
            refused.add(path)
            continue
        if recorded is None:
            if LAYOUT_FINGERPRINT_KEY in metas[path]:  # ours (DeepSeek's files record nothing of theirs)
                warnings.warn(
                    f"{path} records no CRC32s (saved before parts carried them): its bytes are not checked "
                    "but for the FP8 tables' fingerprints; save the part again to add them",
                    UnscannedTableWarning,
                    stacklevel=4,
                )
            continue
        for name, e in found.items():
            if e.path != path:
                continue
            if name not in recorded:
                problems.append(f"{path}: tensor {name!r} has no CRC32 in the file's sealed metadata")
            else:
                crcs[(path, name)] = recorded[name]
    return crcs


def _plan(
    ckpt_dir: Path, config: EngramConfig | None
) -> tuple[EngramConfig, dict[int, LayerPlan], dict[Path, dict[str, str]], _CRCS]:
    """(config, per-layer plans, {file: metadata}, the recorded CRC32s) of a checkpoint, every check of
    `load_engram_modules` but the data scans done: the config against config.json, every tensor, the
    layout fingerprint, each file's seal."""
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
    file_config = read_checkpoint_config(ckpt_dir) if (ckpt_dir / CONFIG_FILE).is_file() else None
    if config is None:
        if file_config is None:
            raise FileNotFoundError(
                f"{ckpt_dir / CONFIG_FILE}: no config.json: not a checkpoint in the V4.1 format; restore its "
                "config.json, or (in Python) pass config=EngramConfig(...)"
            )
        config = file_config
    elif file_config is not None:
        diffs = config_diffs(config, file_config, stored_only=True)
        if diffs:
            raise ValueError(
                f"config {config.name!r} disagrees with {ckpt_dir / CONFIG_FILE} (given vs file): "
                + "; ".join(diffs)
            )
        if config.declared_num_embeddings is None:
            config = dataclasses.replace(config, declared_num_embeddings=file_config.declared_num_embeddings)

    found, problems, explained, metas = _scan(ckpt_dir)
    plans = plan_layers(config, found, problems, explained)
    refused: set[Path] = set()
    crcs = _crc32s(found, metas, problems, refused)
    trusted = {path: meta for path, meta in metas.items() if path not in refused}  # one line a file refused
    problems += layout_problems(config, trusted)
    problems += format_problems(plans, trusted)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"checkpoint {ckpt_dir} does not match config {config.name!r} "
            f"({len(problems)} problem(s)):\n{lines}"
        )
    return config, plans, metas, crcs


def recorded_metadata(ckpt_dir: str | os.PathLike[str], key: str) -> str | None:
    """The value of metadata entry `key` that a checkpoint's files record (the first that has it, its
    seal checked: an edited value is refused); None when no file records it."""
    _, _, _, metas = _scan(Path(ckpt_dir))
    for path in sorted(metas):
        if key in metas[path]:
            file_crc32s(metas[path], str(path))  # ValueError for an edited or damaged header
            return metas[path][key]
    return None


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """One layer's quantised table as a checkpoint stores it: its two tensors (nothing read), the content
    fingerprint save_checkpoint recorded (`table_fingerprint`; None in a file it did not write) and its
    row format."""

    weight: TensorEntry
    scale: TensorEntry
    fingerprint: str | None
    row_format: RowFormat = RowFormat.FP8


def stored_tables(
    ckpt_dir: str | os.PathLike[str], config: EngramConfig | None = None
) -> tuple[EngramConfig, dict[int, StoredTable]]:
    """(config, {layer_id: StoredTable}) of a checkpoint's quantised tables (FP8, INT8, 4-bit; float tables
    are left out), checked as `load_engram_modules` checks them (every tensor, the layout fingerprint, the
    recorded row format); no data is read."""
    config, plans, metas, _ = _plan(Path(ckpt_dir), config)
    out = {}
    for layer_id, plan in plans.items():
        rf = plan.fmt.row_format
        if rf is not None:
            assert plan.scale is not None
            fp = metas.get(plan.weight.path, {}).get(f"{TABLE_FINGERPRINT_KEY}.{layer_id}")
            out[layer_id] = StoredTable(plan.weight, plan.scale, fp, rf)
    return config, out


def _mapped(opened: dict[Path, TensorFile], e: TensorEntry) -> torch.Tensor:
    """Tensor `e`, memory-mapped from its file (opened once, kept in `opened`)."""
    f = opened.get(e.path) or opened.setdefault(e.path, open_tensors(e.path))
    return f.tensor(e.name)


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
    memory), tables of the other row formats (INT8, 4-bit) as `MmapQuantTable` / `QuantTable`, float
    tables as `TrainableTable`. The module weights (and float tables) are cast to `dtype`; None keeps the stored dtypes.
    NaN / Inf (for FP8 tables, NaN bytes; for the integer formats, scales that are not finite and
    positive) is refused in every module weight and in every table up to
    `SCAN_LIMIT_BYTES`; larger tables are scanned with `verify=True` only (else an `UnscannedTableWarning`).
    The bytes of each tensor scanned (every module weight; the tables as they are scanned) must match the
    CRC32 its file records: a byte damaged after the write is refused, naming the file and the tensor
    (tables are checked through the file's mapping a block at a time: one larger than memory too).
    """
    config, plans, metas, crcs = _plan(Path(ckpt_dir), config)

    opened: dict[Path, TensorFile] = {}

    def stored(e: TensorEntry) -> torch.Tensor:
        """Tensor `e` as the file holds it, memory-mapped, after its bytes are checked against its CRC32."""
        t = _mapped(opened, e)
        check_crc(e, t)
        return t

    def check_crc(e: TensorEntry, t: torch.Tensor) -> None:
        want = crcs.get((e.path, e.name))
        if want is not None and (got := tensor_crc32(t)) != want:
            raise ValueError(
                f"{e.path}: tensor {e.name!r}: its bytes do not match the CRC32 its file recorded when it was "
                f"written (now {got:08x}, recorded {want:08x}): the file was damaged since; re-copy it, or "
                "save the part again"
            )

    def check_fingerprint(
        layer_id: int, w: TensorEntry, weight: torch.Tensor, scale: torch.Tensor, where: str
    ) -> None:
        want = metas.get(w.path, {}).get(f"{TABLE_FINGERPRINT_KEY}.{layer_id}")
        if want is not None and table_fingerprint(weight, scale) != want:
            raise ValueError(
                f"{where}: its bytes do not match the table fingerprint its file recorded when it was written "
                f"({TABLE_FINGERPRINT_KEY}.{layer_id}): the file was damaged since; re-copy it, or convert "
                "it again"
            )

    def check(e: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        check_finite(t, f"{e.path}: tensor {e.name!r}")
        return t

    modules: dict[int, Engram] = {}
    for layer_id, plan in plans.items():
        # wkv, q_weight, k_weight: checked, then copied into memory (cast to `dtype`)
        state = {k: check(e, stored(e).to(dtype, copy=True)) for k, e in plan.others.items()}
        table: QuantTable | MmapQuantTable | TrainableTable
        rf = plan.fmt.row_format
        if rf is not None:
            assert plan.scale is not None
            w, sc = plan.weight, plan.scale
            if mmap and rf is RowFormat.FP8:
                table = MmapFP8Table(w.path, w.name, sc.name, scale_path=sc.path)
            elif mmap:
                table = MmapQuantTable(w.path, w.name, sc.name, rf, scale_path=sc.path)
            else:
                values, scales = (_mapped(opened, e).clone() for e in (w, sc))
                table = (  # scanned below, by size or with verify, naming the file
                    FP8Table(values, scales, check=False)
                    if rf is RowFormat.FP8
                    else QuantTable(values, scales, rf, check=False)
                )
            assert isinstance(table.weight, torch.Tensor) and isinstance(table.scale, torch.Tensor)
            nbytes = sum(t.numel() * t.element_size() for t in (table.weight, table.scale))
            where = f"{w.path}: table {w.name!r} (with {sc.name!r})"
            if scan_table(nbytes, verify, where):
                check_crc(w, table.weight)
                check_crc(sc, table.scale)
                if (w.path, w.name) not in crcs:  # a file from before CRC32s: its fingerprint, if any
                    check_fingerprint(layer_id, w, table.weight, table.scale, where)
                check_quant_table(table.weight, table.scale, rf, where)
        else:
            data = _mapped(opened, plan.weight).clone()
            where = f"{plan.weight.path}: table {plan.weight.name!r}"
            if scan_table(data.numel() * data.element_size(), verify, where):
                check_crc(plan.weight, data)
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
