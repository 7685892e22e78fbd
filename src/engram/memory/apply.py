"""Applying, removing and stacking memory patches on a loaded model's Engram tables.

`apply_patch(model, patch)` checks that the patch fits (layout, tokenizer, each layer's reader, the
table's size and row format, and the CRC32 of the rows it replaces), keeps the rows' original bytes,
and writes the patch's rows; `remove_patch` writes back what the remaining patches say, so removing
every patch restores each table bit for bit. Stacking: a row one applied patch writes holds that
patch's bytes exactly; a row several write holds base + the sum of their changes (each patch's row
minus the base row, in float32, summed in the order of the patches' fingerprints, so the order of
applying does not matter), written once into the row format; `apply_patch` warns
(`PatchOverlapWarning`) how many rows it shares. Tables in memory only (a trainable table, or a
quantised one): a memory-mapped table is refused. Works on an Hugging Face model with Engram
(`model.engram`) and on the demo's `EngramLM` (its `engrams`, with the hasher given).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import layout_fingerprint
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.hf.attach import EngramAttachment
from engram.memory.patch import FLOAT_ROWS, LayerRows, MemoryPatch, rows_as_float, rows_in_format
from engram.model.module import Engram
from engram.model.table import EngramTable, QuantTable, TrainableTable
from engram.storage.integrity import tensor_crc32

__all__ = [
    "EngramLayers",
    "PatchOverlapWarning",
    "applied_patches",
    "apply_patch",
    "reader_fingerprint",
    "reader_fingerprint_of",
    "remove_patch",
    "rows_crc",
    "table_row_format",
]


class PatchOverlapWarning(UserWarning):
    """A patch shares rows with one already applied: those rows hold the sum of both changes."""


@dataclasses.dataclass(frozen=True)
class EngramLayers:
    """A model's Engram layers {layer id: Engram} and the hasher that addresses their tables."""

    modules: dict[int, Engram]
    hasher: NgramHasher

    @classmethod
    def of(cls, model: nn.Module | EngramLayers, hasher: NgramHasher | None = None) -> EngramLayers:
        """The layers of an HF model with Engram (`model.engram`, also inside a PEFT wrapper) or of an
        `EngramLM` (`model.engrams`; its rows are hashed outside it, so `hasher` is needed)."""
        if isinstance(model, EngramLayers):
            return model
        att = getattr(model, "engram", None)
        if not isinstance(att, EngramAttachment):
            att = next((m for m in model.modules() if isinstance(m, EngramAttachment)), None)
        if att is not None:
            return cls({int(k): m for k, m in att.layers.items()}, att.hasher)  # type: ignore[misc]
        engrams = getattr(model, "engrams", None)
        if isinstance(engrams, nn.ModuleDict) and len(engrams):
            if hasher is None:
                raise ValueError(
                    f"{type(model).__name__} hashes its rows outside the model: pass its hasher "
                    "(hasher=NgramHasher(config, compression)) to find the rows a patch writes"
                )
            return cls({int(k): m for k, m in engrams.items()}, hasher)  # type: ignore[misc]
        raise ValueError(
            f"{type(model).__name__} has no Engram layers: a memory patch writes Engram table rows; load "
            "a model saved with Engram (from_pretrained of an engram folder, or engram.hf.load_engram)"
        )

    @property
    def layout(self) -> str:
        return layout_fingerprint(self.hasher.layout)

    @property
    def tokenizer(self) -> str:
        return self.hasher.compression.fingerprint


