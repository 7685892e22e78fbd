"""Triton kernels for the n-gram hash (SPEC §4) on CUDA: compressed ids -> table rows, bit-exact to
`engram.addressing.hashing` (tested against `NgramHasher.hash_compressed` and `reference.hash_rows`).

`hash_rows` hashes whole chunks (an optional carried look-back window). `stream_hash` is the decode
step and the speculative draft of `HashStream` on a device: one launch compresses the raw ids, checks
them, hashes them against the look-back kept in the packed state (`stream_state.StreamLayout`) and
commits the new tokens into it in place, so a step needs no host sync and is one node of a CUDA
graph; `stream_commit` keeps n drafted tokens. All int64 arithmetic. Imports triton;
`engram.kernels` imports it on first use only. Design: docs/kernels.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engram.kernels.stream_state import StreamLayout

__all__ = ["hash_rows", "stream_commit", "stream_hash"]

_BLOCK = 128  # tokens per program
_STREAM_BLOCK = 32  # sequences per program of the decode kernels


@triton.jit
def _hash_kernel(
    xc_ptr,  # (B*T,) int64 compressed ids
    dead_ptr,  # (B*T,) uint8, read if HAS_DEAD
    starts_ptr,  # (B*T,) uint8, read if HAS_STARTS: a window restarts at this position
    win_ptr,  # (B, N_GRAM-1) int64 carried look-back (column 0 most recent), read if HAS_WINDOW
    mult_ptr,  # (L, N_GRAM) int64
    primes_ptr,  # (L*(N_GRAM-1)*K,) int64, (layer, order, head) order
    offsets_ptr,  # same
    out_ptr,  # (B*T, L*(N_GRAM-1)*K) int64 or int32
    n_tok,
    seq_len,
    pad,
    N_GRAM: tl.constexpr,
    N_LAYERS: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # flat token ids
    valid = f < n_tok
    b = f // seq_len
    t = f - b * seq_len
    head = tl.arange(0, K_P2)
    hmask = head < K
    width = N_LAYERS * (N_GRAM - 1) * K
    x0 = tl.load(xc_ptr + f, mask=valid, other=0)
    if HAS_DEAD:
        dead0 = tl.load(dead_ptr + f, mask=valid, other=0) != 0
    else:
        dead0 = f < 0  # all False
    look0 = tl.where(dead0, pad, x0)  # a dead token sees only pads
    for li in tl.static_range(N_LAYERS):
        mix = look0 * tl.load(mult_ptr + li * N_GRAM)
        blocked = dead0
        for i in tl.static_range(1, N_GRAM):
            s = t - i
            in_seq = s >= 0
            if HAS_STARTS:  # a start at s+1 hides s and everything farther (sticky)
                start_s = tl.load(starts_ptr + f - i + 1, mask=valid & (s >= -1), other=0) != 0
                blocked = blocked | start_s
            if HAS_DEAD:  # sticky: the first dead position pads this look-back and every farther one
                dead_s = tl.load(dead_ptr + f - i, mask=valid & in_seq, other=0) != 0
                blocked = blocked | (in_seq & dead_s)
            x_s = tl.load(xc_ptr + f - i, mask=valid & in_seq, other=pad)
            if HAS_WINDOW:  # carried values already carry their blocking
                x_w = tl.load(win_ptr + b * (N_GRAM - 1) + (i - t - 1), mask=valid & (s < 0), other=pad)
            else:
                x_w = tl.full([BLOCK], pad, tl.int64)
            look = tl.where(blocked, pad, tl.where(in_seq, x_s, x_w))
            mix = mix ^ (look * tl.load(mult_ptr + li * N_GRAM + i))  # exact: products < 2^63
            col = (li * (N_GRAM - 1) + (i - 1)) * K  # first column of this (layer, order)
            p = tl.load(primes_ptr + col + head, mask=hmask, other=1)
            off = tl.load(offsets_ptr + col + head, mask=hmask, other=0)
            rows = mix[:, None] % p[None, :] + off[None, :]  # (BLOCK, K_P2); mix >= 0: floor mod
            dst = out_ptr + f[:, None] * width + col + head[None, :]
            tl.store(dst, rows.to(out_ptr.dtype.element_ty), mask=valid[:, None] & hmask[None, :])


def hash_rows(
    xc: torch.Tensor,
    dead: torch.Tensor | None,
    window: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
    out: torch.Tensor | None = None,
    *,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows (B, T, L, orders*K) of compressed ids xc (B, T) int64 on one device.

    dead (B, T) bool or None; starts (B, T) bool or None (True: a window restarts there); window (B, max_ngram-1) int64 or None (a sequence start);
    multipliers (L, max_ngram) int64; primes, offsets (L, orders, K) int64 (`NgramHasher`'s arrays as
    tensors); out (B, T, L, orders*K) int64 or int32, contiguous, or None for int64.
    """
    if xc.dim() != 2:
        raise ValueError(f"xc must be compressed ids [B, T], got shape {tuple(xc.shape)}")
    n_layers, n_gram = multipliers.shape
    k = primes.shape[-1]
    if tuple(primes.shape) != (n_layers, n_gram - 1, k) or primes.shape != offsets.shape:
        raise ValueError(
            f"primes {tuple(primes.shape)} and offsets {tuple(offsets.shape)} must both be "
            f"(layers, orders, K) = ({n_layers}, {n_gram - 1}, K) for multipliers {tuple(multipliers.shape)}"
        )
    bsz, seq = xc.shape
    shape = (bsz, seq, n_layers, (n_gram - 1) * k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int64, device=xc.device)
    elif tuple(out.shape) != shape or not out.is_contiguous() or out.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"out must be contiguous int64/int32 of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    if window is not None and tuple(window.shape) != (bsz, n_gram - 1):
        raise ValueError(f"window has shape {tuple(window.shape)}; expected {(bsz, n_gram - 1)}")
    if dead is not None and dead.shape != xc.shape:
        raise ValueError(f"dead has shape {tuple(dead.shape)} but xc has shape {tuple(xc.shape)}")
    if starts is not None and (starts.shape != xc.shape or starts.dtype != torch.bool):
        raise ValueError(
            f"starts must be bool of xc's shape {tuple(xc.shape)}, got {starts.dtype} {tuple(starts.shape)}"
        )
    n_tok = bsz * seq
    if n_tok == 0:
        return out
    xc1 = xc.to(torch.int64).contiguous()
    dead1 = xc1 if dead is None else dead.contiguous().view(torch.uint8)  # any pointer when unused
    win1 = xc1 if window is None else window.to(torch.int64).contiguous()
    starts1 = xc1 if starts is None else starts.contiguous().view(torch.uint8)
    _hash_kernel[(triton.cdiv(n_tok, _BLOCK),)](
        xc1,
        dead1,
        starts1,
        win1,
        multipliers.to(torch.int64).contiguous(),
        primes.to(torch.int64).contiguous().view(-1),
        offsets.to(torch.int64).contiguous().view(-1),
        out,
        n_tok,
        seq,
        int(pad),
        N_GRAM=n_gram,
        N_LAYERS=n_layers,
        K=k,
        K_P2=triton.next_power_of_2(k),
        HAS_DEAD=dead is not None,
        HAS_STARTS=starts is not None,
        HAS_WINDOW=window is not None,
        BLOCK=_BLOCK,
    )
    return out


