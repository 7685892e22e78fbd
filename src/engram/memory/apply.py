"""Applying, removing and stacking memory patches on a loaded model's Engram tables.

`apply_patch(model, patch)` checks that the patch fits (layout, tokenizer, each layer's reader, the
table's size and row format, and a sketch of the rows it replaces), keeps the rows' original bytes,
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
import itertools
import warnings
import weakref
import zlib
from typing import Any

import torch
from torch import nn

from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import layout_fingerprint
from engram.checkpoint.mmap_table import MmapQuantTable
from engram.hf.attach import EngramAttachment
from engram.memory.patch import (
    FLOAT_ROWS,
    LayerRows,
    MemoryPatch,
    rows_as_float,
    rows_in_format,
    rows_sketch,
    sketch_mismatch,
)
from engram.model.module import Engram
from engram.model.table import EngramTable, QuantTable, TrainableTable

__all__ = [
    "EngramLayers",
    "PatchOverlapWarning",
    "applied_patches",
    "apply_patch",
    "check_addressing",
    "reader_mismatch",
    "reader_signature",
    "reader_signature_of",
    "remove_patch",
    "table_row_format",
]


class PatchOverlapWarning(UserWarning):
    """A patch shares rows with one already applied: those rows hold the sum of both changes."""


@dataclasses.dataclass(frozen=True)
class EngramLayers:
    """A model's Engram layers {layer id: Engram} and the hasher that addresses their tables.

    What every function of `engram.memory` works on; `EngramLayers.of(model)` finds them in a model.

    Args:
        modules: The Engram module of each layer, by layer id.
        hasher: The hasher that gives the rows each token reads in those layers' tables.
    """

    modules: dict[int, Engram]
    hasher: NgramHasher

    @classmethod
    def of(cls, model: nn.Module | EngramLayers, hasher: NgramHasher | None = None) -> EngramLayers:
        """The Engram layers of a model.

        An HF model with Engram (`model.engram`, also inside a PEFT wrapper) or an `EngramLM`
        (`model.engrams`; its rows are hashed outside it, so `hasher` is needed).

        Args:
            model: The model, or an `EngramLayers` (returned as it is).
            hasher: The hasher of an `EngramLM`'s rows; an HF model's attachment has its own, used
                instead.

        Returns:
            The model's Engram modules and the hasher that addresses their tables.

        Raises:
            ValueError: The model is an `EngramLM` and no `hasher` is given, or it has no Engram layers.
        """
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
        """The fingerprint of the hasher's layout (`engram.addressing.layout.layout_fingerprint`)."""
        return layout_fingerprint(self.hasher.layout)

    @property
    def tokenizer(self) -> str:
        """The tokenizer fingerprint of the hasher's compression map."""
        return self.hasher.compression.fingerprint


READER_PROBES = 64  # values of each reader weight a patch records (at seeded positions)
READER_TOLERANCE = 2.0**-7  # relative: bfloat16 keeps 8 bits, float16 11; another model differs by O(1)


