"""Decode-time hashing state (SPEC §4, "Decode"): chunked prefill, one-token steps, speculative
drafts with commit/rollback, giving exactly the rows of hashing the whole sequence at once.

`HashStream` keeps, per sequence, only the committed look-back window, a token count and the
drafts in flight (never O(sequence length)). `step()` is one numba kernel call on the host, or
the Triton hash kernel with the window kept on the device for CUDA ids. Knows the hasher; knows
nothing of tables or the model. Design: docs/addressing.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engram import kernels
from engram.addressing.hashing import HashBackend, NgramHasher
from engram.addressing.inputs import (
    check_dead_mask,
    check_device_inputs,
    check_starts,
    check_token_ids,
    rows_like,
)

__all__ = ["HashStream"]


class HashStream:
    """Incremental hashing of `batch_size` sequences.

    - `feed(ids)`: hash and commit a chunk ([T] for one sequence, [B', T] for the sequences `seqs`).
    - `step(ids)`: one token for every sequence (ids [B]); returns rows [B, n_layers, heads].
    - `draft(ids)`: hash tentative tokens after the committed ones (and after earlier drafts);
      `commit(n)` keeps the first n drafted tokens of each sequence and forgets the rest;
      `rollback()` forgets them all.

    Every method takes `starts` (bool like the ids: True where a new window begins, e.g. a new
    document packed into the same row) and honours `config.restart_after_id`; a restart after the
    last committed token carries into the next chunk or step through the window (all pads).
    """

    def __init__(self, hasher: NgramHasher, batch_size: int = 1) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
            raise TypeError(f"batch_size must be an int (sequences decoded together), got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        batch_size = int(batch_size)
        self.hasher = hasher
        self.batch_size = batch_size
        w = hasher.window_size
        self._window = np.full((batch_size, w), hasher.pad, dtype=np.int64)  # (B, n-1), most recent first
        self._position = np.zeros(batch_size, dtype=np.int64)  # committed tokens per sequence
        # After steps on a CUDA device the committed state lives there: (window, position) tensors;
        # every other method brings it back first (`_to_host`, a sync point).
        self._dev: tuple[Any, Any] | None = None
        # drafts: compressed ids (pad at dead positions) and dead flags, (B, capacity), n_draft used
        self._draft_vals = np.zeros((batch_size, 0), dtype=np.int64)
        self._draft_dead = np.zeros((batch_size, 0), dtype=bool)
        self._draft_starts = np.zeros((batch_size, 0), dtype=bool)
        self._draft_ends = np.zeros((batch_size, 0), dtype=bool)
        self.n_draft = np.zeros(batch_size, dtype=np.int64)
        # step() scratch: the kernel's look-back values, and a stand-in for an absent dead mask
        self._look = np.zeros(hasher.config.max_ngram_size, dtype=np.uint64)
        self._no_dead = np.zeros(1, dtype=np.bool_)
        self._shape = hasher.output_shape((batch_size,))  # (B, n_layers, heads) of a step's rows

    @property
    def window(self) -> np.ndarray:
        """(B, max_ngram-1) committed look-back, most recent first, pads and blocking applied (on the
        host: reading it after decode steps on a GPU is a sync point)."""
        self._to_host()
        return self._window

    @property
    def position(self) -> np.ndarray:
        """(B,) committed tokens per sequence (on the host, like `window`)."""
        self._to_host()
        return self._position

    def _to_host(self) -> None:
        """Bring the committed state back from the device after GPU decode steps (a sync point)."""
        if self._dev is not None:
            window, position = self._dev
            self._window[...] = window.cpu().numpy()
            self._position[...] = position.cpu().numpy()
            self._dev = None

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
        if self._draft_vals.shape[1] == 0 or not self.n_draft[idx].any():
            return self._window[idx]
        return self._draft_window(idx, self.n_draft[idx])

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
        """Hash and commit a chunk; rows [T, n_layers, heads] (1-D input) or [B', T, ...].

        `starts` (bool like token_ids): True where a new window begins (a new document)."""
        self._to_host()
        xc, dead, st, ends, idx, one_d = self._prepare(token_ids, dead_mask, seqs, starts)
        if self.n_draft[idx].any():
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
        """One decode step: one token per sequence (ids [B]); rows [B, n_layers, heads].

        `starts` (bool [B]): True for a sequence whose token begins a new window (sees only pads).

        Without `out`, a torch input gives a torch int64 tensor (on the input's device), anything
        else a numpy array. `out`: a preallocated C-contiguous int64 or int32 array (numpy, or a
        torch tensor on the ids' device) of shape [B, n_layers, heads]; the rows are written into it
        and it is returned. Bad ids, a bad mask, or drafts pending raise and leave the state unchanged.

        CUDA ids (with triton) stay on the device: the Triton hash kernel reads the look-back window
        kept there and the window shifts in place, so a step neither copies nor syncs, except for the
        id range check (one sync; `check_ids=False` skips it for ids the model sampled itself, which
        are in range by construction; an out-of-range id is then a device-side indexing error).
        """
        cpu_tensor = False
        if type(token_ids) is torch.Tensor:
            if self.hasher.backend is HashBackend.AUTO and kernels.use_triton(token_ids):
                return self._step_device(token_ids, dead_mask, out, check_ids, starts)
            cpu_tensor = token_ids.is_cpu and not token_ids.requires_grad
        if self._dev is not None:
            self._to_host()
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
            self.n_draft,
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

    def _step_device(
        self, token_ids: Any, dead_mask: Any, out: Any, check_ids: bool, starts: Any = None
    ) -> Any:
        """step() on the ids' device with the Triton kernel; the state moves there on the first call."""
        b, cfg = self.batch_size, self.hasher.config
        ids = token_ids
        if ids.dim() != 1 or ids.shape[0] != b:
            raise ValueError(f"step() takes one token per sequence, shape [{b}], got {tuple(ids.shape)}")
        check_device_inputs(ids, dead_mask, cfg.vocab_size, check_range=check_ids)
        if starts is not None and (
            not isinstance(starts, torch.Tensor) or starts.dtype != torch.bool or starts.shape != ids.shape
        ):
            check_starts(starts, tuple(ids.shape))  # raises with the reason
        if self.n_draft.any():
            raise RuntimeError(
                f"drafted tokens are pending for sequence {int(np.argmax(self.n_draft > 0))}: "
                "commit() or rollback() them first"
            )
        shape = self._shape
        if out is None:
            out = torch.empty(shape, dtype=torch.int64, device=ids.device)
        elif (
            not isinstance(out, torch.Tensor)
            or out.device != ids.device
            or tuple(out.shape) != shape
            or not out.is_contiguous()
            or out.dtype not in (torch.int64, torch.int32)
        ):
            found = (
                f"{out.dtype} {tuple(out.shape)} on {out.device}"
                if isinstance(out, torch.Tensor)
                else type(out)
            )
            raise ValueError(
                f"out must be a contiguous int64/int32 tensor of shape {shape} on {ids.device}, got {found}"
            )
        else:
            self.hasher.check_out_dtype(out.dtype)  # int32 only where every row fits
        if self._dev is None or self._dev[0].device != ids.device:
            self._to_host()
            self._dev = (
                torch.from_numpy(self._window).to(ids.device),
                torch.from_numpy(self._position).to(ids.device),
            )
        window, position = self._dev  # (B, n-1) most recent first, (B,)
        lut, mult, primes, offsets = self.hasher.device_tables(ids.device)
        xc = lut[ids].view(b, 1)  # (B, 1) compressed ids
        dead = None if dead_mask is None else dead_mask.view(b, 1)
        pad = self.hasher.pad
        seen = window if starts is None else window.masked_fill(starts.view(b, 1).to(ids.device), pad)
        kernels.hash_rows(xc, dead, seen, mult, primes, offsets, pad, out.view(b, 1, *shape[1:]))
        # shift in place: the new token becomes the most recent; after a dead token (or a restart id)
        # every look-back is blocked (sticky), so the whole window is pad
        new = torch.cat([xc, seen[:, :-1]], dim=1)  # (B, n-1)
        if dead is not None:
            new.masked_fill_(dead, pad)
        if cfg.restart_after_id is not None:
            new.masked_fill_(ids.view(b, 1) == cfg.restart_after_id, pad)
        window.copy_(new)
        position += 1
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
    def draft(self, token_ids: Any, dead_mask: Any = None, seqs: Any = None, *, starts: Any = None) -> Any:
        """Hash tentative tokens after the committed ones and any earlier drafts (nothing committed)."""
        self._to_host()
        xc, dead, st, ends, idx, one_d = self._prepare(token_ids, dead_mask, seqs, starts)
        # A restart id as the last earlier draft restarts the window at this chunk's first token:
        # `boundaries` sees this chunk alone, so the start is recorded here, or a later commit of
        # both rounds would let the restart id into the window.
        n_before = self.n_draft[idx]
        if n_before.any():
            carried = (n_before > 0) & self._draft_ends[idx, np.maximum(n_before - 1, 0)]
            if carried.any():
                st = np.zeros(xc.shape, dtype=bool) if st is None else st.copy()
                st[:, 0] |= carried
        rows = self.hasher.hash_compressed(xc, dead, self._current_window(idx), starts=st)
        k = xc.shape[1]
        need = int(self.n_draft[idx].max()) + k
        if need > self._draft_vals.shape[1]:  # grow the draft buffer (rare: bounded by the draft length)
            grow = ((0, 0), (0, need - self._draft_vals.shape[1]))
            self._draft_vals = np.pad(self._draft_vals, grow)
            self._draft_dead = np.pad(self._draft_dead, grow)
            self._draft_starts = np.pad(self._draft_starts, grow)
            self._draft_ends = np.pad(self._draft_ends, grow)
        cols = self.n_draft[idx, None] + np.arange(k)  # (B', k) slots after each sequence's drafts
        vals = xc if dead is None else np.where(dead, self.hasher.pad, xc)
        self._draft_vals[idx[:, None], cols] = vals
        self._draft_dead[idx[:, None], cols] = False if dead is None else dead
        self._draft_starts[idx[:, None], cols] = False if st is None else st
        self._draft_ends[idx[:, None], cols] = False if ends is None else ends
        self.n_draft[idx] += k
        return rows_like(rows[0] if one_d else rows, token_ids)

    def commit(self, n_accepted: Any, seqs: Any = None) -> None:
        """Keep the first `n_accepted` drafted tokens (int or one per selected sequence); drop the rest."""
        self._to_host()
        idx = self._select(seqs)
        n = np.broadcast_to(np.asarray(n_accepted), idx.shape)
        if not np.issubdtype(n.dtype, np.integer):
            raise TypeError(f"n_accepted must be integers, got dtype {n.dtype}")
        bad = (n < 0) | (n > self.n_draft[idx])
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"cannot commit {int(n[j])} tokens of sequence {int(idx[j])}: it has {int(self.n_draft[idx[j]])} drafted"
            )
        if n.any():
            self._window[idx] = self._draft_window(idx, n)
            self._position[idx] += n
        self.n_draft[idx] = 0

    def rollback(self, seqs: Any = None) -> None:
        """Forget every drafted token of the selected sequences."""
        self.commit(0, seqs)

    def reset(self, seqs: Any = None) -> None:
        """Start the selected sequences afresh (a new request in that batch slot)."""
        self._to_host()
        idx = self._select(seqs)
        self._window[idx] = self.hasher.pad
        self._position[idx] = 0
        self.n_draft[idx] = 0

    def state_dict(self) -> dict[str, np.ndarray]:
        """Committed state (window, position) for checkpointing a generation; drafts are not saved."""
        self._to_host()
        return {"window": self._window.copy(), "position": self._position.copy()}


def _host_array(x: Any) -> np.ndarray:
    """x as a numpy array; a torch tensor is moved to the host first (a sync point on CUDA)."""
    if type(x) is np.ndarray:
        return x
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and not x.requires_grad:
            return x.numpy()  # shares memory: no copy on the decode hot path
        return x.detach().cpu().numpy()
    return np.asarray(x)
