"""The V4.1 Engram path end to end, on a laptop (the `engram run-layer` command is `engram.cli`'s): text
-> DeepSeek-V4 tokens -> hashed rows -> memory-mapped FP8 table rows -> each layer's Engram, on a real
or scaled-down V4.1 checkpoint, returned as a JSON-ready report. Knows no backbone (a pseudo
embedding stands in). Design: docs/training.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram.addressing.compression import TokenizerCompression, known_compression, resolve_tokenizer
from engram.addressing.hashing import NgramHasher
from engram.addressing.layout import Layout
from engram.checkpoint.convert import make_scaled_v41_checkpoint
from engram.checkpoint.tokenizer_fit import V41_TOKENIZER, check_tokenizer_fit
from engram.checkpoint.v41 import load_engram_modules
from engram.config import EngramConfig
from engram.rowformat.fp8 import BLOCK
from engram.storage.integrity import SCAN_LIMIT_BYTES

__all__ = [
    "DEFAULT_BASE",
    "DEFAULT_HIDDEN_SIZE",
    "DEFAULT_TEXT",
    "pseudo_embedding",
    "run_layer",
]

DEFAULT_TEXT = "Only Alexander the Great could tame the horse Bucephalus."
DEFAULT_BASE = 4096  # prime-search base of the built checkpoint: ~98K rows, ~26 MB a table
DEFAULT_HIDDEN_SIZE = 64
TOKENIZER = V41_TOKENIZER
# A built checkpoint larger than this is refused: --base near V4.1's 16000000 would write ~200 GB.
_MAX_BUILD_BYTES = 2 * 10**9


def pseudo_embedding(token_ids: np.ndarray, hc: int, dim: int, seed: int = 0) -> torch.Tensor:
    """(1, T, hc, dim) float32: hc identical copies (the mHC streams at the model's entrance) of a
    unit-variance vector that depends only on (seed, token id), so a repeated token repeats it."""
    uniq, inverse = np.unique(np.asarray(token_ids, dtype=np.int64), return_inverse=True)
    # numpy's SeedSequence mixes (seed, id) into independent streams (torch's generator keeps 32 bits)
    vecs = np.stack([np.random.default_rng([seed, int(t)]).standard_normal(dim) for t in uniq])  # (U, dim)
    x = torch.from_numpy(vecs[inverse.reshape(-1)].astype(np.float32))  # (T, dim)
    return x[None, :, None, :].expand(1, x.shape[0], hc, dim).contiguous()


def _build_config_check(base: int, hidden_size: int) -> None:
    """Refuse a --base whose tables would not fit a laptop, before writing anything."""
    config = EngramConfig.preset("deepseek-v4.1").replace(
        engram_vocab_size=(base,) * 3, hidden_size=hidden_size
    )
    row_bytes = config.head_dim + config.head_dim // BLOCK  # FP8 values + ue8m0 scales
    total = sum(Layout(config).num_embeddings) * row_bytes
    if total > _MAX_BUILD_BYTES:
        raise ValueError(
            f"--base {base} would write {total / 1e9:.1f} GB of tables (limit {_MAX_BUILD_BYTES / 1e9:.0f} GB); "
            "use a smaller --base (default 4096) or pass --checkpoint DIR"
        )


def run_layer(
    checkpoint: str | os.PathLike[str] | None = None,
    text: str = DEFAULT_TEXT,
    *,
    base: int | None = None,
    hidden_size: int | None = None,
    seed: int = 0,
    compression: TokenizerCompression | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Run every Engram layer of a checkpoint (V4.1: layer 1, then 14) over `text`; return the report.

    Without `checkpoint`, a scaled V4.1 checkpoint (`base`, default 4096; `hidden_size`, default 64;
    weights from `seed`) is built in a temporary directory and removed afterwards. `compression` is the
    DeepSeek-V4 compression map if the caller has it (built from the tokenizer otherwise, ~3 s).
    The report holds per token its id, text, compressed id and, per layer, its rows, whether each row
    lies in its head's [offset, offset + prime) and the gate of each stream; per layer the table's
    rows and bytes and max |delta h|. `ok` is False if a row is out of range or a gate is not in (0, 1);
    `problems` says which. A damaged checkpoint (NaN / Inf in a weight or in a table row the text reads)
    raises ValueError naming the tensor, the row and the fix.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text={text!r} is empty; give some text to tokenize, e.g. {DEFAULT_TEXT!r}")
    if checkpoint is not None:
        given = [f"--{n}" for n, v in (("base", base), ("hidden-size", hidden_size)) if v is not None]
        if given:
            raise ValueError(
                f"{' and '.join(given)} size the checkpoint run-layer builds, but --checkpoint {checkpoint} "
                "is given (its config.json decides); drop one or the other"
            )
        return _run(Path(checkpoint), text, seed, compression, verify=verify)
    base = DEFAULT_BASE if base is None else base
    hidden_size = DEFAULT_HIDDEN_SIZE if hidden_size is None else hidden_size
    _build_config_check(base, hidden_size)
    with tempfile.TemporaryDirectory(prefix="engram-run-layer-") as tmp:
        t0 = time.perf_counter()
        config = make_scaled_v41_checkpoint(tmp, base=base, hidden_size=hidden_size, seed=seed)
        build_s = time.perf_counter() - t0
        # _run returns plain Python values only: the memory maps of the tables are gone when it returns.
        report = _run(Path(tmp), text, seed, compression, config=config)
    report["seconds"]["build_checkpoint"] = build_s
    return report


def _run(
    ckpt_dir: Path,
    text: str,
    seed: int,
    compression: TokenizerCompression | None,
    *,
    config: EngramConfig | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """The run on the checkpoint in `ckpt_dir`; `config` is the one it was just built with (its name is
    kept), None for a given checkpoint (read from its config.json)."""
    built = config is not None
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    # FP8 tables memory-mapped, weights fp32; NaN / Inf refused (large tables: with verify)
    config, modules = load_engram_modules(ckpt_dir, config, verify=verify)
    seconds["load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok = resolve_tokenizer(TOKENIZER)
    if compression is None:
        compression = known_compression(TOKENIZER)
    else:
        compression.check_tokenizer(tok)  # a map of another tokenizer would hash other rows
    # config.json must fit the DeepSeek-V4 map, checked as `engram convert` checks it
    compression = check_tokenizer_fit(ckpt_dir, config, compression, tokenizer=TOKENIZER)
    hasher = NgramHasher(config, compression)
    seconds["tokenizer"] = time.perf_counter() - t0

    ids = np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)  # (T,)
    if ids.size == 0:
        raise ValueError(f"text={text!r} gives no tokens; give some words")
    t0 = time.perf_counter()
    rows = hasher.hash(ids[None])  # (1, T, n_layers, heads) int64
    seconds["hash"] = time.perf_counter() - t0

    # Each row must lie in its own head's segment of the layer's table: [offset, offset + prime).
    offsets = hasher.offsets.reshape(config.n_layers, -1)  # (n_layers, heads)
    primes = hasher.primes.reshape(config.n_layers, -1)
    rel = rows[0] - offsets[None]  # (T, n_layers, heads)
    in_range = (rel >= 0) & (rel < primes[None])  # (T, n_layers, heads)

    h0 = pseudo_embedding(ids, config.hc_mult, config.hidden_size, seed)  # (1, T, hc, dim)
    h = h0
    gates: dict[int, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for li, layer_id in enumerate(config.layer_ids):
            m = modules[layer_id]
            layer_rows = torch.from_numpy(rows[..., config.layer_index(layer_id), :])  # (1, T, heads)
            _check_rows(m.table, layer_rows[0], layer_id, ids, tok)
            out, g = m(h, layer_rows, return_gates=True)
            gates[layer_id] = g[0]  # (T, hc)
            table = m.table
            layers.append(
                {
                    "layer_id": layer_id,
                    "table": type(table).__name__,
                    "table_rows": table.num_rows,
                    "rows_addressed": hasher.layout.layer(layer_id).num_embeddings,
                    "row_width": table.dim,
                    "table_bytes": _table_bytes(table),
                    "bytes_read_per_token": config.rows_per_token * _row_bytes(table),
                    "rows_in_range": bool(in_range[:, li].all()),
                    "row_min": int(rows[0, :, li].min()),
                    "row_max": int(rows[0, :, li].max()),
                    "max_abs_delta_h": float((out - h).abs().max()),
                }
            )
            h = out
    seconds["engram"] = time.perf_counter() - t0

    pieces = [tok.decode([int(i)], skip_special_tokens=False) for i in ids]
    cids = compression.lookup[ids]
    tokens = []
    for t in range(ids.size):
        per_layer = {
            str(layer_id): {
                "rows": rows[0, t, li].tolist(),
                "rows_ok": bool(in_range[t, li].all()),
                "gates": gates[layer_id][t].tolist(),
            }
            for li, layer_id in enumerate(config.layer_ids)
        }
        tokens.append(
            {
                "pos": t,
                "id": int(ids[t]),
                "text": pieces[t],
                "compressed_id": int(cids[t]),
                "layers": per_layer,
            }
        )
    all_gates = torch.stack([gates[lid] for lid in config.layer_ids])  # (n_layers, T, hc)
    gates_ok = bool(((all_gates > 0) & (all_gates < 1)).all())
    problems = []
    for li, layer_id in enumerate(config.layer_ids):
        out_of_range = int((~in_range[:, li]).sum())
        if out_of_range:
            problems.append(
                f"layer {layer_id}: {out_of_range} row(s) outside their head's [offset, offset + prime)"
            )
        g = gates[layer_id]
        if bool(g.isnan().any()):
            problems.append(f"layer {layer_id}: {int(g.isnan().sum())} gate(s) are NaN")
        outside = int(((g <= 0) | (g >= 1)).sum())
        if outside:
            problems.append(f"layer {layer_id}: {outside} gate(s) outside (0, 1)")
    return {
        "config": config.name,
        "variant": config.variant.value,
        "checkpoint": None if built else str(ckpt_dir),
        "built": built,
        "tokenizer": TOKENIZER,
        "text": text,
        "seed": seed,
        "layer_ids": list(config.layer_ids),
        "hc": config.hc_mult,
        "dim": config.hidden_size,
        "rows_per_token": config.rows_per_token,
        "compressed_vocab_size": config.compressed_vocab_size,
        "n_tokens": int(ids.size),
        "tokens": tokens,
        "layers": layers,
        "max_abs_delta_h": float((h - h0).abs().max()),
        "rows_in_range": all(layer["rows_in_range"] for layer in layers),
        "gates_in_open_unit_interval": gates_ok,
        "ok": gates_ok and all(layer["rows_in_range"] for layer in layers),
        "problems": problems,
        "seconds": seconds,
    }


def _check_rows(table: Any, rows: torch.Tensor, layer_id: int, ids: np.ndarray, tok: Any) -> None:
    """ValueError if a table row that `rows` (T, heads) reads holds NaN / Inf (an FP8 value byte 0x7F / 0xFF
    or a scale byte 255): a table too large to be scanned at load is checked here where it is read."""
    emb = table.gather(rows)  # (T, heads, dim) float32: the few rows this text reads
    bad = ~torch.isfinite(emb).all(dim=-1)  # (T, heads)
    if not bool(bad.any()):
        return
    t, head = (int(i) for i in torch.nonzero(bad)[0])
    row = int(rows[t, head])
    what = "holds NaN or Inf"
    scale = getattr(table, "scale", None)
    if scale is not None:
        vb = table.weight[row].view(torch.uint8)
        nan_values = int(((vb & 0x7F) == 0x7F).sum())
        nan_scales = int((scale[row].view(torch.uint8) == 0xFF).sum())
        what = f"has {nan_values} value byte(s) 0x7F / 0xFF (NaN in e4m3) and {nan_scales} scale byte(s) 255"
    where = getattr(table, "path", None)
    piece = tok.decode([int(ids[t])])
    raise ValueError(
        f"layer {layer_id}'s table{f' ({where})' if where else ''} is damaged: row {row}, read for token {t} "
        f"{piece!r} (head {head}), {what}; tables over {SCAN_LIMIT_BYTES // 2**20} MiB are scanned at load "
        "only with --verify: run with --verify to find every damaged row, and re-copy or re-convert the checkpoint"
    )


def _row_bytes(table: Any) -> int:
    """Bytes one row occupies: its values plus (FP8) its scales."""
    scale = getattr(table, "scale", None)
    per = table.weight.element_size() * table.dim
    return per + (0 if scale is None else scale.element_size() * scale.shape[1])


def _table_bytes(table: Any) -> int:
    return table.num_rows * _row_bytes(table)
