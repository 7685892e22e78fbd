"""N-gram hashing (SPEC §4): tokenizer ids -> physical table rows, bit-exact to DeepSeek-V4.1.

`NgramHasher` owns a layout's multipliers, primes and offsets and hashes whole sequences; its
core, `hash_compressed`, takes compressed ids and an optional carried look-back window. Two
backends with identical bits: the numba kernels of `engram.kernels.cpu_hash` and the numpy twin
`hash_compressed_numpy`. Input checks are `engram.addressing.inputs`' (re-exported here). Knows
nothing of tables, modules or decode-time state (that is `engram.addressing.stream`). Design, formula and the division-free modulo: docs/addressing.md.

One concept past 500 lines: the hasher, its numpy twin and the look-back window's carry are read
together to check bit-exactness; the kernels and the input checks are their own files.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engram import kernels
from engram.addressing.compression import TokenizerCompression
from engram.addressing.inputs import (
    check_dead_mask,
    check_device_inputs,
    check_starts,
    check_token_ids,
    rows_like,
)
from engram.addressing.layout import Layout
from engram.config import EngramConfig
from engram.kernels.threads import check_threads, resolve_threads

__all__ = [
    "HashBackend",
    "NgramHasher",
    "check_compression",
    "check_dead_mask",
    "check_device_inputs",
    "check_starts",
    "check_token_ids",
    "rows_like",
]

# Below this many tokens `threads=None` stays on the calling thread: a thread hand-off costs tens
# of microseconds, about what the kernel needs for 1000 tokens.
_PARALLEL_MIN_TOKENS = 16_384


class HashBackend(enum.StrEnum):
    """Which implementation `NgramHasher` hashes with (all give identical rows).

    Attributes:
        AUTO: numba on the CPU, Triton for CUDA tensors.
        NUMBA: `engram.kernels.cpu_hash`: compiled on first use, cached on disk.
        NUMPY: The vectorised reference twin.
    """

    AUTO = "auto"  # numba on the CPU, Triton for CUDA tensors
    NUMBA = "numba"  # engram.kernels.cpu_hash: compiled on first use, cached on disk
    NUMPY = "numpy"  # the vectorised reference twin


class _KernelTables:
    """The layout as the kernels take it: C-contiguous, flat in (layer, order, head) order.

    Built from the hasher's arrays on first use, and again if one of them is replaced (tests set
    `hasher.multipliers`); change them by replacing, not in place.
    """

    def __init__(self, hasher: NgramHasher, module: ModuleType) -> None:
        self.module = module
        self.sources = hasher._layout_arrays()
        self.mult = np.ascontiguousarray(hasher.multipliers, dtype=np.int64)  # (L, max_ngram)
        self.primes = np.ascontiguousarray(hasher.primes.reshape(-1), dtype=np.int64)  # (L*orders*K,)
        self.offsets = np.ascontiguousarray(hasher.offsets.reshape(-1), dtype=np.int64)
        self.inv = 1.0 / self.primes  # correctly rounded, as the reduction's proof assumes
        self.n_heads = hasher.config.n_heads
        self.fast = bool(self.primes.min() >= module.FASTMOD_MIN_PRIME)  # step(): else hardware %
        self.reduce = module.reduction_for(self.primes)  # hash_range's reduction
        self.split = module.split_tables(self.primes)
        self.lookup = np.ascontiguousarray(hasher.compression.lookup, dtype=np.int64)
        self.pad = hasher.pad
        # the layout arguments step takes, in their order (hash_rows: range_args)
        self.layout_args = (self.pad, self.mult, self.primes, self.offsets, self.inv, self.n_heads, self.fast)
        self.range_args = (
            self.pad,
            self.mult,
            self.primes,
            self.offsets,
            self.n_heads,
            self.reduce,
            self.split,
        )

    def matches(self, hasher: NgramHasher) -> bool:
        """Whether the hasher still holds the arrays these were made from (checked on every call)."""
        mult, primes, offsets, pad, lookup = self.sources
        return (
            hasher.multipliers is mult
            and hasher.primes is primes
            and hasher.offsets is offsets
            and hasher.pad is pad
            and hasher.compression.lookup is lookup
        )


def check_compression(config: EngramConfig, compression: TokenizerCompression | None) -> TokenizerCompression:
    """The compression map that hashes `config`'s ids, checked against the config.

    `NgramHasher` checks its map with it; a checkpoint's config.json is checked with it before
    anything is served or converted.

    Args:
        config: The config.
        compression: The map, or None: the identity, for a config that hashes raw ids.

    Returns:
        The map (the identity for None).

    Raises:
        ValueError: The map does not cover the config's vocab_size ids with exactly its
            compressed_vocab_size compressed ids (or None for a config that compresses ids).
    """
    if compression is None:  # raw-id variants (Qwen4-Exp): the identity map
        if config.compressed_vocab_size != config.vocab_size:
            raise ValueError(
                f"config {config.name!r} hashes compressed ids (compressed_vocab_size="
                f"{config.compressed_vocab_size} < vocab_size={config.vocab_size}): pass its compression map, "
                "e.g. TokenizerCompression.from_tokenizer(tokenizer)"
            )
        return TokenizerCompression.identity(config.vocab_size)
    if compression.vocab_size != config.vocab_size:
        raise ValueError(
            f"the compression map covers {compression.vocab_size} tokenizer ids but config {config.name!r} has "
            f"vocab_size={config.vocab_size}: the map and the config are for different tokenizers"
        )
    if compression.size != config.compressed_vocab_size:
        raise ValueError(
            f"the compression map has {compression.size} compressed ids but config {config.name!r} expects "
            f"compressed_vocab_size={config.compressed_vocab_size}; the multipliers depend on it, so every row "
            "would differ. Use the tokenizer the config was made for, or set compressed_vocab_size="
            f"{compression.size} for a new model"
        )
    return compression


class NgramHasher:
    """Hashes token ids into the physical rows of every Engram layer of a config.

    `hash(ids)` returns int64 rows of shape [B, T, n_layers, rows_per_token] (or [T, ...] for
    1-D input), columns in (order, head) order, each head's table offset included.

    Args:
        config: The config whose layout (primes, offsets, multipliers) the rows follow.
        compression: The tokenizer's compression map. Without it, ids are hashed raw (the identity
            map; the config must have compressed_vocab_size == vocab_size, as raw-id variants like
            Qwen4-Exp's PLE do).
        backend: A `HashBackend` or its value: the default of every call that does not pass its own.
        threads: The default thread count of every call that does not pass its own; None uses
            every core for inputs of >= 16K tokens.

    Raises:
        ValueError: The compression map does not fit the config (see `check_compression`), or
            `backend` or `threads` is invalid.

    Examples:
        >>> import numpy as np
        >>> from engram import EngramConfig, NgramHasher
        >>> config = EngramConfig.preset("tiny").replace(vocab_size=1000, compressed_vocab_size=1000)
        >>> hasher = NgramHasher(config)  # no compression map: raw ids
        >>> rows = hasher.hash(np.array([5, 6, 7, 8]))
        >>> rows.shape  # (T, n_layers, rows_per_token)
        (4, 1, 8)
        >>> rows[:, 0, :3].tolist()
        [[1207, 5200, 10502], [3852, 5211, 9263], [2453, 4284, 9534], [3512, 7976, 11877]]
    """

    def __init__(
        self,
        config: EngramConfig,
        compression: TokenizerCompression | None = None,
        *,
        backend: HashBackend | str = HashBackend.AUTO,
        threads: int | None = None,
    ) -> None:
        compression = check_compression(config, compression)
        self.config = config
        self.compression = compression
        self.layout = Layout(config)
        self.pad = int(compression.lookup[config.pad_token_id])  # compressed pad id P
        # (n_layers, max_ngram) multipliers; (n_layers, orders, K) primes and offsets
        self.multipliers = np.array([layer.multipliers for layer in self.layout.layers], dtype=np.int64)
        orders, k = config.max_ngram_size - 1, config.n_heads
        self.primes = np.stack([layer.flat_primes for layer in self.layout.layers]).reshape(-1, orders, k)
        self.offsets = np.stack([layer.offsets for layer in self.layout.layers]).reshape(-1, orders, k)
        self.backend = _check_backend(backend)  # defaults for calls that pass None
        self.threads = check_threads(threads)
        self._tables: _KernelTables | None = None
        self._int32_ok = max(self.layout.num_embeddings) < 2**31
        self._device_tables: dict[Any, tuple[Any, ...]] = {}  # per CUDA device: lookup, layout (Triton path)

    def kernel_tables(self, backend: HashBackend | str | None = None) -> _KernelTables | None:
        """The numba kernels' view of this layout (built on first use, compiling numba then).

        Args:
            backend: The backend to ask for; None is the hasher's.

        Returns:
            The kernels with this layout's arrays, or None for the numpy backend.
        """
        b = self.backend if backend is None else _check_backend(backend)
        if b is HashBackend.NUMPY:
            return None
        if self._tables is None or not self._tables.matches(self):
            from engram.kernels import cpu_hash  # imports numba on first use, not with engram

            self._tables = _KernelTables(self, cpu_hash)
        return self._tables

    def _layout_arrays(self) -> tuple[Any, ...]:
        return (self.multipliers, self.primes, self.offsets, self.pad, self.compression.lookup)

    @property
    def int32_ok(self) -> bool:
        """Whether rows fit int32: every layer's table has fewer than 2^31 rows (V4.1: 3.8e8)."""
        return self._int32_ok

    def check_out_dtype(self, out_dtype: Any) -> np.dtype:
        """Check an output dtype for rows.

        Args:
            out_dtype: A numpy or torch dtype (or its name): int64, or int32 if `int32_ok`.

        Returns:
            It as a numpy dtype.

        Raises:
            TypeError: It is neither int64 nor int32.
            ValueError: It is int32 but a table has 2^31 rows or more.
        """
        dt = out_dtype if isinstance(out_dtype, np.dtype) else _as_dtype(out_dtype)
        if dt == _INT64:
            return dt
        if dt != _INT32:
            raise TypeError(f"out_dtype must be int64 or int32, got {out_dtype!r}")
        if not self._int32_ok:
            raise ValueError(
                f"out_dtype=int32 cannot hold rows of tables with {max(self.layout.num_embeddings)} rows "
                "(>= 2^31); use int64"
            )
        return dt

    @property
    def window_size(self) -> int:
        """Look-back tokens carried between chunks: max_ngram_size - 1."""
        return self.config.max_ngram_size - 1

    def output_shape(self, batch: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the rows of ids of shape `batch`.

        Args:
            batch: The ids' shape, e.g. (B, T).

        Returns:
            `batch` followed by (n_layers, rows_per_token).
        """
        return (*batch, self.config.n_layers, self.config.rows_per_token)

    # ------------------------------------------------------------------ public entry
    def hash(
        self,
        token_ids: Any,
        dead_mask: Any = None,
        *,
        starts: Any = None,
        out_dtype: Any = np.int64,
        backend: HashBackend | str | None = None,
        threads: int | None = None,
    ) -> Any:
        """Physical rows for raw tokenizer ids.

        With `config.restart_after_id` set, the position after every such id starts a window too.
        CUDA tensors are hashed on their device by the Triton kernel (with the default backend).

        Args:
            token_ids: Tokenizer ids, [T] or [B, T]: numpy, torch or a list.
            dead_mask: Bool, the shape of `token_ids`: True at dead (image) positions.
            starts: Bool, the shape of `token_ids`: True at positions that begin a new window: from
                there on, nothing before reads as anything but the pad id (as at a sequence start).
            out_dtype: int64, or int32, which halves the output (allowed when every table has
                < 2^31 rows, as in V4.1).
            backend: Overrides the hasher's default (see `hash_compressed`).
            threads: Overrides the hasher's default (see `hash_compressed`).

        Returns:
            The rows, [T, n_layers, rows_per_token] or [B, T, n_layers, rows_per_token]: a torch
                tensor on the input's device for a torch input, a numpy array otherwise.

        Raises:
            TypeError: The ids are not integers, or a mask is not bool.
            ValueError: An id lies outside the vocabulary, or a shape or `out_dtype` is wrong; the
                message names the value and its position.
        """
        auto = backend in (None, HashBackend.AUTO, "auto")
        if auto and isinstance(token_ids, torch.Tensor) and kernels.use_triton(token_ids):
            return self._hash_triton(token_ids, dead_mask, self.check_out_dtype(out_dtype), starts)
        ids = check_token_ids(token_ids, self.config.vocab_size)
        dead = check_dead_mask(dead_mask, ids.shape)
        one_d = ids.ndim == 1
        ids2 = ids.reshape(1, -1) if one_d else ids
        st, _ = self.boundaries(ids2, check_starts(starts, ids.shape))
        xc = self.compression.lookup[ids2]
        rows = self.hash_compressed(
            xc,
            None if dead is None else dead.reshape(xc.shape),
            starts=st,
            out_dtype=out_dtype,
            backend=backend,
            threads=threads,
        )
        if one_d:
            rows = rows[0]
        return rows_like(rows, token_ids)

    def boundaries(
        self, ids: np.ndarray, starts: np.ndarray | None
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Where windows start and end in raw ids, with the config's `restart_after_id`.

        Args:
            ids: Raw tokenizer ids, (B, T).
            starts: Bool, True where the caller starts a window, or None.

        Returns:
            The pair (starts, ends): `starts` with the restarts after `restart_after_id` added (the position
                after each such id), and `ends` (True where the id is that id: the window after it
                restarts, which carries into the next chunk); None where nothing is marked.
        """
        starts = None if starts is None else starts.reshape(ids.shape)
        rid = self.config.restart_after_id
        if rid is None:
            return starts, None
        ends = ids == rid
        if not ends.any():
            return starts, None
        derived = np.zeros(ids.shape, dtype=bool)
        derived[:, 1:] = ends[:, :-1]
        return (derived if starts is None else derived | starts), ends

    def device_tables(self, device: Any) -> tuple[Any, ...]:
        """The hasher's arrays on a device, made once per device.

        What the Triton hash kernel reads (`hash` of CUDA tensors, `HashStream.step`).

        Args:
            device: A torch device.

        Returns:
            (compression lookup, multipliers, primes, offsets) as int64 tensors on `device`.
        """
        tables = self._device_tables.get(device)
        if tables is None:
            tables = tuple(
                torch.tensor(a, dtype=torch.int64, device=device)  # copies (the lookup is read-only)
                for a in (self.compression.lookup, self.multipliers, self.primes, self.offsets)
            )
            self._device_tables[device] = tables
        return tables

    def _hash_triton(self, token_ids: Any, dead_mask: Any, dtype: np.dtype, starts: Any = None) -> Any:
        """`hash` of a CUDA tensor with the Triton kernel: ids, compression and rows stay on the device.

        The boundary checks run on the device (one sync); only an input that fails them is copied to
        the host, to name the bad value and its position as the CPU path does.
        """
        ids = token_ids
        if ids.dim() not in (1, 2) or ids.numel() == 0:
            check_token_ids(ids, self.config.vocab_size)  # raises with the CPU path's message
        check_device_inputs(ids, dead_mask, self.config.vocab_size)
        if starts is not None and (
            not isinstance(starts, torch.Tensor) or starts.dtype != torch.bool or starts.shape != ids.shape
        ):
            check_starts(starts, tuple(ids.shape))  # raises with the reason
        lut, mult, primes, offsets = self.device_tables(ids.device)
        one_d = ids.dim() == 1
        ids2 = ids.reshape(1, -1) if one_d else ids
        xc = lut[ids2]  # (B, T) compressed ids
        dead = None if dead_mask is None else dead_mask.reshape(xc.shape).to(ids.device)
        st = None if starts is None else starts.reshape(xc.shape).to(ids.device)
        rid = self.config.restart_after_id
        if rid is not None:  # the position after each restart id begins a window
            derived = torch.zeros_like(xc, dtype=torch.bool)
            derived[:, 1:] = ids2[:, :-1] == rid
            st = derived if st is None else derived | st
        out = torch.empty(
            (*xc.shape, self.config.n_layers, self.config.rows_per_token),
            dtype=torch.int32 if dtype == np.int32 else torch.int64,
            device=ids.device,
        )
        kernels.hash_rows(xc, dead, None, mult, primes, offsets, self.pad, out, starts=st)
        return out[0] if one_d else out

    # ------------------------------------------------------------------ core
    def _extend(
        self, xc: np.ndarray, dead: np.ndarray | None, window: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(vals, ext): xc with pads at dead positions (B, T), and the same preceded by the carried
        window, oldest first (B, n-1+T), so that ext[:, n-1+t] is position t."""
        n, pad = self.config.max_ngram_size, self.pad
        vals = xc if dead is None else np.where(dead, pad, xc)
        if window is None:
            window = np.full((xc.shape[0], n - 1), pad, dtype=np.int64)
        return vals, np.concatenate([window[:, ::-1], vals], axis=1)

    def lookback(
        self,
        xc: np.ndarray,
        dead: np.ndarray | None,
        window: np.ndarray | None,
        starts: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        """The max_ngram look-back columns, pads and blocking applied.

        Args:
            xc: (B, T) compressed ids.
            dead: (B, T) bool or None: True at dead positions.
            window: (B, max_ngram-1) carried look-back of the position before xc[:, 0]
                (window[:, 0] is the most recent token), or None at a sequence start (all pads).
            starts: (B, T) bool or None, True where a window restarts (look-back i of position t
                is blocked if a start lies in t-i+1 .. t).

        Returns:
            max_ngram_size arrays of shape (B, T): column i holds the token i back from each position.
        """
        n, pad = self.config.max_ngram_size, self.pad
        b, t = xc.shape
        vals, ext = self._extend(xc, dead, window)
        cols = [vals]
        if dead is None and starts is None:
            for i in range(1, n):
                cols.append(ext[:, n - 1 - i : n - 1 - i + t])
            return cols
        lead = np.zeros((b, n - 1), dtype=bool)
        ext_dead = None if dead is None else np.concatenate([lead, dead], axis=1)
        ext_start = None if starts is None else np.concatenate([lead, starts], axis=1)
        blocked = np.zeros((b, t), dtype=bool) if dead is None else dead.copy()
        for i in range(1, n):  # sticky: once blocked, farther is too
            if ext_start is not None:
                blocked |= ext_start[:, n - i : n - i + t]  # a start at t-i+1 hides t-i
            if ext_dead is not None:
                blocked |= ext_dead[:, n - 1 - i : n - 1 - i + t]
            cols.append(np.where(blocked, pad, ext[:, n - 1 - i : n - 1 - i + t]))
        return cols

    def hash_compressed(
        self,
        xc: np.ndarray,
        dead: np.ndarray | None = None,
        window: np.ndarray | None = None,
        *,
        starts: np.ndarray | None = None,
        out: np.ndarray | None = None,
        out_dtype: Any = np.int64,
        backend: HashBackend | str | None = None,
        threads: int | None = None,
    ) -> np.ndarray:
        """Rows for compressed ids, the hasher's core: identical rows for every backend and input.

        Args:
            xc: (B, T) compressed ids.
            dead: (B, T) bool or None, as in `lookback`.
            window: (B, max_ngram-1) carried look-back, as in `lookback`, or None.
            starts: (B, T) bool or None: True where a window restarts; a start at position 0 hides
                the carried window.
            out: Written into when given (C-contiguous, int64 or int32, the rows' shape).
            out_dtype: The dtype allocated without `out`: int64, or int32 (see `check_out_dtype`).
            backend: None is the hasher's default.
            threads: None is the hasher's default (all cores for large inputs, >= 16K tokens, one
                otherwise); the rows never depend on it.

        Returns:
            The rows, (B, T, n_layers, rows_per_token): `out` when given.

        Raises:
            ValueError: A shape disagrees with `xc`'s, or `out` is not C-contiguous.
        """
        xc = np.asarray(xc)
        if xc.ndim != 2:
            raise ValueError(f"xc must have shape [B, T] (compressed ids), got shape {xc.shape}")
        if dead is not None and np.shape(dead) != xc.shape:
            raise ValueError(f"dead has shape {np.shape(dead)} but xc has shape {xc.shape}; they must match")
        if window is not None and np.shape(window) != (xc.shape[0], self.window_size):
            raise ValueError(
                f"window has shape {np.shape(window)}; expected {(xc.shape[0], self.window_size)} "
                "(batch, max_ngram_size - 1)"
            )
        if starts is not None:
            starts = np.asarray(starts)
            if starts.shape != xc.shape or starts.dtype != np.bool_:
                raise ValueError(
                    f"starts must be bool of xc's shape {xc.shape}, got {starts.dtype} {starts.shape}"
                )
            if not starts.any():
                starts = None
        shape = self.output_shape(xc.shape)
        dtype = self.check_out_dtype(out_dtype if out is None else out.dtype)
        if out is not None and (out.shape != shape or not out.flags.c_contiguous):
            raise ValueError(f"out must be C-contiguous with shape {shape}, got {out.shape}")
        tables = self.kernel_tables(backend)
        if tables is None or xc.size == 0:
            rows = self.hash_compressed_numpy(xc, dead, window, starts)
            if out is None:
                return rows if dtype == _INT64 else rows.astype(dtype)
            out[...] = rows
            return out
        if out is None:
            out = np.empty(shape, dtype=dtype)
        n_threads = resolve_threads(
            self.threads if threads is None else check_threads(threads), xc.size, _PARALLEL_MIN_TOKENS
        )
        return tables.module.hash_rows(
            np.ascontiguousarray(xc, dtype=np.int64),
            None if dead is None else np.ascontiguousarray(dead, dtype=np.bool_),
            None if window is None else np.ascontiguousarray(window, dtype=np.int64),
            *tables.range_args,
            out,
            n_threads,
            starts=None if starts is None else np.ascontiguousarray(starts, dtype=np.bool_),
        )

    def hash_compressed_numpy(
        self,
        xc: np.ndarray,
        dead: np.ndarray | None = None,
        window: np.ndarray | None = None,
        starts: np.ndarray | None = None,
    ) -> np.ndarray:
        """The numpy twin of `hash_compressed`: int64 rows from whole-array operations.

        Args:
            xc: (B, T) compressed ids.
            dead: (B, T) bool or None, as in `lookback`.
            window: (B, max_ngram-1) carried look-back, as in `lookback`, or None.
            starts: (B, T) bool or None, as in `lookback`.

        Returns:
            The rows, (B, T, n_layers, rows_per_token), int64.
        """
        b, t = xc.shape
        cols = self.lookback(xc, dead, window, starts)
        k = self.config.n_heads
        out = np.empty((b, t, self.config.n_layers, self.config.rows_per_token), dtype=np.int64)
        for li in range(self.config.n_layers):
            for order, mix in enumerate(self.mixes(cols, li)):  # order index 0 is 2-grams
                dst = out[:, :, li, order * k : (order + 1) * k]
                np.remainder(mix[:, :, None], self.primes[li, order], out=dst)
                dst += self.offsets[li, order]
        return out

    def mixes(self, cols: list[np.ndarray], layer_index: int) -> Iterator[np.ndarray]:
        """The n-gram mixes of one layer from `lookback` columns.

        Args:
            cols: The columns `lookback` returns.
            layer_index: The layer's position in `config.layer_ids`.

        Yields:
            mix_2, mix_3, ... (each like cols[0], int64): the same buffer, updated in place; copy
                a value to keep it past the next step.
        """
        m = self.multipliers[layer_index]
        mix = np.multiply(cols[0], m[0])
        prod = np.empty_like(mix)
        for i in range(1, self.config.max_ngram_size):
            np.multiply(cols[i], m[i], out=prod)
            np.bitwise_xor(mix, prod, out=mix)
            yield mix

    def next_window(
        self,
        xc: np.ndarray,
        dead: np.ndarray | None,
        window: np.ndarray | None,
        lengths: np.ndarray | None = None,
        starts: np.ndarray | None = None,
        ends: np.ndarray | None = None,
    ) -> np.ndarray:
        """The look-back window after a chunk, given the window before it.

        Args:
            xc: (B, T) compressed ids.
            dead: (B, T) bool or None, as in `lookback`.
            window: (B, max_ngram-1) look-back before xc, or None (all pads).
            lengths: (B,) tokens of each row that count (all T by default).
            starts: (B, T) bool or None, as in `lookback`.
            ends: (B, T) bool or None: True where the window restarts after the token (see
                `boundaries`), so a window after such a token is all pads.

        Returns:
            The window (B, max_ngram-1) of the position after the first `lengths[b]` tokens of
                each row, most recent first.
        """
        n, pad = self.config.max_ngram_size, self.pad
        b, t = xc.shape
        _, ext = self._extend(xc, dead, window)
        ext_dead = np.zeros_like(ext, dtype=bool)
        if dead is not None:
            ext_dead[:, n - 1 :] = dead
        ext_start = np.zeros_like(ext, dtype=bool)
        if starts is not None:
            ext_start[:, n - 1 :] = starts
        end = np.full(b, t, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
        rows = np.arange(b)
        new = np.empty((b, n - 1), dtype=np.int64)
        blocked = np.zeros(b, dtype=bool)
        if ends is not None:  # the new position restarts if the last token kept is a restart id
            blocked |= (end > 0) & ends[rows, np.maximum(end - 1, 0)]
        for j in range(n - 1):
            src = n - 2 + end - j  # ext index of the token j+1 back from the new position
            if j > 0:
                blocked |= ext_start[rows, src + 1]  # a start right after that token hides it
            blocked |= ext_dead[rows, src]
            new[:, j] = np.where(blocked, pad, ext[rows, src])
        return new


_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)


def _as_dtype(out_dtype: Any) -> np.dtype | None:
    """A numpy dtype from a numpy/torch dtype or a name; None when it names no numpy dtype."""
    name = str(out_dtype).removeprefix("torch.")
    try:
        return np.dtype(name if name in ("int32", "int64") else out_dtype)
    except TypeError:
        return None


def _check_backend(backend: HashBackend | str) -> HashBackend:
    try:
        return HashBackend(backend)
    except ValueError:
        raise ValueError(
            f"backend={backend!r} is not one of {', '.join(repr(b.value) for b in HashBackend)}"
        ) from None