# ------------------------------------------------------------------------------------------ decode
# The window of BLOCK sequences is a (BLOCK, W_P2) int64 tile, column 0 the most recent token; a column
# is read out with a masked row sum (W is a handful of columns: cheaper than a shared-memory round trip).


@triton.jit
def _column(win, col, c: tl.constexpr):
    """Column c of the (BLOCK, W_P2) window tile, as a (BLOCK,) vector."""
    return tl.sum(tl.where(col[None, :] == c, win, 0), axis=1)


@triton.jit
def _advance(win, col, x, start, clear, pad, W: tl.constexpr):
    """The window after token x (pad if dead): x becomes the most recent; after a start the older
    columns are pad; `clear` (a dead token, a restart id) makes every column pad (sticky blocking)."""
    new = tl.where(col[None, :] == 0, x[:, None], pad)
    for c in tl.static_range(1, W):
        new = tl.where(col[None, :] == c, _column(win, col, c - 1)[:, None], new)
    new = tl.where(start[:, None] & (col[None, :] > 0), pad, new)
    return tl.where(clear[:, None], pad, new)


@triton.jit
def _hash_token(
    x,  # (BLOCK,) compressed id, pad if dead
    blocked,  # (BLOCK,) bool: the look-back is all pad (a dead token, a window start)
    win,  # (BLOCK, W_P2) window before the token
    col,
    pad,
    mult_ptr,
    primes_ptr,
    offsets_ptr,
    dst,  # (BLOCK,) pointers to each sequence's first row of this token
    mask,
    N_GRAM: tl.constexpr,
    N_LAYERS: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
):
    head = tl.arange(0, K_P2)
    hmask = head < K
    for li in tl.static_range(N_LAYERS):
        mix = x * tl.load(mult_ptr + li * N_GRAM)
        for i in tl.static_range(1, N_GRAM):
            look = tl.where(blocked, pad, _column(win, col, i - 1))
            mix = mix ^ (look * tl.load(mult_ptr + li * N_GRAM + i))  # exact: products < 2^63
            c0 = (li * (N_GRAM - 1) + (i - 1)) * K  # first column of this (layer, order)
            p = tl.load(primes_ptr + c0 + head, mask=hmask, other=1)
            off = tl.load(offsets_ptr + c0 + head, mask=hmask, other=0)
            rows = mix[:, None] % p[None, :] + off[None, :]  # (BLOCK, K_P2); mix >= 0: floor mod
            ptr = dst[:, None] + c0 + head[None, :]
            tl.store(ptr, rows.to(ptr.dtype.element_ty), mask=mask[:, None] & hmask[None, :])


