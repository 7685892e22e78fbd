"""The Engram part of an HF model with row-sharded tables, written without a gather.

`write_part(model, directory, row_format)` (every rank of the tables' group) writes the part
`engram.hf.save_engram` / `export_fp8` / `export_quantised` write in one process, readable by the same
readers (`engram.hf.load_engram`, `MmapQuantTable`, the row-file tier, the vLLM plugin's folder
check): one safetensors file laid out by rank 0 (`engram.checkpoint.laid_out`), into which every owner
rank writes its own rows at their offsets (a quantised part, in any row format: its rows quantised
there, row by row by `engram.storage.quant.quantize` as the one-process export does), so no rank ever
holds more than its shard and a chunk. With `row_files` (a quantised part) each owner also writes the
same quantised rows into each layer's SSD row file (`engram.storage.rowfile`, in the part's row
format, laid out by rank 0, rows at their slots), byte for byte what
`engram.checkpoint.convert.write_row_files` makes of the finished part. The files are written under
hidden temporary names; once every rank has written, rank 0 records each quantised table's content
fingerprint (one read of the file, a chunk at a time) in the part and its row file's header, the
CRC32 of every tensor (each owner's of its own rows, combined in row order: `crc32_combine`) and the
seal over the metadata (with the base model every rank recorded: `engram.hf.base`), writes
config.json, the compression map and the options, and renames them into place (config.json last).
A rank that fails (or dies: the others' collectives time out) publishes nothing: the folder keeps
what it held. The folder must be shared by the ranks (as sharded checkpoints' is). The part's data,
metadata and row files are the one-process export's byte for byte; only the order of the header's
metadata keys may differ (safetensors, which writes the one-process part, orders them arbitrarily).
Design: docs/distributed.md.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engram.addressing.layout import Layout, layout_fingerprint
from engram.checkpoint.convert import row_file_path
from engram.checkpoint.files import open_tensors, read_header
from engram.checkpoint.hf_config import to_hf_dict
from engram.checkpoint.laid_out import LaidOut, create, lay_out, set_metadata, write_rows
from engram.checkpoint.v41 import (
    BASE_MODEL_KEY,
    CONFIG_FILE,
    CRC32_KEY,
    INDEX_FILE,
    LAYOUT_FINGERPRINT_KEY,
    SEAL_KEY,
    TABLE_FINGERPRINT_KEY,
    TABLE_FORMAT_KEY,
    crc32_entry,
    foreign_config,
    is_row_file_name,
    is_shard_name,
    layer_prefix,
    seal_of,
)
from engram.distributed.guard import RankError
from engram.distributed.hf.data_parallel import ShardedTableSync
from engram.distributed.sharded_table import ShardedTable
from engram.hf.attach import EngramAttachment, get_attachment
from engram.hf.base import base_record
from engram.hf.io import COMPRESSION_FILE, OPTIONS_FILE, engram_part
from engram.rowformat.formats import RowFormat, as_row_format, format_of
from engram.rowformat.fp8 import BLOCK
from engram.storage import quant
from engram.storage.integrity import crc32_combine, fingerprint_blocks, tensor_crc32
from engram.storage.rowfile import RowFileHeader, create_row_file, set_row_file_tables, write_row_range

__all__ = ["PART_FILE", "write_part"]

PART_FILE = "model-00001-of-00001.safetensors"  # one file (the V4.1 format's name for a single shard)
_QUANT_ROWS = 1 << 16  # rows quantised at a time: the float temporaries stay a few MB
_FINGERPRINT_HOLD = "0" * 64  # reserved for a table's sha256 (and the seal) until the whole file is written
# (first row, CRC32, bytes) of the rows of a table tensor one rank wrote
_Pieces = dict[str, tuple[int, int, int]]


def _read_as(fmt: RowFormat, dim: int) -> RowFormat:
    """The format rows of `fmt`, `dim` wide, are read as: what their tensors' dtypes and widths say
    (`format_of`, the one-process writer's and the readers' rule), `fmt` but for int8-row rows one block
    wide, which are int8's bytes."""
    return format_of(
        torch.empty((0, fmt.value_width(dim)), dtype=fmt.value_dtype),
        torch.empty((0, fmt.scales_per_row(dim)), dtype=fmt.scale_dtype),
    )


