"""Row ids of a vLLM step: continuous batching, chunked prefill, prefix caching and preemption.

A vLLM step hands the model a flat batch: the new tokens of several requests side by side
(`query_start_loc` says where each request's run begins), each at its position in its request, each
with the KV-cache slot it is written to (`slot_mapping`), and per request the block table that maps
its positions to cache blocks. A position's rows need the `max_ngram_size - 1` tokens before it,
which for the first tokens of a run belong to earlier steps and are not in the batch.

`SlotTokens` keeps one token id per KV-cache slot (int32, -1 = never written), the scheme of vLLM's
own DeepSeek-V4.1 Engram: every step first writes its tokens at their slots, then reads each run's
look-back through its block-table row. That stays right wherever vLLM moves a request: a later
prefill chunk finds the earlier chunk's tokens in their slots; a prefix-cache hit reuses blocks
holding the same tokens at the same slots; a preempted request is prefilled again and rewrites its
slots; a speculative rollback rewrites the same slots. Writing first matters: the scheduler can
hand a request a cached block that another request of the same step is still filling.

The rows are then hashed in one call: every run preceded by its look-back ids, a window restart at
the head of each (so no run sees another's tokens), the look-back's own rows dropped. That is exact:
no position of a run looks back farther than its look-back. Raw tokenizer ids are kept (the
hasher compresses them and applies its restart-after-EOS rule, as for `engram.hf`). No vLLM import:
the inputs are plain tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from engram.addressing.hashing import NgramHasher

__all__ = ["SlotTokens"]

UNWRITTEN = -1


class SlotTokens:
    """The token id of every KV-cache slot, and the rows of a step's flat batch read through it."""

    def __init__(self, hasher: NgramHasher, block_size: int, num_slots: int = 0) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be an int >= 1 (vLLM's cache block size)")
        self.hasher, self.block_size = hasher, block_size
        self.lookback = hasher.config.max_ngram_size - 1
        self.ids = np.full(max(0, int(num_slots)), UNWRITTEN, dtype=np.int32)
        self.lookback_reads = 0  # look-back ids read from slots (a counter for tests and logs)

    def resize(self, num_slots: int) -> None:
        """Forget every slot and hold `num_slots` (the KV cache was (re)allocated)."""
        self.ids = np.full(int(num_slots), UNWRITTEN, dtype=np.int32)

    def rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        num_tokens: int,
    ) -> torch.Tensor:
        """Rows [len(input_ids), n_layers, rows_per_token] int64 (CPU) of a step's first `num_tokens`
        tokens (the rest, padding of the batch, get row 0 of each head: computed and discarded).

        input_ids / positions / slot_mapping: [>= num_tokens]; query_start_loc: [requests + 1];
        block_table: [requests, max_blocks]. Writes the step's ids to their slots first."""
        n = int(num_tokens)
        cfg = self.hasher.config
        out = torch.zeros((int(input_ids.shape[0]), cfg.n_layers, cfg.rows_per_token), dtype=torch.int64)
        if n == 0:
            return out
        ids = input_ids[:n].detach().cpu().numpy().astype(np.int64, copy=False)
        pos = positions[:n].detach().cpu().numpy().astype(np.int64, copy=False)
        slots = slot_mapping[:n].detach().cpu().numpy().astype(np.int64, copy=False)
        qsl = query_start_loc.detach().cpu().numpy().astype(np.int64, copy=False)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= cfg.vocab_size)][0])
            raise ValueError(
                f"token id {bad} is outside the Engram part's vocabulary [0, {cfg.vocab_size}): the model "
                "emitted or was given an id its tokenizer does not have"
            )
        need = int(slots.max()) + 1
        if need > self.ids.shape[0]:  # the cache was not sized (or grew): keep what is written
            grown = np.full(max(need, 2 * self.ids.shape[0]), UNWRITTEN, dtype=np.int32)
            grown[: self.ids.shape[0]] = self.ids
            self.ids = grown
        self.ids[slots] = ids  # write first (see the module docstring)

        begin, end = qsl[:-1], np.minimum(qsl[1:], n)
        live = end > begin
        begin, end = begin[live], end[live]
        reqs = np.flatnonzero(live)
        start = pos[begin]  # each run's first position in its request
        if np.any(pos[end - 1] - start != end - 1 - begin):
            raise ValueError("a request's positions in this step are not consecutive; the batch is malformed")
        k = np.minimum(start, self.lookback)  # look-back ids each run needs
        total = int(k.sum())
        if total:
            run = np.repeat(np.arange(reqs.shape[0]), k)  # the run of each look-back id
            back = np.repeat(start - k, k) + (np.arange(total) - np.repeat(np.cumsum(k) - k, k))
            bt = block_table.detach().cpu().numpy()
            bsz = self.block_size
            prev_slots = bt[reqs[run], back // bsz].astype(np.int64) * bsz + back % bsz
            if prev_slots.max() >= self.ids.shape[0]:
                raise ValueError("a block table points past the KV cache's slots; the batch is malformed")
            prev = self.ids[prev_slots].astype(np.int64)
            if prev.min() < 0:
                i = int(np.flatnonzero(prev < 0)[0])
                raise RuntimeError(
                    f"the token at position {int(back[i])} of a request was never written to its KV-cache "
                    "slot (KV computed elsewhere, e.g. loaded by a KV connector): Engram cannot read its "
                    "look-back; serve without KV transfer"
                )
            self.lookback_reads += total
        # one sequence: each run preceded by its look-back, a window restart at the head of each
        lens = k + (end - begin)
        heads = np.cumsum(lens) - lens
        seq = np.empty(int(lens.sum()), dtype=np.int64)
        own = np.ones(seq.shape[0], dtype=bool)  # positions of the runs themselves (not look-back)
        if total:
            at = np.repeat(heads, k) + (np.arange(total) - np.repeat(np.cumsum(k) - k, k))
            seq[at] = prev
            own[at] = False
        run_lens = end - begin
        where = np.arange(int(run_lens.sum())) + np.repeat(begin - (np.cumsum(run_lens) - run_lens), run_lens)
        seq[own] = ids[where]  # the runs' own tokens, in order (`where`: their places in the batch)
        starts = np.zeros(seq.shape[0], dtype=bool)
        starts[heads] = True
        rows = self.hasher.hash(seq[None], starts=starts[None])[0]
        out[torch.from_numpy(where)] = torch.from_numpy(np.ascontiguousarray(rows[own]))
        return out

    def dummy_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of a run without attention metadata (vLLM's profile / warm-up runs): the ids hashed as one
        sequence, nothing written."""
        ids = input_ids.detach().cpu().numpy().astype(np.int64, copy=False)
        ids = np.clip(ids, 0, self.hasher.config.vocab_size - 1)  # dummy ids: nothing is served from them
        return torch.from_numpy(self.hasher.hash(ids))
