"""Hash layout: primes, head offsets, table sizes, multipliers and byte accounting (SPEC §3).

Knows how V4.1 searches its primes and draws its multipliers (and Qwen4-Exp's PLE: splitmix64
multipliers per layer index, tables padded to a row multiple; its primes, consecutive primes from
one base, are V4.1's search with one base), and what a layout costs in rows and bytes (what
`engram layout` prints), and `layout_fingerprint`, the one identity every file holding rows records.
Computes nothing on token ids or table data.
Design: docs/addressing.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import sympy

from engram.config import EngramConfig, MultiplierScheme
from engram.rowformat.fp8 import BLOCK, fp8_row_bytes

__all__ = [
    "LayerLayout",
    "Layout",
    "find_head_primes",
    "layer_multipliers",
    "layout_fingerprint",
    "multiplier_bound",
    "splitmix64",
]

_INT64_MAX = int(np.iinfo(np.int64).max)
_SEED_LAYER_STRIDE = 10007  # rng seed = seed + 10007 * layer_id (Qwen4-Exp: * layer index)
_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio, odd)


def find_head_primes(config: EngramConfig) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Primes per layer, per order, per head: {layer_id: ((p_2,0..p_2,K-1), (p_3,0..), ...)}.

    For each layer (in `layer_ids` order) and each order, the search restarts at that order's base
    minus one and takes, for each head, the next prime above the previous one that no earlier
    (layer, order, head) has taken. V4.1 takes 48 primes (~50 sympy `nextprime` calls of tens of
    microseconds); the config bounds the count (`MAX_PRIMES`). Walking over primes already taken
    follows `skip` (below), so a layout of many layers sharing a base costs one `nextprime` per prime
    taken, not one per prime walked over (quadratic in the layers): the same primes either way.
    """
    seen: set[int] = set()
    # skip[q], q taken: a prime r > q with every prime strictly between q and r taken (path-compressed)
    skip: dict[int, int] = {}

    def first_free(p: int) -> int:
        """The smallest prime >= the prime `p` that no one has taken."""
        walked = []
        while p in seen:
            walked.append(p)
            p = skip.get(p) or int(sympy.nextprime(p))
        for q in walked:
            skip[q] = p
        return p

    first = {b: int(sympy.nextprime(b - 1)) for b in set(config.engram_vocab_size)}  # the least prime >= b
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for layer_id in config.layer_ids:
        per_order = []
        for base in config.engram_vocab_size:
            heads: list[int] = []
            for _ in range(config.n_heads):
                # the prime after the previous head's (taken, so first_free walks on from it)
                p = first_free(heads[-1] if heads else first[base])
                seen.add(p)
                heads.append(p)
            per_order.append(tuple(heads))
        out[layer_id] = tuple(per_order)
    return out