def reader_fingerprint(module: Engram) -> str:
    """sha256 of every weight of an Engram layer but its table (the projections, norms and gate that
    read the rows: a patch's rows mean something only to them): `reader_fingerprint_of` its
    parameters and buffers by their names in the module."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return reader_fingerprint_of({n: t for n, t in named if not n.startswith("table.")})


def reader_fingerprint_of(named: dict[str, torch.Tensor]) -> str:
    """sha256 over {name: tensor} (an Engram layer's weights but the table, named as in `Engram`'s
    state_dict: "wkv.weight", ...), in name order, each floating tensor rounded to bfloat16 first, so
    the same model loaded in float32 or bfloat16 has the same one. What a server that holds the
    weights in its own modules (the vLLM plugin) computes from the part's tensors."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach()
        h.update(f"{name}:{list(t.shape)}\n".encode())
        b = t.to("cpu", torch.bfloat16) if t.is_floating_point() else t.cpu()
        h.update(b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def table_row_format(table: EngramTable, where: str = "") -> str:
    """The row format of a table a patch can write: a FLOAT_ROWS name for a trainable table, the
    RowFormat value for a quantised table in memory; ValueError for anything else, with the fix."""
    where = where or type(table).__name__
    if isinstance(table, TrainableTable):
        if table.is_lazy:
            table.materialize()
        return next(k for k, v in FLOAT_ROWS.items() if v == table.weight.dtype)
    if isinstance(table, MmapQuantTable):
        raise ValueError(
            f"{where}: the table is memory-mapped read-only from its file; a patch writes rows, so load "
            "the table into memory (engram.hf.load_engram(..., mmap=False), or the vLLM plugin's memory "
            "mode) and apply the patch there"
        )
    if isinstance(table, QuantTable):
        return table.row_format.value
    raise ValueError(
        f"{where}: a {type(table).__name__} (a table split or tiered by a wrapper) cannot take a patch; "
        "apply patches to the model with its tables in memory, before wrapping it"
    )


def _read_rows(table: EngramTable, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of `rows`' stored contents: (values, scales or None)."""
    idx = rows.to(table.weight.device)
    values = table.weight.detach().index_select(0, idx).cpu()
    if isinstance(table, QuantTable):
        return values, table.scale.detach().index_select(0, idx).cpu()
    return values, None


@torch.no_grad()
def _write_rows(
    table: EngramTable, rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None
) -> None:
    w = table.weight
    idx = rows.to(w.device)
    values = values.to(w.device, w.dtype)
    if scales is None:
        w.index_copy_(0, idx, values)
    else:  # as bytes: torch has no index_copy_ for FP8's float8_e4m3fn values and e8m0 scales on the CPU
        _raw(w).index_copy_(0, idx, _raw(values))
        _raw(table.scale).index_copy_(0, idx, _raw(scales.to(w.device)))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s bytes (uint8; the last dim times its item size): what quantised rows are copied
    as, since torch has no index_put / index_copy_ for some of their dtypes (float8_e8m0fnu)."""
    return t.view(torch.uint8)


def rows_crc(values: torch.Tensor, scales: torch.Tensor | None) -> int:
    """CRC32 of stored rows as a patch records them: float rows rounded to bfloat16 first (so a float32
    and a bfloat16 copy of one table agree), quantised rows' bytes as they are (values, then scales)."""
    if values.is_floating_point() and values.element_size() > 1:
        return tensor_crc32(values.to(torch.bfloat16))
    crc = tensor_crc32(values)
    return crc if scales is None else tensor_crc32(scales, crc)


@dataclasses.dataclass
class _TableState:
    """What a patched table keeps: its original rows (sorted ids, values, scales) and the patches
    applied, with their fingerprints."""

    rows: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor | None
    patches: dict[str, MemoryPatch]


_STATE: weakref.WeakKeyDictionary[EngramTable, _TableState] = weakref.WeakKeyDictionary()


def _base_of(st: _TableState | None, table: EngramTable, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The original contents of `rows` (sorted): kept ones from the state, the rest from the table."""
    values, scales = _read_rows(table, rows)
    if st is not None and st.rows.numel():
        idx = torch.searchsorted(st.rows, rows).clamp(max=st.rows.numel() - 1)
        kept = st.rows[idx] == rows
        values[kept] = st.values[idx[kept]]
        if scales is not None:
            _raw(scales)[kept] = _raw(st.scales[idx[kept]])  # type: ignore[index]
    return values, scales


def _check_fit(layers: EngramLayers, patch: MemoryPatch) -> None:
    name = f"the patch {patch.name!r}" if patch.name else "the patch"
    fix = "write the patch again for this model (engram memorize)"
    if patch.layout != layers.layout:
        raise ValueError(f"{name} was made for another Engram layout (its row ids address other rows); {fix}")
    if patch.tokenizer != layers.tokenizer:
        raise ValueError(f"{name} was made for another tokenizer (its n-grams are other tokens); {fix}")
    for lid in patch.layers:
        m = layers.modules.get(lid)
        if m is None:
            raise ValueError(
                f"{name} writes Engram layer {lid}, which this model does not have "
                f"(it has {sorted(layers.modules)}); {fix}"
            )
        fmt = table_row_format(m.table, f"layer {lid}")
        if m.table.num_rows != patch.table_rows[lid] or m.table.dim != patch.dim:
            raise ValueError(
                f"{name} was made for a table of {patch.table_rows[lid]} x {patch.dim} at layer {lid}, this "
                f"one is {m.table.num_rows} x {m.table.dim}; {fix}"
            )
        if fmt != patch.row_format and not (fmt in FLOAT_ROWS and patch.row_format in FLOAT_ROWS):
            raise ValueError(
                f"{name} holds {patch.row_format} rows, layer {lid}'s table holds {fmt} rows; write the patch "
                "on a model whose table is in that format"
            )
        if reader_fingerprint(m) != patch.readers[lid]:
            raise ValueError(
                f"{name} was made for another model: layer {lid}'s Engram weights (its projections and "
                f"gate, which read the rows) differ from the ones it was written for; {fix}"
            )


def applied_patches(model: nn.Module | EngramLayers, hasher: NgramHasher | None = None) -> list[MemoryPatch]:
    """The patches applied to the model, each once, in the order they were applied."""
    layers = EngramLayers.of(model, hasher)
    seen: dict[str, MemoryPatch] = {}
    for m in layers.modules.values():
        st = _STATE.get(m.table)
        if st is not None:
            for fp, p in st.patches.items():
                seen.setdefault(fp, p)
    return list(seen.values())


def _recompute(table: EngramTable, st: _TableState, lid: int, rows: torch.Tensor, row_format: str) -> None:
    """Write `rows` (sorted) as the patches now applied say (module docstring: the stacking rule)."""
    base_v, base_s = _base_of(st, table, rows)
    n = rows.numel()
    count = torch.zeros(n, dtype=torch.int64)
    single_v, single_s = base_v.clone(), None if base_s is None else base_s.clone()
    base_f: torch.Tensor | None = None
    total: torch.Tensor | None = None
    for fp in sorted(st.patches):
        lr = st.patches[fp].layers.get(lid)
        if lr is None or lr.rows.numel() == 0:
            continue
        idx = torch.searchsorted(lr.rows, rows).clamp(max=lr.rows.numel() - 1)
        hit = lr.rows[idx] == rows
        if not bool(hit.any()):
            continue
        count += hit
        single_v[hit] = lr.values[idx[hit]].to(single_v.dtype)
        if single_s is not None:
            _raw(single_s)[hit] = _raw(lr.scales[idx[hit]])  # type: ignore[index]
        if base_f is None:
            base_f = rows_as_float(base_v, base_s, row_format)
            total = base_f.clone()
        change = rows_as_float(
            lr.values[idx[hit]], None if lr.scales is None else lr.scales[idx[hit]], row_format
        )
        total[hit] += change - base_f[hit]  # type: ignore[index]
    many = count > 1
    if bool(many.any()):
        assert total is not None
        v, s = rows_in_format(total[many], row_format)
        single_v[many] = v.to(single_v.dtype)
        if single_s is not None:
            _raw(single_s)[many] = _raw(s)  # type: ignore[arg-type]
    _write_rows(table, rows, single_v, single_s)


def apply_patch(
    model: nn.Module | EngramLayers, patch: MemoryPatch, *, hasher: NgramHasher | None = None
) -> MemoryPatch:
    """Write `patch`'s rows into the model's tables (checks first: a patch that does not fit changes
    nothing). Returns the patch. ValueError for a patch made for another model, or already applied."""
    layers = EngramLayers.of(model, hasher)
    _check_fit(layers, patch)
    fp = patch.fingerprint
    name = f"the patch {patch.name!r}" if patch.name else "the patch"
    for lid, lr in patch.layers.items():
        table = layers.modules[lid].table
        st = _STATE.get(table)
        if st is not None and fp in st.patches:
            raise ValueError(f"{name} is already applied to this model (remove it first to apply it again)")
        base_v, base_s = _base_of(st, table, lr.rows)
        if rows_crc(base_v, base_s) != lr.before_crc:
            raise ValueError(
                f"{name} was made for another table: the {lr.rows.numel()} rows it replaces at layer {lid} "
                "hold other values here than where it was written (another training run, or the table "
                "changed since); write the patch again for this model (engram memorize)"
            )
    shared: dict[str, int] = {}
    for lid, lr in patch.layers.items():
        table = layers.modules[lid].table
        row_format = table_row_format(table)
        st = _STATE.get(table)
        if st is None:
            st = _STATE[table] = _TableState(
                torch.empty(0, dtype=torch.int64), *_read_rows(table, lr.rows[:0]), {}
            )
        for other_fp, other in st.patches.items():
            o = other.layers.get(lid)
            if o is not None:
                n = int(torch.isin(lr.rows, o.rows).sum())
                if n:
                    shared[other.name or other_fp[:12]] = shared.get(other.name or other_fp[:12], 0) + n
        new = lr.rows[~torch.isin(lr.rows, st.rows)]
        if new.numel():  # keep the original bytes of rows no patch wrote yet
            v, s = _read_rows(table, new)
            rows = torch.cat([st.rows, new])
            order = torch.argsort(rows)
            st.rows = rows[order]
            st.values = torch.cat([st.values, v])[order]
            st.scales = None if s is None else torch.cat([st.scales, s])[order]  # type: ignore[list-item]
        st.patches[fp] = patch
        _recompute(table, st, lid, lr.rows, row_format)
    if shared:
        listed = ", ".join(f"{n} rows with {k!r}" for k, n in shared.items())
        warnings.warn(
            f"{name} shares {listed}: those rows now hold the sum of both patches' changes (removing either "
            "leaves the other's rows exactly)",
            PatchOverlapWarning,
            stacklevel=2,
        )
    return patch


def remove_patch(
    model: nn.Module | EngramLayers, patch: MemoryPatch, *, hasher: NgramHasher | None = None
) -> None:
    """Take `patch` out: its rows hold what the other applied patches say, or their original bytes."""
    layers = EngramLayers.of(model, hasher)
    fp = patch.fingerprint
    tables = [(lid, layers.modules[lid].table) for lid in patch.layers if lid in layers.modules]
    if not tables or any(_STATE.get(t) is None or fp not in _STATE[t].patches for _, t in tables):
        name = f"the patch {patch.name!r}" if patch.name else "the patch"
        raise ValueError(f"{name} is not applied to this model (applied_patches(model) lists those that are)")
    for lid, table in tables:
        st = _STATE[table]
        del st.patches[fp]
        _recompute(table, st, lid, patch.layers[lid].rows, table_row_format(table))
        if not st.patches:
            del _STATE[table]


def layer_rows(
    table: EngramTable, rows: torch.Tensor, row_format: str, before_crc: int | None = None
) -> LayerRows:
    """A `LayerRows` of `rows` (sorted, unique) as `table` holds them now (`before_crc` given: the CRC32
    of the rows the patch replaces; default, these contents' own)."""
    values, scales = _read_rows(table, rows)
    crc = rows_crc(values, scales) if before_crc is None else before_crc
    return LayerRows(rows.cpu(), values, scales, crc)