def reader_signature(module: Engram) -> dict[str, Any]:
    """What a patch records of the Engram weights that read its rows (every weight of the layer but the
    table: `wkv`, norms, gate): `reader_signature_of` its parameters and buffers by their names."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return reader_signature_of({n: t for n, t in named if not n.startswith("table.")})


def reader_signature_of(named: dict[str, torch.Tensor]) -> dict[str, Any]:
    """{name: {"shape", "rms", "probes"}} over {name: tensor} (named as in `Engram`'s state_dict:
    "wkv.weight", ...): each tensor's shape, root mean square and its values at `READER_PROBES`
    positions drawn from a generator seeded by its name and size. Compared with a tolerance
    (`reader_mismatch`), so the same weights in float32, bfloat16 or float16 match, and weights of
    another model or training run do not."""
    out: dict[str, Any] = {}
    for name in sorted(named):
        flat = named[name].detach().reshape(-1)
        seed = zlib.crc32(f"{name}:{flat.numel()}".encode())
        n = min(READER_PROBES, flat.numel())
        idx = torch.randint(0, max(flat.numel(), 1), (n,), generator=torch.Generator().manual_seed(seed))
        x = flat.float() if not flat.is_floating_point() else flat
        rms = torch.linalg.vector_norm(x, dtype=torch.float32) / max(flat.numel(), 1) ** 0.5
        probes = x.index_select(0, idx.to(x.device)).float().cpu()
        out[name] = {
            "shape": list(named[name].shape),
            "rms": float(rms),
            "probes": [float(v) for v in probes],
        }
    return out


def reader_mismatch(have: dict[str, Any], want: dict[str, Any]) -> str | None:
    """None when two reader signatures describe the same weights (to `READER_TOLERANCE` of each value,
    plus a thousandth of the tensor's rms for values near zero); else what differs."""
    if sorted(have) != sorted(want):
        return f"weights {sorted(want)} expected, found {sorted(have)}"
    for name, w in want.items():
        h = have[name]
        if h["shape"] != w["shape"]:
            return f"{name} has shape {h['shape']}, expected {w['shape']}"
        scale = max(abs(h["rms"]), abs(w["rms"]))
        if abs(h["rms"] - w["rms"]) > READER_TOLERANCE * scale:
            return f"{name} has rms {h['rms']:.6g}, expected {w['rms']:.6g}"
        for a, b in zip(h["probes"], w["probes"], strict=True):
            if abs(a - b) > READER_TOLERANCE * max(abs(a), abs(b)) + 1e-3 * scale:
                return f"{name} holds {a:.6g} where it held {b:.6g}"
    return None


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


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor (FP8 values, ue8m0 scales) as bytes: indexing writes are not implemented
    for those dtypes, and bytes are what a patch moves."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


@torch.no_grad()
def _write_rows(
    table: EngramTable, rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None
) -> None:
    w = table.weight
    idx = rows.to(w.device)
    _u8(w).index_copy_(0, idx, _u8(values.to(w.device, w.dtype)))
    if scales is not None:
        _u8(table.scale).index_copy_(0, idx, _u8(scales.to(w.device)))


@dataclasses.dataclass
class _TableState:
    """What a patched table keeps: its original rows (sorted ids, values, scales) and the patches
    applied, with their fingerprints."""

    rows: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor | None
    patches: dict[str, MemoryPatch]
    applied_at: dict[str, int] = dataclasses.field(default_factory=dict)  # fingerprint: `_APPLIED` count


_STATE: weakref.WeakKeyDictionary[EngramTable, _TableState] = weakref.WeakKeyDictionary()
_APPLIED = itertools.count()  # apply_patch's calls in order, for applied_patches' order


def _base_of(st: _TableState | None, table: EngramTable, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The original contents of `rows` (sorted): kept ones from the state, the rest from the table."""
    values, scales = _read_rows(table, rows)
    if st is not None and st.rows.numel():
        idx = torch.searchsorted(st.rows, rows).clamp(max=st.rows.numel() - 1)
        kept = st.rows[idx] == rows
        _u8(values)[kept] = _u8(st.values)[idx[kept]]
        if scales is not None:
            _u8(scales)[kept] = _u8(st.scales)[idx[kept]]  # type: ignore[arg-type]
    return values, scales


def check_addressing(
    patch: MemoryPatch, layout: str, tokenizer: str, tables: dict[int, tuple[int, int]]
) -> None:
    """The part of a patch's fit that needs no weights: the model's layout fingerprint, its tokenizer
    fingerprint, and its tables' shapes ({layer id: (rows, row width)}); `apply_patch` checks this and
    more (the row format, the layers' readers), and a server checks this before its tables load.

    Raises:
        ValueError: The patch was made for another layout or tokenizer, writes a layer the model
            does not have, or was made for a table of another shape; the message names the fix.
    """
    name = f"the patch {patch.name!r}" if patch.name else "the patch"
    fix = "write the patch again for this model (engram memorize)"
    if patch.layout != layout:
        raise ValueError(f"{name} was made for another Engram layout (its row ids address other rows); {fix}")
    if patch.tokenizer != tokenizer:
        raise ValueError(f"{name} was made for another tokenizer (its n-grams are other tokens); {fix}")
    for lid in patch.layers:
        if lid not in tables:
            raise ValueError(
                f"{name} writes Engram layer {lid}, which this model does not have (it has {sorted(tables)}); {fix}"
            )
        rows, dim = tables[lid]
        if rows != patch.table_rows[lid] or dim != patch.dim:
            raise ValueError(
                f"{name} was made for a table of {patch.table_rows[lid]} x {patch.dim} at layer {lid}, this "
                f"one is {rows} x {dim}; {fix}"
            )


def _check_fit(layers: EngramLayers, patch: MemoryPatch) -> None:
    name = f"the patch {patch.name!r}" if patch.name else "the patch"
    fix = "write the patch again for this model (engram memorize)"
    tables = {lid: (m.table.num_rows, m.table.dim) for lid, m in layers.modules.items()}
    check_addressing(patch, layers.layout, layers.tokenizer, tables)
    for lid in patch.layers:
        m = layers.modules[lid]
        fmt = table_row_format(m.table, f"layer {lid}")
        if fmt != patch.row_format and not (fmt in FLOAT_ROWS and patch.row_format in FLOAT_ROWS):
            raise ValueError(
                f"{name} holds {patch.row_format} rows, layer {lid}'s table holds {fmt} rows; write the patch "
                "on a model whose table is in that format"
            )
        differs = reader_mismatch(reader_signature(m), patch.readers[lid])
        if differs is not None:
            raise ValueError(
                f"{name} was made for another model: layer {lid}'s Engram weights (its projections and "
                f"gate, which read the rows) differ from the ones it was written for ({differs}); {fix}"
            )


def applied_patches(model: nn.Module | EngramLayers, hasher: NgramHasher | None = None) -> list[MemoryPatch]:
    """The memory patches applied to a model.

    Args:
        model: An HF model with Engram, an `EngramLM`, or its `EngramLayers`.
        hasher: The hasher of an `EngramLM`'s rows (`EngramLayers.of`).

    Returns:
        Each applied patch once, in the order they were applied.

    Raises:
        ValueError: The model has no Engram layers, or is an `EngramLM` and no `hasher` is given.
    """
    layers = EngramLayers.of(model, hasher)
    seen: dict[str, tuple[int, MemoryPatch]] = {}
    for m in layers.modules.values():
        st = _STATE.get(m.table)
        if st is not None:
            for fp, p in st.patches.items():
                seen.setdefault(fp, (st.applied_at[fp], p))
    return [p for _, p in sorted(seen.values(), key=lambda x: x[0])]


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
        _u8(single_v)[hit] = _u8(lr.values[idx[hit]].to(single_v.dtype))
        if single_s is not None:
            _u8(single_s)[hit] = _u8(lr.scales)[idx[hit]]  # type: ignore[arg-type]
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
        _u8(single_v)[many] = _u8(v.to(single_v.dtype))
        if single_s is not None:
            _u8(single_s)[many] = _u8(s)  # type: ignore[arg-type]
    _write_rows(table, rows, single_v, single_s)


def apply_patch(
    model: nn.Module | EngramLayers, patch: MemoryPatch, *, hasher: NgramHasher | None = None
) -> MemoryPatch:
    """Write a patch's rows into the model's Engram tables.

    Checks first: a patch that does not fit changes nothing. It must have been made for this model:
    the same layout, tokenizer, layers, table sizes, row format (a float patch fits a table of any
    float dtype), readers (`reader_signature`) and, in each row it replaces, the same contents
    (compared with the table as it was before any patch). The rows' original bytes are kept, so
    `remove_patch` restores them; a row that other applied patches write too holds the sum of their
    changes (module docstring: the stacking rule).

    Args:
        model: An HF model with Engram, an `EngramLM`, or its `EngramLayers`; its tables in memory.
        patch: The patch (`memorize`, `load_patch`).
        hasher: The hasher of an `EngramLM`'s rows (`EngramLayers.of`).

    Returns:
        `patch`.

    Raises:
        ValueError: The patch was made for another model, layout, tokenizer or table (or the table
            changed since), a table is memory-mapped or wrapped, or the patch is already applied.

    Warns:
        PatchOverlapWarning: The patch shares rows with one already applied (how many, with which).
    """
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
        x = rows_as_float(base_v, base_s, table_row_format(table))
        differ = sketch_mismatch(rows_sketch(x), lr.before, x.abs().sum(-1))
        if differ:
            raise ValueError(
                f"{name} was made for another table: {differ} of the {lr.rows.numel()} rows it replaces at "
                f"layer {lid} hold other values here than where it was written (another training run, or "
                "the table changed since); write the patch again for this model (engram memorize)"
            )
    shared: dict[str, int] = {}
    at = next(_APPLIED)
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
        st.applied_at[fp] = at
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
    """Take an applied patch out of the model's Engram tables.

    Its rows hold what the other applied patches say, or their original bytes: removing every patch
    restores each table bit for bit.

    Args:
        model: An HF model with Engram, an `EngramLM`, or its `EngramLayers`.
        patch: A patch applied to it (`applied_patches`).
        hasher: The hasher of an `EngramLM`'s rows (`EngramLayers.of`).

    Raises:
        ValueError: The patch is not applied to this model (or the model has no Engram layers).
    """
    layers = EngramLayers.of(model, hasher)
    fp = patch.fingerprint
    tables = [(lid, layers.modules[lid].table) for lid in patch.layers if lid in layers.modules]
    if not tables or any(_STATE.get(t) is None or fp not in _STATE[t].patches for _, t in tables):
        name = f"the patch {patch.name!r}" if patch.name else "the patch"
        raise ValueError(f"{name} is not applied to this model (applied_patches(model) lists those that are)")
    for lid, table in tables:
        st = _STATE[table]
        del st.patches[fp]
        del st.applied_at[fp]
        _recompute(table, st, lid, patch.layers[lid].rows, table_row_format(table))
        if not st.patches:
            del _STATE[table]


def layer_rows(table: EngramTable, rows: torch.Tensor, row_format: str) -> LayerRows:
    """A `LayerRows` of `rows` (sorted, unique) as `table` holds them now, their own sketch as `before`
    (what a patch replacing them with other values records)."""
    values, scales = _read_rows(table, rows)
    return LayerRows(rows.cpu(), values, scales, rows_sketch(rows_as_float(values, scales, row_format)))
