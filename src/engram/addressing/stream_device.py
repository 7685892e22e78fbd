"""A `HashStream`'s state on a CUDA device, and the CUDA graphs that replay its operations.

`DeviceState`: the packed int64 state (B, columns) of `engram.kernels.stream_state` (window, position,
drafts, error record), allocated once per device and never reallocated, so graphs captured over it stay
valid; `upload` / `download` move the whole state in one copy, `take_error` reads the error record (a
sync point) and turns it into the exception the CPU path raises. `StreamGraph`: one captured
operation (a step, a draft of T tokens, a commit) bound to static input and output buffers; it
refuses inputs of another shape, and a stream that no longer uses the state it was captured on.
Knows the packed layout and the hasher's shapes; the dispatch lives in addressing/stream.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engram import kernels
from engram.addressing.hashing import NgramHasher
from engram.addressing.inputs import check_dead_mask, check_starts
from engram.kernels.stream_state import (
    ERR_BAD_ID,
    ERR_COMMIT,
    ERR_DRAFT_FULL,
    ERR_DRAFTS_PENDING,
    FLAG_DEAD,
    FLAG_END,
    FLAG_START,
    StreamLayout,
)

__all__ = ["DeviceState", "HostDrafts", "StreamGraph", "commit_counts", "device_masks", "device_out"]

# what each captured kind takes, in positional order
_GRAPH_INPUTS = {
    "step": ("ids", "dead_mask", "starts"),
    "draft": ("ids", "dead_mask", "starts"),
    "commit": ("n_accepted",),
}


class HostDrafts:
    """The host's view of the state: window (B, W), position (B,), n_draft (B,) and the drafts (B, cap)."""

    def __init__(
        self,
        window: np.ndarray,
        position: np.ndarray,
        n_draft: np.ndarray,
        vals: np.ndarray,
        dead: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
    ) -> None:
        self.window, self.position, self.n_draft = window, position, n_draft
        self.vals, self.dead, self.starts, self.ends = vals, dead, starts, ends


