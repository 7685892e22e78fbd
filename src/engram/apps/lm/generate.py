"""Text generation from a trained checkpoint, with decode-time Engram hashing (`engram generate` is
`engram.cli`'s). The prompt is hashed once, then one `HashStream.step` per new token; no KV cache.
The run's model and tokenizer come through `engram.apps.lm.train`. Design: docs/training.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram.addressing.hashing import NgramHasher, check_token_ids
from engram.addressing.stream import HashStream
from engram.device import Precision, autocast
from engram.model.lm import EngramLM

__all__ = [
    "MIN_TEMPERATURE",
    "Generation",
    "check_options",
    "generate",
    "load_generator",
]


# The smallest sampling temperature taken (0 aside: greedy). Below it sampling is greedy in all but name
# (a logit gap of 0.1 is a factor exp(100)), and logits / temperature overflow float32 long before 1e-38.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class Generation:
    token_ids: torch.Tensor  # (B, T0 + N): the prompt, then the generated tokens
    rows: torch.Tensor | None  # (B, T0 + N, n_engram_layers, heads) from the stream; None without Engram
    prompt_length: int  # T0
    seconds: float  # prefill and decode, model loading excluded

    @property
    def new_ids(self) -> torch.Tensor:
        """(B, N) the generated tokens."""
        return self.token_ids[:, self.prompt_length :]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole batch."""
        return self.new_ids.numel() / max(self.seconds, 1e-9)


def check_options(tokens: int, temperature: float, top_k: int | None, batch_size: int) -> None:
    """Raise ValueError naming a bad generation option and its fix (before any checkpoint is loaded)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r}: generate at least 1 token (--tokens N, N >= 1)")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or not (temperature == 0 or temperature >= MIN_TEMPERATURE)
    ):
        raise ValueError(
            f"temperature={temperature!r} must be 0 or a finite number >= {MIN_TEMPERATURE:g} (--temperature "
            "T; 0 or --greedy: always the likeliest token, which a smaller T amounts to)"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(
            f"top_k={top_k!r} must be an int >= 1 (--top-k K; leave it out to sample from the whole vocabulary)"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be >= 1 sequences (--batch B)")


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None) -> Any:
    """Next token (B,) from the last position's logits (B, V); greedy when `gen` is None."""
    if gen is None:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:  # top_k == V: the whole vocabulary
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)