def _plan(
    att: EngramAttachment, fmt: RowFormat | None, base: str
) -> tuple[dict, dict[str, torch.Tensor], dict[str, str]]:
    """(specs {name: (dtype, shape)} of every tensor (tables in row format `fmt`, None: float), the
    dense tensors {name: tensor} rank 0 writes, metadata with each quantised table's fingerprint, the
    CRC32s and the seal reserved, the base model record `base`, and each table's row format where it
    is not FP8, as `engram.checkpoint.v41.shard_metadata` records it)."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    dense: dict[str, torch.Tensor] = {}
    meta = {LAYOUT_FINGERPRINT_KEY: layout_fingerprint(Layout(att.config)), BASE_MODEL_KEY: base}
    for lid in sorted(att.layers, key=int):
        m, p = att.layers[lid], layer_prefix(int(lid))
        t = m.table
        if not isinstance(t, ShardedTable):
            raise ValueError(
                f"layer {lid}'s table is not row-sharded: use engram.hf.save_engram / export_fp8"
            )
        if fmt is not None:
            if t.dim % BLOCK or t.dim == 0:  # `quantize_table`'s check, naming the layer
                raise ValueError(
                    f"layer {lid}'s rows are {t.dim} wide: {fmt.value} rows need a positive multiple of "
                    f"{BLOCK}; export this model's part in float (save_engram)"
                )
            values = (fmt.value_dtype, (t.num_rows, fmt.value_width(t.dim)))
            scales = (fmt.scale_dtype, (t.num_rows, fmt.scales_per_row(t.dim)))
            specs[p + "embed.weight"], specs[p + "embed.scale"] = values, scales
            meta[f"{TABLE_FINGERPRINT_KEY}.{lid}"] = _FINGERPRINT_HOLD
            said = _read_as(fmt, t.dim)  # as `shard_metadata` records it
            if said is not RowFormat.FP8:  # (V4.1's own FP8 parts carry no such key)
                meta[f"{TABLE_FORMAT_KEY}.{lid}"] = said.value
        else:
            specs[p + "embed.weight"] = (t.weight.dtype, (t.num_rows, t.dim))
        for k, v in m.state_dict().items():
            if not k.startswith("table."):
                dense[p + k] = v.detach()
                specs[p + k] = (v.dtype, tuple(v.shape))
    meta[CRC32_KEY] = crc32_entry(dict.fromkeys(specs, 0))  # fixed width: set once every rank wrote
    meta[SEAL_KEY] = _FINGERPRINT_HOLD
    return specs, dense, meta


def _row_files(
    att: EngramAttachment, fmt: RowFormat, out: Path, token: str
) -> dict[str, tuple[Path, RowFileHeader]]:
    """{layer id: (the temporary path of its row file, the header)}: the tables' fingerprints are left
    empty, filled by `_publish` once every row is written (as `write_row_files` records them)."""
    layout_fp = layout_fingerprint(Layout(att.config))
    label = out.name  # the config's name as the part's reader names it (its folder's): write_row_files' label
    files = {}
    for lid in sorted(att.layers, key=int):
        t = att.layers[lid].table
        final = row_file_path(out, int(lid))
        header = RowFileHeader(  # the format write_row_files gives: the one the part's table reads as
            t.num_rows, t.dim, fmt=_read_as(fmt, t.dim), layer_id=int(lid), identity=layout_fp, label=label
        )
        files[lid] = (final.with_name(f".{final.name}.tmp-{token}"), header)
    return files


def _write_own_rows(
    path: Path,
    laid: LaidOut,
    att: EngramAttachment,
    fmt: RowFormat | None,
    rows: dict[str, tuple[Path, RowFileHeader]],
) -> _Pieces:
    """Write this rank's rows of every table; the (first row, CRC32, bytes) of what it wrote of each."""
    pieces: _Pieces = {}
    for lid in sorted(att.layers, key=int):
        t, p = att.layers[lid].table, layer_prefix(int(lid))
        w = t.weight.detach()  # (hi - lo, dim) this rank's rows
        if not w.shape[0]:
            continue
        if fmt is None:
            write_rows(path, laid, p + "embed.weight", t.lo, w)
            pieces[p + "embed.weight"] = (t.lo, tensor_crc32(w), w.numel() * w.element_size())
            continue
        crc_v = crc_s = 0
        for a in range(0, w.shape[0], _QUANT_ROWS):
            # `quantize_table`'s rule (the one-process export's); row by row, so any split gives its bytes
            values, scales = quant.quantize(w[a : a + _QUANT_ROWS], fmt)
            write_rows(path, laid, p + "embed.weight", t.lo + a, values)
            write_rows(path, laid, p + "embed.scale", t.lo + a, scales)
            crc_v, crc_s = tensor_crc32(values, crc_v), tensor_crc32(scales, crc_s)
            if lid in rows:
                write_row_range(*rows[lid], t.lo + a, values, scales)
        n = w.shape[0]
        pieces[p + "embed.weight"] = (t.lo, crc_v, n * fmt.value_bytes(t.dim))
        pieces[p + "embed.scale"] = (t.lo, crc_s, n * fmt.scale_bytes(t.dim))
    return pieces