class DeviceState:
    """The packed decode state of `batch_size` sequences on `device` (see the module docstring)."""

    def __init__(self, hasher: NgramHasher, batch_size: int, max_draft: int, device: torch.device) -> None:
        self.layout = StreamLayout(hasher.window_size, max_draft)
        self.device = device
        self.hasher = hasher
        self.state = torch.zeros((batch_size, self.layout.columns), dtype=torch.int64, device=device)
        # the hasher's device tables: compression lookup, multipliers, primes, offsets
        self.tables = hasher.device_tables(device)

    def hash(
        self,
        ids: torch.Tensor,
        dead: torch.Tensor | None,
        starts: torch.Tensor | None,
        seqs: torch.Tensor | None,
        out: torch.Tensor,
        *,
        draft: bool,
    ) -> None:
        """`kernels.stream_hash` of ids (n, T) or (n,) (dead, starts like them or None) on this state:
        one launch."""
        shape = ids.shape
        kernels.stream_hash(
            ids if ids.is_contiguous() else ids.contiguous(),
            None if dead is None else dead.view(shape),
            None if starts is None else starts.view(shape),
            seqs,
            self.state,
            self.layout,
            *self.tables,
            self.hasher.pad,
            self.hasher.config.restart_after_id,
            out,
            draft=draft,
        )

    def commit(self, n_accepted: torch.Tensor) -> None:
        """`kernels.stream_commit` of (B,) int64 counts (-1: leave the sequence's drafts pending)."""
        kernels.stream_commit(n_accepted, self.state, self.layout, self.hasher.pad)

    def reset(self, idx: np.ndarray) -> None:
        """Sequences idx start afresh: pad window, no tokens, no drafts (their error record stays)."""
        rows = torch.from_numpy(idx).to(self.device)
        lay = self.layout
        self.state[rows, : lay.window] = self.hasher.pad
        self.state[rows, lay.position : lay.n_draft + 1] = 0

    def upload(self, host: HostDrafts) -> None:
        """Make the device state the host's (one copy; waits for it). Raises before copying anything
        when more tokens are drafted than the device holds (`max_draft`)."""
        lay = self.layout
        most = int(host.n_draft.max()) if host.n_draft.size else 0
        if most > lay.max_draft:
            b = int(np.argmax(host.n_draft))
            raise ValueError(
                f"sequence {b} has {most} drafted tokens but this stream keeps at most max_draft="
                f"{lay.max_draft} on the device: commit() or rollback() first, or make it with a larger max_draft"
            )
        packed = np.zeros(tuple(self.state.shape), dtype=np.int64)
        packed[:, : lay.window] = host.window
        packed[:, lay.position] = host.position
        packed[:, lay.n_draft] = host.n_draft
        cols = min(host.vals.shape[1], lay.max_draft)
        packed[:, lay.vals : lay.vals + cols] = host.vals[:, :cols]
        flags = host.dead * FLAG_DEAD | host.starts * FLAG_START | host.ends * FLAG_END
        packed[:, lay.flags : lay.flags + cols] = flags[:, :cols]
        self.state.copy_(torch.from_numpy(packed))  # host -> device: the error record starts clear

    def download(self, host: HostDrafts) -> HostDrafts:
        """The state on the host (a sync point), after raising the first error the kernels recorded.

        `host`'s arrays are filled in place where they fit; the draft arrays are replaced when narrower
        than the device's `max_draft` (the new ones are returned in the result)."""
        packed = self.state.cpu().numpy()  # sync point
        self._raise_recorded(packed)
        lay, c = self.layout, self.layout.max_draft
        host.window[...] = packed[:, : lay.window]
        host.position[...] = packed[:, lay.position]
        host.n_draft[...] = packed[:, lay.n_draft]
        if host.vals.shape[1] < c:
            b = host.vals.shape[0]
            host.vals = np.zeros((b, c), dtype=np.int64)
            host.dead, host.starts, host.ends = (np.zeros((b, c), dtype=bool) for _ in range(3))
        flags = packed[:, lay.flags : lay.flags + c]
        host.vals[:, :c] = packed[:, lay.vals : lay.vals + c]
        host.dead[:, :c] = (flags & FLAG_DEAD) != 0
        host.starts[:, :c] = (flags & FLAG_START) != 0
        host.ends[:, :c] = (flags & FLAG_END) != 0
        return host

    def take_error(self) -> None:
        """Raise the first error the kernels recorded (and clear the record); a sync point."""
        lay = self.layout
        self._raise_recorded(self.state[:, lay.err : lay.err + 4].cpu().numpy(), offset=0)

    def _raise_recorded(self, packed: np.ndarray, offset: int | None = None) -> None:
        err = packed[:, self.layout.err if offset is None else offset :][:, :4]  # (B, 4)
        failed = np.flatnonzero(err[:, 0])
        if failed.size == 0:
            return
        b = int(failed[0])
        code, pos, value, extra = (int(v) for v in err[b])
        more = f" ({failed.size - 1} more sequences failed too)" if failed.size > 1 else ""
        self.state[:, self.layout.err : self.layout.err + 4] = 0  # reported once (after reading: on a CPU
        # `packed` may share the state's memory)
        vocab = self.hasher.config.vocab_size
        if code == ERR_BAD_ID:
            raise ValueError(
                f"token_ids holds id {value} for sequence {b} at position {pos} (token {extra} of its call), "
                f"outside the tokenizer's ids [0, {vocab}); found on the device, so the call that took it "
                f"returned a dead token's rows for sequence {b} and left it unchanged{more}"
            )
        if code == ERR_DRAFTS_PENDING:
            raise RuntimeError(
                f"drafted tokens are pending for sequence {b} ({value} of them): commit() or rollback() them "
                f"first; the step that found them gave sequence {b} a dead token's rows and left it unchanged{more}"
            )
        if code == ERR_DRAFT_FULL:
            raise ValueError(
                f"sequence {b} has {value} drafted tokens and a draft of {extra} more passes max_draft="
                f"{self.layout.max_draft}: commit() or rollback() first, or make the stream with a larger "
                f"max_draft; that draft gave sequence {b} dead tokens' rows and left it unchanged{more}"
            )
        if code == ERR_COMMIT:
            raise ValueError(f"cannot commit {value} tokens of sequence {b}: it has {extra} drafted{more}")
        raise RuntimeError(f"unknown error code {code} recorded for sequence {b}")  # pragma: no cover