@torch.no_grad()
def generate(
    model: EngramLM,
    prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
    hasher: NgramHasher | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    greedy: bool = False,
    batch_size: int = 1,
    seed: int = 0,
    engram_scale: float = 1.0,
    precision: Precision = Precision.FLOAT32,
) -> Generation:
    """Continue `prompt_ids` (1-D tokenizer ids) by `max_new_tokens` tokens in `batch_size` sequences.

    `hasher` is required when the model has Engram layers (and ignored when it has none). Greedy
    when `greedy` or `temperature == 0`; else sampling with a `torch.Generator` seeded by `seed`,
    on the model's device (the same seed gives the same tokens). `engram_scale=0` masks Engram's
    output (the paper's ablation). A prompt longer than `max_seq_len` is hashed whole; the forward
    sees its last `max_seq_len` tokens. Runs on the model's device; `precision` bf16: the forwards
    under autocast.
    """
    check_options(max_new_tokens, temperature, top_k, batch_size)
    c = model.config
    ids = np.asarray(prompt_ids.detach().cpu() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    ids = check_token_ids(ids, c.vocab_size)  # raises naming the bad id and its position
    if top_k is not None and top_k > c.vocab_size:
        raise ValueError(
            f"top_k={top_k} is more than the model's vocabulary of {c.vocab_size} tokens: give at most "
            f"{c.vocab_size} (--top-k K; leave it out to sample from the whole vocabulary)"
        )
    if model.needs_rows:
        if hasher is None:
            raise ValueError(
                "this model reads hashed rows (Engram layers or an n-gram input embedding): pass the "
                "NgramHasher it was trained with"
            )
        if tuple(hasher.config.layer_ids) != tuple(c.engram.layer_ids):
            raise ValueError(
                f"the hasher is for Engram layers {hasher.config.layer_ids} but the model has "
                f"{c.engram.layer_ids}; build it from model.config.engram"
            )
    if not model.engrams and engram_scale != 1.0:
        raise ValueError(
            f"engram_scale={engram_scale} asks to mask Engram, but this model has no Engram layers"
        )
    b, t0, n, s = batch_size, ids.size, max_new_tokens, c.max_seq_len
    device = next(model.parameters()).device
    greedy = greedy or temperature == 0
    gen = None if greedy else torch.Generator(device=device).manual_seed(seed)

    start = time.perf_counter()
    # the whole text stays in preallocated buffers; the forward reads a window of them
    tokens = torch.empty((b, t0 + n), dtype=torch.int64, device=device)  # (B, T0 + N)
    tokens[:, :t0] = torch.from_numpy(ids).to(device)
    stream = rows = None
    if model.needs_rows:
        stream = HashStream(hasher, b)
        rows = torch.empty((b, t0 + n, *hasher.output_shape(())), dtype=torch.int64, device=device)
        prefill = stream.feed(np.ascontiguousarray(np.broadcast_to(ids, (b, t0))))  # (B, T0, L, H)
        rows[:, :t0] = torch.from_numpy(prefill).to(device)
    for t in range(t0, t0 + n):
        lo = max(0, t - s)  # sliding window: the model has no cache and sees max_seq_len tokens
        window_rows = None if rows is None else rows[:, lo:t]
        with autocast(device, precision):
            logits = model(tokens[:, lo:t], window_rows, engram_scale=engram_scale)  # (B, t - lo, V)
        nxt = _sample(logits[:, -1], temperature, top_k, gen)  # (B,)
        tokens[:, t] = nxt
        if stream is not None:
            # the new position's rows (B, L, H): one token hashed against the carried look-back;
            # sampled ids are in range by construction (check_ids=False spares a device sync)
            rows[:, t] = stream.step(nxt, check_ids=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync point: the time must include the queued work
    return Generation(tokens, rows, t0, time.perf_counter() - start)


def load_generator(
    checkpoint: str | Path, *, verify: bool = False, device: torch.device | None = None
) -> tuple[EngramLM, Any, NgramHasher | None, dict[str, Any]]:
    """(model in eval mode on `device`, default the CPU, tokenizer, hasher or None, state.json) of a run
    folder or checkpoint folder, checked as `load_trained_model(checkpoint, verify=verify)` checks it.

    The tokenizer is the one the checkpoint saved (the run's own); a checkpoint without one gets it
    rebuilt by `prepare_data` from the run's config. The hasher is built from the model's Engram config
    and the tokenizer's compression map, as training built it.
    """
    from engram.addressing.compression import TokenizerCompression
    from engram.apps.lm.rows import identity_compression
    from engram.apps.lm.train import checkpoint_tokenizer, load_trained_model, prepare_data

    if not Path(checkpoint).exists():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: no such folder; give a run folder (`engram train --out DIR`) "
            "or one of its checkpoints/step-N folders"
        )
    cfg, model, state = load_trained_model(checkpoint, verify=verify, device=device)
    tok = checkpoint_tokenizer(state["path"], model.config.vocab_size)  # checked as resume checks it
    if tok is None:
        tok = prepare_data(cfg, with_engram=False).tokenizer
    if cfg.row_hash != "ngram":
        raise ValueError(
            f"{state['path']}: this run was trained with row_hash={cfg.row_hash.value!r} (a study's "
            "control whose rows are not the n-gram hash); generation serves n-gram-hashed models only"
        )
    hasher = None
    if model.needs_rows:
        comp = TokenizerCompression.from_tokenizer(tok) if cfg.compression else identity_compression(tok)
        hasher = NgramHasher(model.config.engram, comp)
    return model.eval(), tok, hasher, state