def multiplier_bound(compressed_vocab_size: int) -> int:
    """B of SPEC §3: multipliers are 2*r+1 with r in [0, B), so x*m fits int64 for x < vocab."""
    return max(1, (_INT64_MAX // compressed_vocab_size) // 2)


def splitmix64(x: int) -> int:
    """The output function of Steele, Lea and Flood's SplitMix64 for state x (an int in [0, 2^64))."""
    z = (x + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def layer_multipliers(config: EngramConfig, layer_id: int) -> np.ndarray:
    """The odd multipliers m_0..m_{max_ngram-1} (int64) of one layer.

    `numpy-rng` (V4.1): numpy's default_rng(seed + 10007 * layer_id), r in [0, B), m = 2r + 1.
    `splitmix64` (Qwen4-Exp): with s = seed + 10007 * (the layer's index in layer_ids), m_i =
    2 * (splitmix64(s + gamma * (i + 1) mod 2^64) mod B) + 1. B as in `multiplier_bound`.
    """
    bound = multiplier_bound(config.compressed_vocab_size)
    if config.multiplier_scheme is MultiplierScheme.SPLITMIX64:
        state = config.seed + _SEED_LAYER_STRIDE * config.layer_index(layer_id)
        r = [
            splitmix64((state + _GOLDEN_GAMMA * (i + 1)) & _MASK64) % bound
            for i in range(config.max_ngram_size)
        ]
        return np.array(r, dtype=np.int64) * 2 + 1
    g = np.random.default_rng(config.seed + _SEED_LAYER_STRIDE * layer_id)
    return g.integers(0, bound, size=config.max_ngram_size, dtype=np.int64) * 2 + 1


@dataclass(frozen=True)
class LayerLayout:
    """One Engram layer's physical table: primes in (order, head) order and their row offsets."""

    layer_id: int
    primes: tuple[tuple[int, ...], ...]  # [order][head]
    multipliers: tuple[int, ...]
    rows_multiple: int = 1  # the physical table is padded up to a multiple of this many rows

    @cached_property
    def flat_primes(self) -> np.ndarray:
        """(rows_per_token,) int64 in (order, head) column order."""
        return np.array([p for order in self.primes for p in order], dtype=np.int64)

    @cached_property
    def offsets(self) -> np.ndarray:
        """(rows_per_token,) int64: exclusive prefix sum of `flat_primes` (a head's first row)."""
        return np.concatenate([[0], np.cumsum(self.flat_primes)[:-1]]).astype(np.int64)

    @property
    def num_embeddings(self) -> int:
        """Rows the hash addresses in this layer: the sum of its primes."""
        return int(self.flat_primes.sum())

    @property
    def table_rows(self) -> int:
        """Rows of this layer's physical table: `num_embeddings` padded up to `rows_multiple`
        (the same unless the config sets table_rows_multiple, as Qwen4-Exp does: 128)."""
        m = self.rows_multiple
        return -(-self.num_embeddings // m) * m


class Layout:
    """Everything derived from a config's addressing: primes, offsets, multipliers, sizes.

    Searching the primes takes about 25-100 us a prime (V4.1: 48 primes).

    Args:
        config: The config.

    Examples:
        >>> from engram import EngramConfig, Layout
        >>> layout = Layout(EngramConfig.preset("tiny"))
        >>> layout.layer(1).primes
        ((4099, 4111, 4127, 4129), (4133, 4139, 4153, 4157))
        >>> layout.total_rows, layout.fp8_row_bytes
        (33048, 33)
    """

    def __init__(self, config: EngramConfig) -> None:
        self.config = config
        primes = find_head_primes(config)
        self.layers: tuple[LayerLayout, ...] = tuple(
            LayerLayout(
                layer_id=lid,
                primes=primes[lid],
                multipliers=tuple(int(m) for m in layer_multipliers(config, lid)),
                rows_multiple=config.table_rows_multiple,
            )
            for lid in config.layer_ids
        )

    def layer(self, layer_id: int) -> LayerLayout:
        """One layer's layout.

        Args:
            layer_id: A backbone layer id of the config.

        Returns:
            Its primes, offsets and multipliers.

        Raises:
            ValueError: The layer has no Engram module in this config.
        """
        return self.layers[self.config.layer_index(layer_id)]

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Rows the hash addresses per layer (the sum of its primes), padding excluded."""
        return tuple(layer.num_embeddings for layer in self.layers)

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Physical rows per layer (padding included); see `LayerLayout.table_rows`."""
        return tuple(layer.table_rows for layer in self.layers)

    @property
    def total_rows(self) -> int:
        """Physical rows of all layers (padding included)."""
        return sum(self.table_rows)

    @property
    def total_params(self) -> int:
        """Table parameters of all layers (rows x head_dim); the module's projections are extra."""
        return self.total_rows * self.config.head_dim

    @property
    def fp8_row_bytes(self) -> int | None:
        """Bytes per row stored as FP8 e4m3 + one ue8m0 byte per 32 values (264 for 256 wide).

        None when head_dim is not a multiple of 32 (no FP8 format for it).
        """
        d = self.config.head_dim
        return fp8_row_bytes(d) if d % BLOCK == 0 else None

    def table_bytes(self, bytes_per_value: float) -> int:
        """Bytes of all layers' tables at a given width per value.

        Args:
            bytes_per_value: E.g. 2 for BF16, 4 for FP32.

        Returns:
            total_params * bytes_per_value, rounded down.
        """
        return int(self.total_params * bytes_per_value)

    @property
    def fp8_bytes(self) -> int | None:
        """Bytes of all layers' tables as FP8 rows; None when head_dim is not a multiple of 32."""
        rb = self.fp8_row_bytes
        return None if rb is None else self.total_rows * rb

    def bytes_per_token(self, row_bytes: int) -> int:
        """Bytes one token reads from one layer's table: rows_per_token rows.

        Args:
            row_bytes: Bytes of one row (e.g. `fp8_row_bytes`).

        Returns:
            rows_per_token * row_bytes.
        """
        return self.config.rows_per_token * row_bytes

    def to_dict(self) -> dict[str, Any]:
        """The layout as `engram layout` prints it.

        Returns:
            JSON-ready values: the config's addressing numbers, one entry a layer (primes,
                offsets, sizes, multipliers, parameters), the totals and the byte accounting
                (FP8, BF16, FP32; per token).
        """
        c = self.config
        rb = self.fp8_row_bytes
        return {
            "preset": c.name,
            "variant": c.variant.value,
            "max_ngram_size": c.max_ngram_size,
            "n_heads": c.n_heads,
            "head_dim": c.head_dim,
            "rows_per_token": c.rows_per_token,
            "compressed_vocab_size": c.compressed_vocab_size,
            "pad_token_id": c.pad_token_id,
            "layers": [
                {
                    "layer_id": layer.layer_id,
                    "primes": [list(order) for order in layer.primes],
                    "offsets": layer.offsets.tolist(),
                    "num_embeddings": layer.num_embeddings,
                    "table_rows": layer.table_rows,
                    "multipliers": list(layer.multipliers),
                    "params": layer.table_rows * c.head_dim,
                }
                for layer in self.layers
            ],
            "total_rows": self.total_rows,
            "total_params": self.total_params,
            "bytes": {
                "fp8_ue8m0_row": rb,
                "fp8_ue8m0_total": self.fp8_bytes,
                "bf16_total": self.table_bytes(2),
                "fp32_total": self.table_bytes(4),
                "fp8_ue8m0_per_token_per_layer": None if rb is None else self.bytes_per_token(rb),
                "fp8_ue8m0_per_token": None if rb is None else self.bytes_per_token(rb) * c.n_layers,
            },
        }


def layout_fingerprint(layout: Layout) -> str:
    """sha256 (64 hex digits) over what decides every row id: the layer ids, each layer's primes and
    multipliers (which the seed draws), the compressed vocabulary, pad id, n-gram orders and heads.

    Every file of rows engram writes records it (checkpoint tables, row files, profiles), so rows
    hashed with one layout are never served under another (e.g. a config whose seed was edited)."""
    c = layout.config
    spec = {
        "layers": [[ly.layer_id, [list(p) for p in ly.primes], list(ly.multipliers)] for ly in layout.layers],
        "max_ngram_size": c.max_ngram_size,
        "n_heads": c.n_heads,
        "compressed_vocab_size": c.compressed_vocab_size,
        "pad_token_id": c.pad_token_id,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
