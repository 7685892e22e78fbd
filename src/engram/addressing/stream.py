"""Decode-time hashing state (SPEC §4, "Decode"): chunked prefill, one-token steps, speculative
drafts with commit/rollback, giving exactly the rows of hashing the whole sequence at once.

`HashStream` keeps, per sequence, only the committed look-back window, a token count and the
drafts in flight (never O(sequence length)). On the host `step()` is one numba kernel call. With
CUDA ids the state moves to the device (`stream_device.DeviceState`) and stays there: a step, a
draft and a commit are each one Triton launch that updates it in place, with no host sync, and
`capture()` records them in CUDA graphs. Knows the hasher; knows nothing of tables or the model.
Design: docs/addressing.md.

One concept past 500 lines: the decode-time state's one API (step, drafts, commit, rollback,
restarts) on host and device; the device state's layout and kernels are `stream_device` and
`engram.kernels`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engram import kernels
from engram.addressing.hashing import HashBackend, NgramHasher
from engram.addressing.inputs import (
    check_dead_mask,
    check_starts,
    check_token_ids,
    rows_like,
)
from engram.addressing.stream_device import (
    DeviceState,
    HostDrafts,
    StreamGraph,
    commit_counts,
    device_masks,
    device_out,
)

__all__ = ["HashStream"]


class HashStream:
    """Incremental hashing of `batch_size` sequences, giving the rows of hashing each whole at once.

    - `feed(ids)`: hash and commit a chunk ([T] for one sequence, [B', T] for the sequences `seqs`).
    - `step(ids)`: one token for every sequence (ids [B]); returns rows [B, n_layers, heads].
    - `draft(ids)`: hash tentative tokens after the committed ones (and after earlier drafts);
      `commit(n)` keeps the first n drafted tokens of each sequence and forgets the rest;
      `rollback()` forgets them all.

    Every method takes `starts` (bool like the ids: True where a new window begins, e.g. a new
    document packed into the same row) and honours `config.restart_after_id`; a restart after the
    last committed token carries into the next chunk or step through the window (all pads).

    On a CUDA device (the first `step`/`draft` of CUDA ids, or `to_device()`) the state lives there
    until `to_host()`: steps, drafts, commits, rollbacks and resets run there without a host sync,
    and any host-side method (feed of host ids, `window`, `state_dict`, ...) copies it down and back
    (a sync point). The device checks ids, pending drafts and commit counts itself and records what
    fails; `check()`, or any host-side method, raises it (see `check`). `capture()` records a step,
    a draft or a commit in a CUDA graph.

    Args:
        hasher: The hasher whose rows the stream gives.
        batch_size: Sequences decoded together (fixed: graphs and device state are sized by it).
        max_draft: Drafted tokens a sequence can hold on the device.

    Raises:
        TypeError: `batch_size` is not an int.
        ValueError: `batch_size` or `max_draft` is below 1.

    Examples:
        >>> import numpy as np
        >>> from engram import EngramConfig, HashStream, NgramHasher
        >>> config = EngramConfig.preset("tiny").replace(vocab_size=1000, compressed_vocab_size=1000)
        >>> hasher = NgramHasher(config)
        >>> stream = HashStream(hasher)
        >>> prefill = stream.feed(np.array([5, 6, 7]))  # (3, n_layers, rows_per_token)
        >>> step = stream.step(np.array([8]))  # (1, n_layers, rows_per_token)
        >>> bool((np.concatenate([prefill, step]) == hasher.hash(np.array([5, 6, 7, 8]))).all())
        True
        >>> _ = stream.draft(np.array([9, 10]))
        >>> stream.commit(1)  # keep 9, forget 10
        >>> stream.position.tolist(), stream.window.tolist()
        ([5], [[9, 8]])
    """

    def __init__(self, hasher: NgramHasher, batch_size: int = 1, *, max_draft: int = 16) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
            raise TypeError(f"batch_size must be an int (sequences decoded together), got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if isinstance(max_draft, bool) or not isinstance(max_draft, int | np.integer) or max_draft < 1:
            raise ValueError(f"max_draft={max_draft!r} must be an int >= 1 (drafted tokens a sequence holds)")
        batch_size = int(batch_size)
        self.hasher = hasher
        self._batch_size = batch_size
        self._max_draft = int(max_draft)
        w = hasher.window_size
        self._window = np.full((batch_size, w), hasher.pad, dtype=np.int64)  # (B, n-1), most recent first
        self._position = np.zeros(batch_size, dtype=np.int64)  # committed tokens per sequence
        # drafts: compressed ids (pad at dead positions) and dead flags, (B, capacity), n_draft used
        self._draft_vals = np.zeros((batch_size, 0), dtype=np.int64)
        self._draft_dead = np.zeros((batch_size, 0), dtype=bool)
        self._draft_starts = np.zeros((batch_size, 0), dtype=bool)
        self._draft_ends = np.zeros((batch_size, 0), dtype=bool)
        self._n_draft = np.zeros(batch_size, dtype=np.int64)
        # the state on a CUDA device: allocated once per device (graphs bind to it); while `_resident`
        # it is the stream's state and the host arrays above are stale
        self._device: DeviceState | None = None
        self._resident = False
        self._out_checked: torch.Tensor | None = None  # the last `out` a device step validated
        # step() scratch: the kernel's look-back values, and a stand-in for an absent dead mask
        self._look = np.zeros(hasher.config.max_ngram_size, dtype=np.uint64)
        self._no_dead = np.zeros(1, dtype=np.bool_)
        self._shape = hasher.output_shape((batch_size,))  # (B, n_layers, heads) of a step's rows

    @property
    def batch_size(self) -> int:
        """Sequences decoded together (fixed: graphs and device state are sized by it)."""
        return self._batch_size

    @property
    def max_draft(self) -> int:
        """Drafted tokens a sequence can hold on the device."""
        return self._max_draft

    @property
    def window(self) -> np.ndarray:
        """(B, max_ngram-1) committed look-back, most recent first, pads and blocking applied.

        On the host: reading it while the state is on a GPU is a sync point.
        """
        self._pull()
        return self._window

    @property
    def position(self) -> np.ndarray:
        """(B,) committed tokens per sequence (on the host, like `window`)."""
        self._pull()
        return self._position

    @property
    def n_draft(self) -> np.ndarray:
        """(B,) drafted tokens pending per sequence (on the host, like `window`)."""
        self._pull()
        return self._n_draft

    # ------------------------------------------------------------------ where the state lives
    def to_device(self, device: Any = None) -> None:
        """Keep the state on a CUDA device from now on (copies it there).

        Args:
            device: A CUDA device; None is the current one.
        """
        self._on_device(_cuda_device(device))

    def to_host(self) -> None:
        """Bring the state back to the host and keep it there (a sync point; raises a pending error)."""
        self._pull()
        self._resident = False

    def check(self) -> None:
        """Raise the first error the device recorded since the last check, then forget it (a sync point).

        On the device a step, draft or commit cannot raise without a sync, so each checks its own input
        there: an id outside the vocabulary, a step while drafts are pending, a draft past `max_draft`
        or a commit of more tokens than drafted leaves that sequence unchanged (a step or draft gives it
        a dead token's rows, always valid table rows) and is recorded. Call `check()` where the caller
        syncs anyway (e.g. after sampling each few steps); host-side methods check first. No-op on the host.
        """
        if self._resident and self._device is not None:
            self._device.take_error()

    def _host_view(self) -> HostDrafts:
        return HostDrafts(
            self._window,
            self._position,
            self._n_draft,
            self._draft_vals,
            self._draft_dead,
            self._draft_starts,
            self._draft_ends,
        )

    def _pull(self) -> None:
        """Copy the device state to the host arrays when it lives on the device (a sync point)."""
        if self._resident and self._device is not None:
            host = self._device.download(self._host_view())
            self._draft_vals, self._draft_dead = host.vals, host.dead
            self._draft_starts, self._draft_ends = host.starts, host.ends

    def _on_device(self, device: torch.device) -> DeviceState:
        """The device state on `device`, the stream's state from now on (uploaded if the host held it)."""
        ds = self._device
        if ds is not None and self._resident and ds.device == device:
            return ds  # the decode hot path
        if ds is None or ds.device != device:
            self._pull()  # from the device that held it, if any
            self._resident = False
            ds = self._device = DeviceState(self.hasher, self._batch_size, self._max_draft, device)
        ds.upload(self._host_view())
        self._resident = True
        return ds

    def _host_call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the host arrays; a device-resident state comes down first and goes back after."""
        if not self._resident:
            return fn()
        assert self._device is not None
        self._pull()
        self._resident = False
        try:
            return fn()
        finally:
            self._device.upload(self._host_view())
            self._resident = True

    # ------------------------------------------------------------------ helpers
    def _select(self, seqs: Any) -> np.ndarray:
        if seqs is None:
            return np.arange(self.batch_size)
        idx = np.atleast_1d(np.asarray(seqs))
        if idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"seqs must be integer sequence indices, got dtype {idx.dtype}")
        bad = (idx < 0) | (idx >= self.batch_size)
        if bad.any():
            raise ValueError(f"seqs holds {int(idx[bad][0])}, outside [0, {self.batch_size}) sequences")
        if np.unique(idx).size != idx.size:
            raise ValueError(f"seqs {idx.tolist()} names a sequence twice")
        return idx.astype(np.int64)

    def _prepare(self, token_ids: Any, dead_mask: Any, seqs: Any, starts: Any = None) -> tuple[Any, ...]:
        """Compressed (B', T) ids, dead mask, starts (restarts included), ends (see
        `NgramHasher.boundaries`), sequence indices, and whether the input was 1-D."""
        ids = check_token_ids(token_ids, self.hasher.config.vocab_size)
        dead = check_dead_mask(dead_mask, ids.shape)
        st = check_starts(starts, ids.shape)
        idx = self._select(seqs)
        one_d = ids.ndim == 1
        if one_d:
            if idx.size != 1:
                raise ValueError(
                    f"a 1-D chunk of {ids.shape[0]} tokens is one sequence's, but this stream has {idx.size} "
                    "selected sequences; pass seqs=<index> or a [B, T] array"
                )
            ids = ids[None]
            dead = None if dead is None else dead[None]
            st = None if st is None else st[None]
        elif ids.shape[0] != idx.size:
            raise ValueError(f"token_ids has {ids.shape[0]} rows but {idx.size} sequences are selected")
        xc = self.hasher.compression.lookup[ids]
        if dead is not None and not dead.any():
            dead = None
        st, ends = self.hasher.boundaries(ids, st)
        if st is not None and not st.any():
            st = None
        return xc, dead, st, ends, idx, one_d

    def _current_window(self, idx: np.ndarray) -> np.ndarray:
        """Look-back window after the committed tokens and the drafts of sequences idx."""
        if self._draft_vals.shape[1] == 0 or not self._n_draft[idx].any():
            return self._window[idx]
        return self._draft_window(idx, self._n_draft[idx])

    def _draft_window(self, idx: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Look-back window after the committed tokens and the first `lengths` drafts of sequences idx."""
        return self.hasher.next_window(
            self._draft_vals[idx],
            self._draft_dead[idx],
            self._window[idx],
            lengths=lengths,
            starts=self._draft_starts[idx],
            ends=self._draft_ends[idx],
        )

    # ------------------------------------------------------------------ committed tokens
    def feed(self, token_ids: Any, dead_mask: Any = None, seqs: Any = None, *, starts: Any = None) -> Any:
        """Hash and commit a chunk (on the host; a device-resident state comes down and goes back).

        Args:
            token_ids: [T] for one sequence, or [B', T] for the sequences `seqs`.
            dead_mask: Bool like `token_ids`: True at dead (image) positions.
            seqs: Indices of the sequences the rows of `token_ids` are (default: all; exactly one
                for 1-D ids).
            starts: Bool like `token_ids`: True where a new window begins (a new document).

        Returns:
            The rows, [T, n_layers, heads] (1-D input) or [B', T, n_layers, heads]; a torch tensor
                for a torch input.

        Raises:
            RuntimeError: Drafted tokens are pending for these sequences.
            TypeError: The ids or `seqs` are not integers, or a mask is not bool.
            ValueError: An id lies outside the vocabulary, a shape disagrees, or `seqs` is invalid.
        """
        return self._host_call(lambda: self._feed(token_ids, dead_mask, seqs, starts))

    def _feed(self, token_ids: Any, dead_mask: Any, seqs: Any, starts: Any) -> Any:
        xc, dead, st, ends, idx, one_d = self._prepare(token_ids, dead_mask, seqs, starts)
        if self._n_draft[idx].any():
            raise RuntimeError(
                "drafted tokens are pending for these sequences: commit() or rollback() them first"
            )
        window = self._window[idx]
        rows = self.hasher.hash_compressed(xc, dead, window, starts=st)
        self._window[idx] = self.hasher.next_window(xc, dead, window, starts=st, ends=ends)
        self._position[idx] += xc.shape[1]
        return rows_like(rows[0] if one_d else rows, token_ids)

    def step(
        self,
        token_ids: Any,
        dead_mask: Any = None,
        *,
        starts: Any = None,
        out: Any = None,
        check_ids: bool = True,
    ) -> Any:
        """One decode step: one token per sequence, hashed and committed.

        CUDA ids (with triton): one Triton launch on the ids' device compresses, checks and hashes the
        ids against the window kept there and commits them into it in place: no copy, no host sync, no
        allocation with `out` (`capture("step")` records it in a CUDA graph). An id out of range, or
        drafts pending, cannot raise there: that sequence is left unchanged with a dead token's rows and
        the error is raised by `check()` or the next host-side method.

        Args:
            token_ids: [B] ids, one per sequence.
            dead_mask: Bool [B]: True for a dead (image) token.
            starts: Bool [B]: True for a sequence whose token begins a new window (sees only pads).
            out: A preallocated C-contiguous int64 or int32 array (numpy, or a torch tensor on the
                ids' device) of shape [B, n_layers, heads]; the rows are written into it.
            check_ids: Accepted for the callers that pass it; the ids are checked either way (on
                the device the check is free).

        Returns:
            The rows [B, n_layers, heads]: `out` when given; else a torch int64 tensor (on the
                input's device) for a torch input, a numpy array otherwise.

        Raises:
            RuntimeError: Drafted tokens are pending (on the host).
            TypeError: The ids are not integers, a mask is not bool, or `out` is of the wrong kind.
            ValueError: The ids are not [B], an id lies outside the vocabulary, or `out` has the
                wrong shape or dtype. Nothing is committed then.
        """
        cpu_tensor = False
        if type(token_ids) is torch.Tensor:
            if self.hasher.backend is HashBackend.AUTO and kernels.use_triton(token_ids):
                return self._step_device(token_ids, dead_mask, out, starts)
            cpu_tensor = token_ids.is_cpu and not token_ids.requires_grad
        if self._resident:
            return self._host_call(lambda: self.step(token_ids, dead_mask, starts=starts, out=out))
        ids = token_ids.numpy() if cpu_tensor else _host_array(token_ids)  # .numpy(): a view, no copy
        if ids.ndim != 1 or ids.shape[0] != self.batch_size:
            raise ValueError(
                f"step() takes one token per sequence, shape [{self.batch_size}], got {tuple(ids.shape)}"
            )
        tables = self.hasher.kernel_tables()
        if tables is None:
            return self._step_feed(token_ids, ids, dead_mask, starts, out)
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            ids = np.ascontiguousarray(check_token_ids(ids, self.hasher.config.vocab_size))
        dead, has_dead = self._step_mask(dead_mask, ids.shape, check_dead_mask)
        st, has_starts = self._step_mask(starts, ids.shape, check_starts)
        rid = self.hasher.config.restart_after_id
        if out is None and (cpu_tensor or type(token_ids) is np.ndarray):  # the common case, kept short
            out_np = np.empty(self._shape, dtype=np.int64)
            result = torch.from_numpy(out_np) if cpu_tensor else out_np
        else:
            out_np, result = self._step_out(out, token_ids)
        code, b = tables.module.step(
            ids,
            tables.lookup,
            dead,
            has_dead,
            st,
            has_starts,
            -1 if rid is None else rid,
            self._window,
            self._position,
            self._n_draft,
            *tables.layout_args,
            self._look,
            out_np,
        )
        if code != tables.module.STEP_OK:
            if code == tables.module.STEP_BAD_ID:
                check_token_ids(ids, self.hasher.config.vocab_size)  # raises, naming the id and position
            raise RuntimeError(
                f"drafted tokens are pending for sequence {b}: commit() or rollback() them first"
            )
        return result

    def _step_device(self, ids: torch.Tensor, dead_mask: Any, out: Any, starts: Any = None) -> Any:
        """step() on the ids' device: one `kernels.stream_hash` launch on the state kept there (the
        decode hot path: a launch-bound step, so the checks are the cheap ones, done once per `out`)."""
        b = self._batch_size
        if ids.dim() != 1 or ids.shape[0] != b:
            raise ValueError(f"step() takes one token per sequence, shape [{b}], got {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
            check_token_ids(ids, self.hasher.config.vocab_size)  # raises the CPU path's TypeError
        dead, st = (
            (None, None) if dead_mask is None and starts is None else device_masks(ids, dead_mask, starts)
        )
        if out is None:
            out = torch.empty(self._shape, dtype=torch.int64, device=ids.device)
        elif out is not self._out_checked or out.shape != self._shape or out.device != ids.device:
            self._out_checked = device_out(self.hasher, out, self._shape, ids.device)
        ds = self._device
        if ds is None or not self._resident or ds.device != ids.device:
            ds = self._on_device(ids.device)
        ds.hash(ids, dead, st, None, out, draft=False)
        return out

    def _step_mask(
        self, mask: Any, shape: tuple[int, ...], check: Callable[[Any, tuple[int, ...]], Any]
    ) -> tuple[np.ndarray, bool]:
        """A step's bool mask (dead tokens or window starts) as the kernel takes it: (array, given)."""
        if mask is None:
            return self._no_dead, False
        arr = _host_array(mask)
        if arr.dtype != np.bool_ or arr.shape != shape:
            check(arr, shape)  # raises with the reason
        return np.ascontiguousarray(arr), True

    def _step_out(self, out: Any, like: Any) -> tuple[np.ndarray, Any]:
        """(the numpy array the kernel writes, what step returns) for step's `out` argument."""
        shape = self._shape
        if out is None:
            rows = np.empty(shape, dtype=np.int64)
            return rows, rows_like(rows, like)
        is_tensor = isinstance(out, torch.Tensor)
        if is_tensor and out.device.type != "cpu":
            raise ValueError(f"out must be a CPU tensor or a numpy array, got a tensor on {out.device}")
        arr = out.numpy() if is_tensor else out
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"out must be a numpy array or a CPU torch tensor, got {type(out).__name__}")
        self.hasher.check_out_dtype(arr.dtype)
        if arr.shape != shape or not arr.flags.c_contiguous or not arr.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous array of shape {shape}, got {arr.shape}")
        return arr, out

    def _step_feed(self, token_ids: Any, ids: np.ndarray, dead_mask: Any, starts: Any, out: Any) -> Any:
        """step() without the kernel: a one-token chunk through `feed` (the numpy backend)."""
        col = ids.reshape(self.batch_size, 1)
        dm = None if dead_mask is None else _host_array(dead_mask).reshape(self.batch_size, 1)
        st = None if starts is None else _host_array(starts).reshape(self.batch_size, 1)
        target = None if out is None else self._step_out(out, token_ids)  # a bad out raises before feed
        rows = self.feed(col, dm, starts=st)
        rows_np = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows
        if target is None:
            return rows_like(np.ascontiguousarray(rows_np[:, 0]), token_ids)
        arr, result = target
        arr[...] = rows_np[:, 0]
        return result

    # ------------------------------------------------------------------ speculative decoding
    def draft(
        self, token_ids: Any, dead_mask: Any = None, seqs: Any = None, *, starts: Any = None, out: Any = None
    ) -> Any:
        """Hash tentative tokens after the committed ones and any earlier drafts (nothing committed).

        CUDA ids: one launch on the device, like `step` (no sync).

        Args:
            token_ids: [T] for one sequence, or [B', T] for the sequences `seqs`.
            dead_mask: Bool like `token_ids`: True at dead (image) positions.
            seqs: Indices of the sequences the rows of `token_ids` are (default: all).
            starts: Bool like `token_ids`: True where a new window begins.
            out: For CUDA ids only: a preallocated int64/int32 tensor of the rows' shape.

        Returns:
            The rows, shaped like `feed`'s.

        Raises:
            TypeError: The ids or `seqs` are not integers, or a mask is not bool.
            ValueError: `out` given for host ids, a draft past `max_draft` while the state is on
                the device, or bad ids, masks or `seqs` (as in `feed`).
        """
        if (
            type(token_ids) is torch.Tensor
            and self.hasher.backend is HashBackend.AUTO
            and kernels.use_triton(token_ids)
        ):
            return self._draft_device(token_ids, dead_mask, seqs, starts, out)
        if out is not None:
            raise ValueError("draft(out=...) is for CUDA ids; on the host the rows come back as a new array")
        limit = self._max_draft if self._resident else None
        return self._host_call(lambda: self._draft(token_ids, dead_mask, seqs, starts, limit))

    def _draft(self, token_ids: Any, dead_mask: Any, seqs: Any, starts: Any, limit: int | None) -> Any:
        xc, dead, st, ends, idx, one_d = self._prepare(token_ids, dead_mask, seqs, starts)
        k = xc.shape[1]
        if limit is not None and int(self._n_draft[idx].max()) + k > limit:
            b = int(idx[np.argmax(self._n_draft[idx])])
            raise ValueError(
                f"sequence {b} has {int(self._n_draft[b])} drafted tokens and a draft of {k} more passes "
                f"max_draft={limit} (the state is on the device): commit() or rollback() first, or make "
                "the stream with a larger max_draft"
            )
        # A restart id as the last earlier draft restarts the window at this chunk's first token:
        # `boundaries` sees this chunk alone, so the start is recorded here, or a later commit of
        # both rounds would let the restart id into the window.
        n_before = self._n_draft[idx]
        if n_before.any():
            carried = (n_before > 0) & self._draft_ends[idx, np.maximum(n_before - 1, 0)]
            if carried.any():
                st = np.zeros(xc.shape, dtype=bool) if st is None else st.copy()
                st[:, 0] |= carried
        rows = self.hasher.hash_compressed(xc, dead, self._current_window(idx), starts=st)
        need = int(self._n_draft[idx].max()) + k
        if need > self._draft_vals.shape[1]:  # grow the draft buffer (rare: bounded by the draft length)
            grow = ((0, 0), (0, need - self._draft_vals.shape[1]))
            self._draft_vals = np.pad(self._draft_vals, grow)
            self._draft_dead = np.pad(self._draft_dead, grow)
            self._draft_starts = np.pad(self._draft_starts, grow)
            self._draft_ends = np.pad(self._draft_ends, grow)
        cols = self._n_draft[idx, None] + np.arange(k)  # (B', k) slots after each sequence's drafts
        vals = xc if dead is None else np.where(dead, self.hasher.pad, xc)
        self._draft_vals[idx[:, None], cols] = vals
        self._draft_dead[idx[:, None], cols] = False if dead is None else dead
        self._draft_starts[idx[:, None], cols] = False if st is None else st
        self._draft_ends[idx[:, None], cols] = False if ends is None else ends
        self._n_draft[idx] += k
        return rows_like(rows[0] if one_d else rows, token_ids)

    def _draft_device(self, ids: torch.Tensor, dead_mask: Any, seqs: Any, starts: Any, out: Any) -> Any:
        """draft() on the ids' device: one `kernels.stream_hash` launch (draft mode)."""
        vocab = self.hasher.config.vocab_size
        if ids.dim() not in (1, 2) or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
            check_token_ids(ids, vocab)  # raises with the CPU path's message
        idx = self._select(seqs)
        one_d = ids.dim() == 1
        if one_d and idx.size != 1:
            raise ValueError(
                f"a 1-D chunk of {ids.shape[0]} tokens is one sequence's, but this stream has {idx.size} "
                "selected sequences; pass seqs=<index> or a [B, T] array"
            )
        if not one_d and ids.shape[0] != idx.size:
            raise ValueError(f"token_ids has {ids.shape[0]} rows but {idx.size} sequences are selected")
        dead, st = device_masks(ids, dead_mask, starts)
        out = device_out(self.hasher, out, tuple(ids.shape) + self._shape[1:], ids.device)
        ds = self._on_device(ids.device)
        seq_t = None if seqs is None else torch.from_numpy(idx).to(ids.device)
        ds.hash(ids.reshape(-1, ids.shape[-1]), dead, st, seq_t, out, draft=True)
        return out

    def commit(self, n_accepted: Any, seqs: Any = None) -> None:
        """Keep the first `n_accepted` drafted tokens of each selected sequence; drop the rest.

        On the device (one launch, no sync) a count above the drafts pending is recorded, not raised
        (see `check`).

        Args:
            n_accepted: An int, or one per selected sequence; on the device it may be a tensor
                there (e.g. the verifier's accepted counts).
            seqs: The sequences (default: all).

        Raises:
            TypeError: The counts are not integers.
            ValueError: A count is negative or above that sequence's drafts (on the host).
        """
        if self._resident:
            self._commit_device(n_accepted, seqs)
            return
        idx = self._select(seqs)
        n = np.broadcast_to(np.asarray(n_accepted), idx.shape)
        if not np.issubdtype(n.dtype, np.integer):
            raise TypeError(f"n_accepted must be integers, got dtype {n.dtype}")
        bad = (n < 0) | (n > self._n_draft[idx])
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"cannot commit {int(n[j])} tokens of sequence {int(idx[j])}: it has {int(self._n_draft[idx[j]])} drafted"
            )
        if n.any():
            self._window[idx] = self._draft_window(idx, n)
            self._position[idx] += n
        self._n_draft[idx] = 0

    def _commit_device(self, n_accepted: Any, seqs: Any) -> None:
        ds = self._device
        assert ds is not None
        ds.commit(commit_counts(n_accepted, self._select(seqs), seqs is None, self._batch_size, ds.device))

    def rollback(self, seqs: Any = None) -> None:
        """Forget every drafted token of the selected sequences.

        Args:
            seqs: The sequences (default: all).
        """
        self.commit(0, seqs)

    def reset(self, seqs: Any = None) -> None:
        """Start the selected sequences afresh (a new request in that batch slot).

        On the device this runs without a sync (a recorded error of those sequences stays until
        `check`).

        Args:
            seqs: The sequences (default: all).
        """
        idx = self._select(seqs)
        if self._resident:
            assert self._device is not None
            self._device.reset(idx)
            return
        self._window[idx] = self.hasher.pad
        self._position[idx] = 0
        self._n_draft[idx] = 0

    def state_dict(self) -> dict[str, np.ndarray]:
        """The committed state, for checkpointing a generation; drafts are not saved.

        Returns:
            Copies of `window` and `position`, under those keys.
        """
        self._pull()
        return {"window": self._window.copy(), "position": self._position.copy()}

    # ------------------------------------------------------------------ CUDA graphs
    def capture(
        self,
        kind: str = "step",
        *,
        tokens: int = 1,
        dead_mask: bool = False,
        starts: bool = False,
        out_dtype: torch.dtype = torch.int64,
        device: Any = None,
    ) -> StreamGraph:
        """A CUDA graph of one device operation on this stream, bound to static buffers.

        The state moves to the CUDA `device` and stays there; capturing changes nothing in it (the
        kernel is compiled by a run whose changes are undone). Replay with `graph(ids, ...)`, which
        refuses inputs of another shape: a graph is for this batch size only. A graph replays on the
        state it was captured on; it raises once the stream moved to another device.

        Args:
            kind: "step" (ids [B]), "draft" (ids [B, tokens]) or "commit" (n_accepted [B]).
            tokens: Tokens per sequence: 1 for a step, >= 1 for a draft.
            dead_mask: Whether the graph takes a dead mask.
            starts: Whether the graph takes a starts mask.
            out_dtype: The rows' dtype, torch.int64 or torch.int32.
            device: A CUDA device; None is the current one.

        Returns:
            The graph, called with the inputs to replay it.

        Raises:
            ValueError: An unknown `kind`, or a bad `tokens` count.
        """
        if kind not in ("step", "draft", "commit"):
            raise ValueError(f"kind={kind!r} is not one of 'step', 'draft', 'commit'")
        if (
            isinstance(tokens, bool)
            or not isinstance(tokens, int)
            or tokens < 1
            or (kind == "step" and tokens != 1)
        ):
            raise ValueError(f"tokens={tokens!r}: a step takes 1 token per sequence, a draft >= 1")
        dev = _cuda_device(device)
        self.hasher.check_out_dtype(out_dtype)
        ds = self._on_device(dev)

        def run(inputs: dict[str, Any], out: Any) -> None:
            if kind == "commit":
                self._commit_device(inputs["n_accepted"], None)
            elif kind == "step":
                self._step_device(inputs["ids"], inputs["dead_mask"], out, inputs["starts"])
            else:
                self._draft_device(inputs["ids"], inputs["dead_mask"], None, inputs["starts"], out)

        shape = (self._batch_size,) if kind == "step" else (self._batch_size, tokens)
        return StreamGraph.capture(
            kind,
            ds,
            shape,
            self._shape[1:],
            dead_mask,
            starts,
            out_dtype,
            run,
            functools.partial(self._graph_ready, ds),
        )

    def _graph_ready(self, ds: DeviceState) -> None:
        """Before a replay: the stream still uses the state the graph was captured on, and holds it there."""
        if self._device is not ds:
            raise RuntimeError(
                f"this graph was captured on the stream's state on {ds.device}, which the stream no longer "
                "uses (it moved to another device): capture the graph again"
            )
        if not self._resident:
            ds.upload(self._host_view())
            self._resident = True


def _cuda_device(device: Any) -> torch.device:
    """`device` (default: the current CUDA device) as a torch.device with its index."""
    dev = torch.device("cuda" if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _host_array(x: Any) -> np.ndarray:
    """x as a numpy array; a torch tensor is moved to the host first (a sync point on CUDA)."""
    if type(x) is np.ndarray:
        return x
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and not x.requires_grad:
            return x.numpy()  # shares memory: no copy on the decode hot path
        return x.detach().cpu().numpy()
    return np.asarray(x)