def device_masks(ids: torch.Tensor, dead_mask: Any, starts: Any) -> tuple[Any, Any]:
    """dead_mask and starts as contiguous bool tensors like `ids` on its device (None stays None)."""
    masks = []
    for mask, check in ((dead_mask, check_dead_mask), (starts, check_starts)):
        if mask is not None and (
            not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != ids.shape
        ):
            check(mask, tuple(ids.shape))  # raises with the reason
        masks.append(None if mask is None else mask.to(ids.device).contiguous())
    return masks[0], masks[1]


def device_out(hasher: NgramHasher, out: Any, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`out` checked (contiguous int64/int32 of `shape` on `device`), or a new int64 tensor."""
    if out is None:
        return torch.empty(shape, dtype=torch.int64, device=device)
    if (
        not isinstance(out, torch.Tensor)
        or out.device != device
        or tuple(out.shape) != shape
        or not out.is_contiguous()
        or out.dtype not in (torch.int64, torch.int32)
    ):
        found = (
            f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
        )
        raise ValueError(
            f"out must be a contiguous int64/int32 tensor of shape {shape} on {device}, got {found}"
        )
    hasher.check_out_dtype(out.dtype)  # int32 only where every row fits
    return out


def commit_counts(
    n_accepted: Any, idx: np.ndarray, every: bool, batch: int, device: torch.device
) -> torch.Tensor:
    """(B,) int64 counts on `device` for `commit_kernel`: n_accepted for the sequences idx, -1 elsewhere.

    A tensor already on `device` stays there (no sync; a (B,) int64 one for every sequence is used as
    it is, its -1 entries leaving those sequences' drafts pending); host counts are checked (>= 0)."""
    if isinstance(n_accepted, torch.Tensor) and n_accepted.device == device:
        if n_accepted.is_floating_point() or n_accepted.is_complex() or n_accepted.dtype == torch.bool:
            raise TypeError(f"n_accepted must be integers, got dtype {n_accepted.dtype}")
        if every and tuple(n_accepted.shape) == (batch,) and n_accepted.dtype == torch.int64:
            return n_accepted
        full = torch.full((batch,), -1, dtype=torch.int64, device=device)
        full[torch.from_numpy(idx).to(device)] = n_accepted.to(torch.int64).broadcast_to(idx.shape)
        return full
    n = np.broadcast_to(
        np.asarray(n_accepted.cpu() if isinstance(n_accepted, torch.Tensor) else n_accepted), idx.shape
    )
    if not np.issubdtype(n.dtype, np.integer):
        raise TypeError(f"n_accepted must be integers, got dtype {n.dtype}")
    if (n < 0).any():
        j = int(np.argmax(n < 0))
        raise ValueError(f"cannot commit {int(n[j])} tokens of sequence {int(idx[j])}: counts are >= 0")
    host = np.full(batch, -1, dtype=np.int64)
    host[idx] = n
    return torch.from_numpy(host).to(device)


class StreamGraph:
    """One captured `HashStream` operation (`HashStream.capture`): call it with the inputs of one step.

    `kind` "step": `g(ids [B], dead_mask=None, starts=None)` -> rows [B, L, H]; "draft":
    `g(ids [B, T], ...)` -> rows [B, T, L, H]; "commit": `g(n_accepted [B])` (-1 leaves a sequence's
    drafts pending). Inputs are copied into the static buffers (`inputs`) and the graph replays; the
    rows returned are the static `out`, overwritten by the next replay (clone to keep them). `replay()`
    replays with whatever the static buffers hold (write them in place to skip the copy). An input of
    another shape (another batch size) is refused, never broadcast; an optional input the graph was
    captured with reads as all False when left out.
    """

    def __init__(
        self,
        kind: str,
        graph: torch.cuda.CUDAGraph,
        inputs: dict[str, torch.Tensor | None],
        out: torch.Tensor | None,
        ready: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.graph = graph
        self.inputs = inputs
        self.out = out
        self._ready = ready  # the stream's check that it still uses the captured state (and uploads it)

    @classmethod
    def capture(
        cls,
        kind: str,
        ds: DeviceState,
        shape: tuple[int, ...],
        row_shape: tuple[int, ...],
        dead_mask: bool,
        starts: bool,
        out_dtype: torch.dtype,
        run: Callable[[dict[str, Any], torch.Tensor | None], None],
        ready: Callable[[], None],
    ) -> StreamGraph:
        """Capture `run(inputs, out)` over fresh static buffers: ids etc. of `shape` ([B] or [B, T]),
        rows of `shape + row_shape`. A first run on a side stream compiles and loads the kernels; the
        state it changed is put back, so capturing changes nothing."""
        dev = ds.device
        inputs: dict[str, torch.Tensor | None]
        out = None
        if kind == "commit":
            inputs = {"n_accepted": torch.full(shape[:1], -1, dtype=torch.int64, device=dev)}
        else:
            inputs = {
                "ids": torch.zeros(shape, dtype=torch.int64, device=dev),
                "dead_mask": torch.zeros(shape, dtype=torch.bool, device=dev) if dead_mask else None,
                "starts": torch.zeros(shape, dtype=torch.bool, device=dev) if starts else None,
            }
            out = torch.empty(shape + row_shape, dtype=out_dtype, device=dev)
        saved = ds.state.clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            run(inputs, out)
        torch.cuda.current_stream(dev).wait_stream(side)
        ds.state.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(inputs, out)
        return cls(kind, graph, inputs, out, ready)

    @property
    def batch_size(self) -> int:
        first = next(t for t in self.inputs.values() if t is not None)
        return int(first.shape[0])

    def replay(self) -> torch.Tensor | None:
        self._ready()
        self.graph.replay()
        return self.out

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        names = _GRAPH_INPUTS[self.kind]
        if len(args) > len(names):
            raise TypeError(f"a {self.kind} graph takes at most {len(names)} inputs {names}, got {len(args)}")
        given = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names or key in given:
                raise TypeError(
                    f"unexpected or repeated input {key!r} for a {self.kind} graph (inputs: {names})"
                )
            given[key] = value
        for name in names:
            static = self.inputs[name]
            value = given.get(name)
            if static is None:
                if value is not None:
                    raise ValueError(
                        f"this {self.kind} graph was captured without {name}: capture(..., {name}=True) to pass one"
                    )
                continue
            if value is None:
                if name in ("ids", "n_accepted"):
                    raise TypeError(f"a {self.kind} graph needs {name}")
                static.zero_()  # left out: no dead tokens / no window starts
                continue
            self._copy_in(name, static, value)
        return self.replay()

    def _copy_in(self, name: str, static: torch.Tensor, value: Any) -> None:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        if tuple(t.shape) != tuple(static.shape):
            b = self.batch_size
            raise ValueError(
                f"this {self.kind} graph was captured for {b} sequences ({name} of shape {tuple(static.shape)}) "
                f"but {name} has shape {tuple(t.shape)}: a CUDA graph replays fixed shapes; pad the batch "
                f"to {b} or capture another graph on a stream of {t.shape[0] if t.dim() else '?'} sequences"
            )
        if static.dtype == torch.bool:
            if t.dtype != torch.bool:
                raise TypeError(f"{name} must be bool, got {t.dtype}")
        elif t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {t.dtype}")
        static.copy_(t, non_blocking=t.device == static.device)
