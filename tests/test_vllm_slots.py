"""engram.vllm.slots: the rows of vLLM-shaped flat batches (continuous batching over a paged KV cache)
equal the rows of each request hashed whole, whatever the scheduler does. The scheduler here is a
small simulation written for the test: random block allocation, chunked prefill, decodes of several
requests in one step, prefix-cache hits on another request's blocks (filled in the same step),
preemption with recompute, and padded batches. vLLM itself is not needed (tests/test_vllm_serve.py
runs the real thing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import EngramConfig, NgramHasher
from engram.addressing.compression import TokenizerCompression
from engram.vllm.slots import SlotTokens

VOCAB = 97
BLOCK = 4


def hasher(restart: int | None = None) -> NgramHasher:
    cfg = EngramConfig(
        name="slots",
        layer_ids=(0, 1),
        max_ngram_size=4,
        n_heads=2,
        engram_vocab_size=(101, 103, 107),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=8,
        hidden_size=16,
        hc_mult=1,
        restart_after_id=restart,
    )
    return NgramHasher(cfg, TokenizerCompression.identity(VOCAB))


class Sim:
    """A paged KV cache and a scheduler: requests get blocks, run chunks, and are checked against whole
    sequences hashed at once."""

    def __init__(self, h: NgramHasher, rng: np.random.Generator, num_blocks: int = 64) -> None:
        self.h, self.rng = h, rng
        self.free = list(rng.permutation(num_blocks))
        self.slots = SlotTokens(h, BLOCK, num_blocks * BLOCK)
        self.blocks: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}  # tokens computed

    def alloc(self, r: int, upto: int) -> None:
        need = -(-upto // BLOCK) - len(self.blocks.setdefault(r, []))
        for _ in range(max(0, need)):
            self.blocks[r].append(int(self.free.pop()))

    def step(self, runs: list[tuple[int, np.ndarray, int]], pad: int = 0) -> None:
        """runs: (request, its whole token list, tokens to compute now); checks the rows."""
        ids, pos, slots, qsl = [], [], [], [0]
        for r, _, n in runs:
            self.alloc(r, self.done.get(r, 0) + n)
        width = max(len(b) for b in self.blocks.values()) + 4
        bt = np.zeros((len(runs), width), dtype=np.int32)
        for i, (r, seq, n) in enumerate(runs):
            s = self.done.get(r, 0)
            bt[i, : len(self.blocks[r])] = self.blocks[r]
            p = np.arange(s, s + n)
            ids.append(seq[s : s + n])
            pos.append(p)
            slots.append(np.asarray(self.blocks[r])[p // BLOCK] * BLOCK + p % BLOCK)
            qsl.append(qsl[-1] + n)
        t = qsl[-1]

        def cat(xs: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([*xs, np.zeros(pad, dtype=np.int64)]).astype(np.int64))

        rows = self.slots.rows(
            cat(ids), cat(pos), torch.tensor(qsl), cat(slots), torch.from_numpy(bt), t
        ).numpy()
        assert rows.shape[0] == t + pad
        for i, (r, seq, n) in enumerate(runs):
            s = self.done.get(r, 0)
            want = self.h.hash(np.asarray(seq, dtype=np.int64))[s : s + n]
            np.testing.assert_array_equal(rows[qsl[i] : qsl[i + 1]], want, err_msg=f"request {r} at {s}")
            self.done[r] = s + n

    def release(self, r: int) -> None:
        self.free.extend(self.blocks.pop(r))
        self.done.pop(r, None)


def test_chunked_prefill_and_batched_decodes():
    rng = np.random.default_rng(0)
    sim = Sim(hasher(), rng)
    seqs = {r: rng.integers(1, VOCAB, size=40) for r in range(3)}
    sim.step([(0, seqs[0], 7), (1, seqs[1], 1)])  # a chunk; a one-token prompt
    sim.step([(0, seqs[0], 2), (1, seqs[1], 5), (2, seqs[2], 3)])  # chunks starting past 0
    for _ in range(10):  # decodes of all three in one step
        sim.step([(r, seqs[r], 1) for r in range(3)])
    sim.step([(2, seqs[2], 9), (0, seqs[0], 1)], pad=5)  # padded batch (CUDA-graph style)
    assert sim.slots.lookback_reads > 0


def test_prefix_cache_hit_on_blocks_filled_in_the_same_step():
    """Request 1 shares request 0's first two blocks (same tokens) and is scheduled in the same step
    as the one that fills them: the writes must come first."""
    rng = np.random.default_rng(1)
    sim = Sim(hasher(), rng)
    shared = rng.integers(1, VOCAB, size=2 * BLOCK)
    a = np.concatenate([shared, rng.integers(1, VOCAB, size=9)])
    b = np.concatenate([shared, rng.integers(1, VOCAB, size=6)])
    sim.alloc(0, len(a))
    sim.blocks[1] = list(sim.blocks[0][:2])  # the hit: b's first blocks are a's
    sim.done[1] = 2 * BLOCK  # computed (cached) tokens
    sim.step([(0, a, len(a)), (1, b, 3)])  # b's run reads look-back from slots a writes now
    sim.step([(1, b, 3)])
    assert sim.slots.lookback_reads >= 3


def test_preemption_recomputes_into_new_blocks():
    rng = np.random.default_rng(2)
    sim = Sim(hasher(), rng)
    seq = rng.integers(1, VOCAB, size=30)
    sim.step([(0, seq, 10)])
    sim.step([(0, seq, 1)])
    sim.release(0)  # preempted: its blocks go to another request, which overwrites them
    other = rng.integers(1, VOCAB, size=20)
    sim.step([(1, other, 20)])
    sim.step([(0, seq, 11)])  # recomputed from 0
    sim.step([(0, seq, 1)])


def test_restart_after_eos_inside_the_lookback():
    rng = np.random.default_rng(3)
    h = hasher(restart=5)
    sim = Sim(h, rng)
    seq = rng.integers(6, VOCAB, size=24)
    seq[[4, 9, 10, 15]] = 5  # EOS ids: windows restart after each, also across chunk borders
    for n in (3, 2, 5, 1, 1, 4, 8):
        sim.step([(0, seq, n)])


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6))
def test_random_schedules(seed, n_req):
    """Random interleavings of chunks and decodes over random block allocations."""
    rng = np.random.default_rng(seed)
    sim = Sim(hasher(), rng, num_blocks=128)
    seqs = {r: rng.integers(1, VOCAB, size=int(rng.integers(1, 30))) for r in range(n_req)}
    while True:
        todo = [r for r in seqs if sim.done.get(r, 0) < len(seqs[r])]
        if not todo:
            break
        pick = [r for r in todo if rng.random() < 0.7] or todo[:1]
        runs = []
        for r in pick:
            left = len(seqs[r]) - sim.done.get(r, 0)
            runs.append((r, seqs[r], int(rng.integers(1, left + 1))))
        sim.step(runs, pad=int(rng.integers(0, 3)))


def test_unwritten_lookback_is_refused():
    h = hasher()
    slots = SlotTokens(h, BLOCK, 16)
    with pytest.raises(RuntimeError, match="never written"):
        # a run starting at position 5 whose earlier tokens were never written (KV from elsewhere)
        slots.rows(
            torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([0, 2]), torch.tensor([5, 6]),
            torch.tensor([[0, 1, 2]]), 2,
        )  # fmt: skip


def test_out_of_vocabulary_id_is_refused():
    slots = SlotTokens(hasher(), BLOCK, 16)
    with pytest.raises(ValueError, match=f"outside the Engram part's vocabulary \\[0, {VOCAB}\\)"):
        slots.rows(torch.tensor([VOCAB]), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]),
                   torch.tensor([[0]]), 1)  # fmt: skip
    with pytest.raises(ValueError, match="block_size"):
        SlotTokens(hasher(), 0)