def _crc32s(laid: LaidOut, dense: dict[str, torch.Tensor], pieces: list[_Pieces]) -> dict[str, int]:
    """The CRC32 of every tensor of the part: the dense ones' own, each table's combined from its
    owners' pieces in row order (which must cover it: an internal invariant)."""
    crcs = {name: tensor_crc32(v) for name, v in dense.items()}
    for name in laid.spans:
        if name in crcs:
            continue
        own = sorted(p[name] for p in pieces if name in p)
        crc, covered = 0, 0
        for _first, piece_crc, nbytes in own:
            crc = crc32_combine(crc, piece_crc, nbytes)
            covered += nbytes
        a, b = laid.spans[name]
        assert covered == b - a, f"{name}: the owners' rows cover {covered} of its {b - a} bytes"
        crcs[name] = crc
    return crcs


def _publish(
    tmp: Path,
    out: Path,
    att: EngramAttachment,
    quantised: bool,
    rows: dict[str, tuple[Path, RowFileHeader]],
    crcs: dict[str, int],
) -> None:
    """Rank 0, once every rank has written: fingerprints, CRC32s and the seal, the small files, then
    the renames."""
    if quantised:
        f = open_tensors(tmp)
        for lid in att.layers:
            p = layer_prefix(int(lid))
            w, sc = p + "embed.weight", p + "embed.scale"  # read a block at a time: nothing mapped
            values, scales = ((blk for _, blk in f.iter_rows(n)) for n in (w, sc))
            fp = fingerprint_blocks(f.entry(w).shape, f.entry(sc).shape, values, scales)
            set_metadata(tmp, f"{TABLE_FINGERPRINT_KEY}.{lid}", fp)
            if lid in rows:
                set_row_file_tables(rows[lid][0], fp)
    set_metadata(tmp, CRC32_KEY, crc32_entry(crcs))
    set_metadata(tmp, SEAL_KEY, seal_of(read_header(tmp)[1]["__metadata__"]))  # last: over all of it
    small = {
        CONFIG_FILE: tmp.with_name(tmp.name + ".config"),
        COMPRESSION_FILE: tmp.with_name(tmp.name + ".map"),
        OPTIONS_FILE: tmp.with_name(tmp.name + ".options"),
    }
    try:
        small[CONFIG_FILE].write_text(json.dumps(to_hf_dict(att.config), indent=2) + "\n")
        att.compression.save(small[COMPRESSION_FILE])
        options = {"boundaries": att.rows.boundaries, "eos_token_id": att.rows.eos_token_id}
        small[OPTIONS_FILE].write_text(json.dumps(options, indent=2) + "\n")
        os.replace(tmp, out / PART_FILE)
        (out / INDEX_FILE).unlink(missing_ok=True)  # (an earlier save in several shards)
        for lid, (path, _) in rows.items():
            os.replace(path, row_file_path(out, int(lid)))
        os.replace(small[COMPRESSION_FILE], out / COMPRESSION_FILE)
        os.replace(small[OPTIONS_FILE], out / OPTIONS_FILE)
        os.replace(small[CONFIG_FILE], out / CONFIG_FILE)  # last: the part is complete
    finally:
        for p in small.values():
            p.unlink(missing_ok=True)
    written = {row_file_path(out, int(lid)).name for lid in rows}
    for old in out.iterdir():  # shards of an earlier save with another count, row files of its tables
        if (is_shard_name(old.name) and old.name != PART_FILE) or (
            is_row_file_name(old.name) and old.name not in written
        ):
            old.unlink()


_COLLECTIVE = (
    "save_engram / export_fp8 / export_quantised is a collective: every rank of the tables' group calls it "
    "at the same point, and one that does not (or fails, or dies) leaves the others waiting until prepare_data_parallel's timeout"
)


_KEPT = "nothing was published: the folder keeps what it held"
_SHARED = (
    "every rank must pass the same folder, one that every rank's machine shares (as sharded checkpoints')"
)


def _lost(group: dist.ProcessGroup | None, what: str, e: RuntimeError, kept: str = _KEPT) -> RankError:
    """A collective of the write that failed (a rank absent, dead, or past the timeout), as RankError."""
    return RankError(f"rank {dist.get_rank(group)} lost the other ranks {what} ({e}); {_COLLECTIVE}; {kept}")