# The integers vary from call to call (batch, tokens, strides): one compiled kernel serves them all.
@triton.jit(
    do_not_specialize=["n", "T", "dead_sb", "dead_st", "starts_sb", "starts_st", "vocab", "pad", "restart_id"]
)
def _stream_kernel(
    ids_ptr,  # (n, T) raw token ids, any integer dtype
    dead_ptr,  # uint8 dead flags, element [i, j] at i * dead_sb + j * dead_st (strides 0: one zero byte)
    starts_ptr,  # uint8 window starts (the token begins a new window), the same way
    seq_ptr,  # (n,) int64: the state row of each input row, read if HAS_SEQS (else row i is sequence i)
    lut_ptr,  # (vocab,) int64 compression map
    state_ptr,  # (B, F) int64 packed state (stream_state.StreamLayout), updated in place
    mult_ptr,  # (L, N_GRAM) int64
    primes_ptr,  # (L*(N_GRAM-1)*K,) int64
    offsets_ptr,  # same
    out_ptr,  # (n, T, L*(N_GRAM-1)*K) int64 or int32
    n,
    T,
    dead_sb,
    dead_st,
    starts_sb,
    starts_st,
    vocab,
    pad,
    restart_id,
    N_GRAM: tl.constexpr,
    N_LAYERS: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    C: tl.constexpr,
    F: tl.constexpr,
    HAS_SEQS: tl.constexpr,
    HAS_RESTART: tl.constexpr,
    DRAFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """T tokens of each of n sequences: committed (a step) or drafted after the pending drafts."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = lane < n
    if HAS_SEQS:
        sb = tl.load(seq_ptr + lane, mask=live, other=0)
    else:
        sb = lane
    row = state_ptr + sb * F  # (BLOCK,) each sequence's state row
    pos = tl.load(row + W, mask=live, other=0)
    nd = tl.load(row + (W + 1), mask=live, other=0)
    none = lane < 0  # all False

    # 1. check the whole call first: a sequence with a bad id (or drafts in the way) is left unchanged
    first_bad = tl.full([BLOCK], -1, tl.int64)
    bad_id = tl.zeros([BLOCK], tl.int64)
    for j in range(0, T):
        tok = tl.load(ids_ptr + lane * T + j, mask=live, other=0).to(tl.int64)
        bad = live & ((tok < 0) | (tok >= vocab)) & (first_bad < 0)
        first_bad = tl.where(bad, j, first_bad)
        bad_id = tl.where(bad, tok, bad_id)
    code = tl.where(first_bad >= 0, 1, 0).to(tl.int64)  # ERR_BAD_ID
    if DRAFT:
        code = tl.where((code == 0) & (nd + T > C), 3, code)  # ERR_DRAFT_FULL
        tok_pos = pos + nd + first_bad
    else:
        code = tl.where((code == 0) & (nd != 0), 2, code)  # ERR_DRAFTS_PENDING
        tok_pos = pos + first_bad
    code = tl.where(live, code, 0)
    ok = live & (code == 0)
    err = row + (W + 2 + 2 * C)
    record = (code != 0) & (tl.load(err, mask=live, other=1) == 0)  # keep a sequence's first error
    tl.store(err, code, mask=record)
    tl.store(err + 1, tl.where(code == 1, tok_pos, pos), mask=record)
    tl.store(err + 2, tl.where(code == 1, bad_id, nd), mask=record)
    tl.store(err + 3, tl.where(code == 1, first_bad, T), mask=record)

    # 2. the window the new tokens continue: the committed one, after the pending drafts
    col = tl.arange(0, W_P2)
    cmask = col < W
    win = tl.load(row[:, None] + col[None, :], mask=live[:, None] & cmask[None, :], other=pad)
    prev_end = none  # the token before is a restart id: this one starts a window
    if DRAFT:
        for d in range(0, C):
            act = ok & (d < nd)
            v = tl.load(row + (W + 2) + d, mask=act, other=pad)
            fl = tl.load(row + (W + 2 + C) + d, mask=act, other=0)
            ended = (fl & 4) != 0
            step = _advance(win, col, v, (fl & 2) != 0, ((fl & 1) != 0) | ended, pad, W)
            win = tl.where(act[:, None], step, win)
            prev_end = tl.where(act, ended, prev_end)

    # 3. hash the tokens one after another, each against the window the one before left
    for j in range(0, T):
        tok = tl.load(ids_ptr + lane * T + j, mask=live, other=0).to(tl.int64)
        x = tl.load(lut_ptr + tok, mask=ok & (tok >= 0) & (tok < vocab), other=pad)
        dead = tl.load(dead_ptr + lane * dead_sb + j * dead_st, mask=live, other=0) != 0
        dead = dead | ~ok  # a sequence left unchanged gets a dead token's rows (in range)
        start = tl.load(starts_ptr + lane * starts_sb + j * starts_st, mask=live, other=0) != 0
        start = start | prev_end
        if HAS_RESTART:
            end = tok == restart_id
        else:
            end = none
        prev_end = end
        x = tl.where(dead, pad, x)
        dst = out_ptr + (lane * T + j) * (N_LAYERS * (N_GRAM - 1) * K)
        _hash_token(
            x,
            dead | start,
            win,
            col,
            pad,
            mult_ptr,
            primes_ptr,
            offsets_ptr,
            dst,
            live,
            N_GRAM,
            N_LAYERS,
            K,
            K_P2,
        )
        if DRAFT:  # the host's draft arrays: value, and the dead / start / end flags
            flags = dead.to(tl.int64) | (start.to(tl.int64) << 1) | (end.to(tl.int64) << 2)
            tl.store(row + (W + 2) + nd + j, x, mask=ok)
            tl.store(row + (W + 2 + C) + nd + j, flags, mask=ok)
        win = tl.where(ok[:, None], _advance(win, col, x, start, dead | end, pad, W), win)

    # 4. commit: the drafts grow, or the window moves on (a step)
    if DRAFT:
        tl.store(row + (W + 1), nd + T, mask=ok)
    else:
        tl.store(row[:, None] + col[None, :], win, mask=ok[:, None] & cmask[None, :])
        tl.store(row + W, pos + T, mask=ok)


@triton.jit(do_not_specialize=["n_seq", "pad"])
def _commit_kernel(
    n_ptr,  # (B,) int64: drafted tokens to keep; -1 leaves the sequence as it is
    state_ptr,  # (B, F) int64 packed state, updated in place
    n_seq,
    pad,
    W: tl.constexpr,
    W_P2: tl.constexpr,
    C: tl.constexpr,
    F: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Keep the first n drafted tokens of each sequence (the window moves past them), forget the rest."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = lane < n_seq
    row = state_ptr + lane * F
    k = tl.load(n_ptr + lane, mask=live, other=-1)
    pos = tl.load(row + W, mask=live, other=0)
    nd = tl.load(row + (W + 1), mask=live, other=0)
    act = live & (k >= 0)
    bad = act & (k > nd)
    err = row + (W + 2 + 2 * C)
    record = bad & (tl.load(err, mask=live, other=1) == 0)
    tl.store(err, tl.full([BLOCK], 4, tl.int64), mask=record)  # ERR_COMMIT
    tl.store(err + 1, pos, mask=record)
    tl.store(err + 2, k, mask=record)
    tl.store(err + 3, nd, mask=record)
    ok = act & ~bad
    col = tl.arange(0, W_P2)
    cmask = col < W
    win = tl.load(row[:, None] + col[None, :], mask=live[:, None] & cmask[None, :], other=pad)
    for d in range(0, C):
        a = ok & (d < k)
        v = tl.load(row + (W + 2) + d, mask=a, other=pad)
        fl = tl.load(row + (W + 2 + C) + d, mask=a, other=0)
        step = _advance(win, col, v, (fl & 2) != 0, (fl & 5) != 0, pad, W)  # dead or end: cleared
        win = tl.where(a[:, None], step, win)
    tl.store(row[:, None] + col[None, :], win, mask=ok[:, None] & cmask[None, :])
    tl.store(row + W, pos + k, mask=ok)
    tl.store(row + (W + 1), tl.zeros([BLOCK], tl.int64), mask=ok)


def stream_hash(
    ids: torch.Tensor,
    dead: torch.Tensor | None,
    starts: torch.Tensor | None,
    seqs: torch.Tensor | None,
    state: torch.Tensor,
    layout: StreamLayout,
    lut: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad: int,
    restart_id: int | None,
    out: torch.Tensor,
    *,
    draft: bool = False,
) -> torch.Tensor:
    """Rows (n, T, L, orders*K) of raw ids (n, T) continuing the packed `state` (B, F), updated in place.

    Step (`draft=False`): the tokens are committed (the window moves on, the position grows). Draft:
    they are hashed after the pending drafts and appended to them. dead, starts: (n, T) bool or None;
    seqs: (n,) int64 state rows (distinct) or None for n == B; lut, multipliers, primes, offsets: the
    hasher's device tables (`NgramHasher.device_tables`); out: contiguous int64/int32 of that shape.
    Checks nothing and never syncs (the caller, `HashStream`, validates): a bad id, drafts in the
    way of a step, or a draft past `layout.max_draft` leaves that sequence unchanged, gives it a dead
    token's rows and is recorded in its error columns. 1-D ids (and masks) are one token a sequence.
    """
    n, t = (ids.shape[0], 1) if ids.dim() == 1 else ids.shape
    if n == 0 or t == 0:
        return out
    zero = _zero_byte(ids.device)  # an absent mask: strides 0 over one zero byte (no extra variant)
    _stream_kernel[(triton.cdiv(n, _STREAM_BLOCK),)](
        ids,
        zero if dead is None else dead.view(torch.uint8),
        zero if starts is None else starts.view(torch.uint8),
        ids if seqs is None else seqs,  # any pointer when unused
        lut,
        state,
        multipliers,
        primes,
        offsets,
        out,
        n,
        t,
        0 if dead is None else t,
        0 if dead is None else 1,
        0 if starts is None else t,
        0 if starts is None else 1,
        lut.shape[0],
        pad,
        -1 if restart_id is None else restart_id,
        **_stream_consts(layout, tuple(multipliers.shape), primes.shape[-1]),
        HAS_SEQS=seqs is not None,
        HAS_RESTART=restart_id is not None,
        DRAFT=draft,
    )
    return out


@functools.cache
def _stream_consts(layout: StreamLayout, mult_shape: tuple[int, int], k: int) -> dict[str, int]:
    """The decode kernel's shape constants (computed once per layout: the step is launch-bound)."""
    n_layers, n_gram = mult_shape
    w = layout.window
    return {
        "N_GRAM": n_gram,
        "N_LAYERS": n_layers,
        "K": k,
        "K_P2": triton.next_power_of_2(k),
        "W": w,
        "W_P2": triton.next_power_of_2(w),
        "C": layout.max_draft,
        "F": layout.columns,
        "BLOCK": _STREAM_BLOCK,
    }


_ZERO_BYTES: dict[torch.device, torch.Tensor] = {}


def _zero_byte(device: torch.device) -> torch.Tensor:
    """One zero byte on `device`, made on first use (before any graph capture: the warm-up run)."""
    z = _ZERO_BYTES.get(device)
    if z is None:
        z = _ZERO_BYTES[device] = torch.zeros(1, dtype=torch.uint8, device=device)
    return z


def stream_commit(n_accepted: torch.Tensor, state: torch.Tensor, layout: StreamLayout, pad: int) -> None:
    """Keep the first n_accepted[b] drafted tokens of each sequence b (-1: leave it as it is), in place.

    n_accepted (B,) int64 on the state's device. No checks, no sync: n_accepted[b] above the drafts
    pending leaves sequence b unchanged and is recorded in its error columns."""
    b = state.shape[0]
    w = layout.window
    _commit_kernel[(triton.cdiv(b, _STREAM_BLOCK),)](
        n_accepted,
        state,
        b,
        pad,
        W=w,
        W_P2=triton.next_power_of_2(w),
        C=layout.max_draft,
        F=layout.columns,
        BLOCK=_STREAM_BLOCK,
    )