def _agree(
    error: BaseException | None, group: dist.ProcessGroup | None, what: str, kept: str = _KEPT
) -> None:
    """Raise on every rank if any rank failed (its own error where it failed); a rank that cannot hear
    from every other one raises RankError."""
    failed = torch.tensor([int(error is not None)])
    try:
        dist.all_reduce(failed, group=group)  # a CPU tensor: writing the part is a host-side affair
    except RuntimeError as e:
        if error is not None:
            raise error from e
        raise _lost(group, f"after it tried {what}", e, kept) from e
    if error is not None:
        raise error
    if int(failed):
        raise RuntimeError(f"another rank failed {what}; see its error (nothing was published)")


def write_part(
    model: nn.Module,
    directory: str | os.PathLike[str],
    row_format: RowFormat | str | None,
    *,
    row_files: bool = False,
) -> Path | None:
    """Write the Engram part of `model` (row-sharded tables, `prepare_data_parallel`) to `directory`
    without gathering a table, its tables in `row_format` (`RowFormat`: "fp8", "int8", "int8-row",
    "int4"; None: float, as they are): every rank calls it; rank 0 returns the part's folder, the
    others None. `row_files` (a quantised part only): each layer's SSD row file too
    (`row_file_path(part, layer)`, what the row-file tier and the vLLM plugin's tables='rowfile'
    read), written by the same ranks, published with the part."""
    fmt = None if row_format is None else as_row_format(row_format)
    if row_files and fmt is None:
        raise ValueError(
            "row files hold quantised rows: row_files=True needs a quantised part (export_fp8, or "
            "export_quantised with a row format)"
        )
    att = get_attachment(model)
    sync = att.table_sync
    if not isinstance(sync, ShardedTableSync):
        raise ValueError(
            "the model's Engram tables are not row-sharded: use engram.hf.save_engram / export_fp8"
        )
    group = sync.tables[0].group  # the tables' group: every rank, collectives bounded in time
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    # every rank (FSDP2's parameters are sampled by collectives); the same record on every rank
    specs, dense, meta = _plan(att, fmt, base_record(model))
    laid = lay_out(specs, meta)  # the same on every rank
    out = engram_part(directory)
    token = [uuid.uuid4().hex]
    try:
        dist.broadcast_object_list(token, src=src, group=group)
    except RuntimeError as e:
        raise _lost(group, "before writing the Engram part", e) from e
    tmp = out / f".{PART_FILE}.tmp-{token[0]}"
    rows = _row_files(att, fmt, out, token[0]) if fmt is not None and row_files else {}
    error: BaseException | None = None
    try:
        if rank == 0:
            try:
                if foreign_config(out):
                    raise ValueError(
                        f"{out / CONFIG_FILE} is not an Engram checkpoint's config.json (another model's): "
                        "saving here would overwrite it; save into an empty folder or an HF model folder (the "
                        "part goes to its engram/ subfolder)"
                    )
                out.mkdir(parents=True, exist_ok=True)
                create(tmp, laid)
                for path, header in rows.values():
                    create_row_file(path, header)
                for name, v in dense.items():
                    write_rows(tmp, laid, name, 0, v.reshape(1) if v.dim() == 0 else v)
            except Exception as e:  # every rank must hear of it, whatever it is
                error = e
        _agree(error, group, "to lay out the Engram part")
        try:
            if not tmp.exists():  # another folder than rank 0's, or one this machine does not share
                raise ValueError(f"rank {rank} does not see {tmp}, laid out by rank 0: {_SHARED}")
            mine = _write_own_rows(tmp, laid, att, fmt, rows)
        except Exception as e:  # every rank must hear of it, whatever it is
            error = e
        _agree(error, group, "to write its rows of the Engram part")
        pieces: list = [None] * dist.get_world_size(group)
        try:  # each owner's CRC32s of its rows, for rank 0 to combine
            dist.all_gather_object(pieces, mine, group=group)
        except RuntimeError as e:
            raise _lost(group, "while gathering the CRC32s of the rows written", e) from e
        if rank == 0:
            try:
                _publish(tmp, out, att, fmt is not None, rows, _crc32s(laid, dense, pieces))
            except Exception as e:  # every rank must hear of it, whatever it is
                error = e
        kept = "rank 0 publishes the part once every rank wrote its rows (config.json last)"
        kept = "the part was published" if rank == 0 and error is None else kept
        _agree(error, group, "to publish the Engram part", kept)
    finally:
        if rank == 0:
            tmp.unlink(missing_ok=True)  # a failed write publishes nothing (gone once published)
            for path, _ in rows.values():
                path.unlink(missing_ok=True)
    return out if rank == 0 else None
