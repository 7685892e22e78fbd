"""Text generation from a trained checkpoint, with decode-time Engram hashing (`engram generate`).

Holds:
- `Generation`: what `generate` returns: the token ids (B, T0 + N), prompt first; the Engram rows
  of every position (B, T0 + N, n_engram_layers, heads) as the stream produced them; the timing.
- `generate(model, prompt_ids, hasher, ...)`: the prompt is hashed once through `HashStream.feed`,
  then every new token through one `HashStream.step`. The model has no KV cache: each step runs
  the forward on the last `max_seq_len` tokens with their rows and samples the next token from the
  last position's logits (temperature, top-k, a seeded `torch.Generator`; or greedily).
- `load_generator(checkpoint)`: the model, tokenizer and hasher a training run used.
- `add_generate_command(sub)`, `cmd_generate(args)`: the `engram generate` command.

A position's rows depend only on the token ids up to it, so they are hashed once, when its token
is known, and never change as the window slides: a step hashes one token, however long the text.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram.addressing.hashing import NgramHasher, check_token_ids
from engram.addressing.stream import HashStream
from engram.model.lm import EngramLM

__all__ = [
    "Generation",
    "add_generate_command",
    "check_options",
    "cmd_generate",
    "generate",
    "load_generator",
]


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
        or temperature < 0
    ):
        raise ValueError(
            f"temperature={temperature!r} must be a finite number >= 0 (--temperature T; 0 or --greedy: "
            "always the likeliest token)"
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
    if top_k is not None and top_k < logits.shape[-1]:
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
) -> Generation:
    """Continue `prompt_ids` (1-D tokenizer ids) by `max_new_tokens` tokens in `batch_size` sequences.

    `hasher` is required when the model has Engram layers (and ignored when it has none). Greedy
    when `greedy` or `temperature == 0`; else sampling with a `torch.Generator` seeded by `seed`,
    on the model's device (the same seed gives the same tokens). `engram_scale=0` masks Engram's
    output (the paper's ablation). A prompt longer than `max_seq_len` is hashed whole; the forward
    sees its last `max_seq_len` tokens.
    """
    check_options(max_new_tokens, temperature, top_k, batch_size)
    c = model.config
    ids = np.asarray(prompt_ids.detach().cpu() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    ids = check_token_ids(ids, c.vocab_size)  # raises naming the bad id and its position
    if model.engrams:
        if hasher is None:
            raise ValueError("this model has Engram layers: pass the NgramHasher it was trained with")
        if tuple(hasher.config.layer_ids) != tuple(c.engram.layer_ids):
            raise ValueError(
                f"the hasher is for Engram layers {hasher.config.layer_ids} but the model has "
                f"{c.engram.layer_ids}; build it from model.config.engram"
            )
    elif engram_scale != 1.0:
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
    if model.engrams:
        stream = HashStream(hasher, b)
        rows = torch.empty((b, t0 + n, *hasher.output_shape(())), dtype=torch.int64, device=device)
        prefill = stream.feed(np.ascontiguousarray(np.broadcast_to(ids, (b, t0))))  # (B, T0, L, H)
        rows[:, :t0] = torch.from_numpy(prefill).to(device)
    for t in range(t0, t0 + n):
        lo = max(0, t - s)  # sliding window: the model has no cache and sees max_seq_len tokens
        window_rows = None if rows is None else rows[:, lo:t]
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


def load_generator(checkpoint: str | Path) -> tuple[EngramLM, Any, NgramHasher | None, dict[str, Any]]:
    """(model in eval mode, tokenizer, hasher or None, state.json) of a run folder or checkpoint folder.

    The tokenizer is the one the checkpoint saved (the run's own); a checkpoint without one gets it
    rebuilt by `prepare_data` from the run's config. The hasher is built from the model's Engram config
    and the tokenizer's compression map, as training built it.
    """
    from tokenizers import Tokenizer

    from engram.addressing.compression import TokenizerCompression
    from engram.apps.train import load_trained_model, prepare_data

    if not Path(checkpoint).exists():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: no such folder; give a run folder (`engram train --out DIR`) "
            "or one of its checkpoints/step-N folders"
        )
    cfg, model, state = load_trained_model(checkpoint)
    tok_file = Path(state["path"]) / "tokenizer.json"
    if tok_file.is_file():
        tok = Tokenizer.from_file(str(tok_file))
    else:
        tok = prepare_data(cfg, with_engram=False).tokenizer
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab != model.config.vocab_size:
        raise ValueError(
            f"{state['path']}: the tokenizer has {vocab} ids but the model {model.config.vocab_size}; "
            "the checkpoint's tokenizer.json is not the run's"
        )
    hasher = None
    if model.engrams:
        hasher = NgramHasher(model.config.engram, TokenizerCompression.from_tokenizer(tok))
    return model.eval(), tok, hasher, state


def cmd_generate(args: argparse.Namespace) -> int:
    """Handler of `engram generate`."""
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text for the model to continue")
    check_options(args.tokens, args.temperature, args.top_k, args.batch)
    if not args.offload and (args.cache_rows or args.offload_dir):
        raise ValueError("--cache-rows and --offload-dir apply to offloaded tables: add --offload host|ssd")
    if args.cache_rows < 0:
        raise ValueError(f"--cache-rows {args.cache_rows} must be >= 0 (0: no cache)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, hasher, state = load_generator(args.checkpoint)
    if args.mask_engram and not model.engrams:
        raise ValueError(f"{state['path']} has no Engram modules to mask; drop --mask-engram")
    with tempfile.TemporaryDirectory(prefix="engram-generate-") as tmp:  # --offload ssd's default folder
        tables = _offload(model, args, args.offload_dir or tmp) if args.offload else {}
        return _generate_and_print(args, model, tok, hasher, state, tables)


def _generate_and_print(
    args: argparse.Namespace, model: EngramLM, tok: Any, hasher: Any, state: dict[str, Any], tables: dict
) -> int:
    prompt_ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not prompt_ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; give some text to continue")
    greedy = args.greedy or args.temperature == 0
    out = generate(
        model,
        prompt_ids,
        hasher,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        greedy=greedy,
        batch_size=args.batch,
        seed=args.seed,
        engram_scale=0.0 if args.mask_engram else 1.0,
    )
    new = out.new_ids.cpu().tolist()
    texts = [tok.decode(seq, skip_special_tokens=False) for seq in new]
    engram = "none" if not model.engrams else "masked" if args.mask_engram else "on"
    offload = {str(lid): t.stats() for lid, t in tables.items()}  # per layer: cache and fetch counters
    if args.json:
        result = {
            "checkpoint": state["path"],
            "step": state["step"],
            "prompt": args.prompt,
            "prompt_ids": list(prompt_ids),
            "text": texts,  # one continuation per --batch sequence
            "token_ids": new,
            "tokens": args.tokens,
            "batch": args.batch,
            "engram": engram,
            "greedy": greedy,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "seed": args.seed,
            "seconds": out.seconds,
            "tokens_per_s": out.tokens_per_s,
            "offload": offload or None,
        }
        print(json.dumps(result, ensure_ascii=False))
        return 0
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sequence {i}")
        print(args.prompt + text)
    how = "greedy" if greedy else f"temperature {args.temperature:g}, top-k {args.top_k}, seed {args.seed}"
    print(
        f"--- {args.tokens} tokens x {args.batch} sequence(s) in {out.seconds:.2f} s ({out.tokens_per_s:.1f} tokens/s); "
        f"{state['path']} (step {state['step']}), engram {engram}, {how}",
        file=sys.stderr,
    )
    for lid, st in offload.items():
        print(
            f"--- layer {lid} table on {st['placement']}: {st['rows_requested']:,} rows asked, "
            f"{st['rows_distinct']:,} distinct within their gathers, {st['bytes_fetched']:,} bytes fetched"
            + (f", cache hit rate {st['cache_hit_rate']:.1%}" if "cache_hit_rate" in st else ""),
            file=sys.stderr,
        )
    return 0


def _offload(model: EngramLM, args: argparse.Namespace, folder: str) -> dict[int, Any]:
    """--offload host|ssd: the Engram tables quantised to FP8 + ue8m0 (V4.1's format, lossy for a table
    trained in float) and served by `engram.systems.TieredTable` from DRAM or a memory-mapped file in
    `folder`, with `--cache-rows` hot rows kept beside the model."""
    from engram.systems import offload_engram

    if not model.engrams:
        raise ValueError("--offload moves Engram tables, but this checkpoint has none; drop --offload")
    device = next(model.parameters()).device
    ssd_dir = folder if args.offload == "ssd" else None
    return offload_engram(
        model, args.offload, cache_rows=args.cache_rows, device=device, quantize=True, ssd_dir=ssd_dir
    )


def add_generate_command(sub: Any) -> argparse.ArgumentParser:
    """Add `generate --checkpoint DIR --prompt TEXT [--tokens N] ...` to engram's CLI."""
    p = sub.add_parser(
        "generate", help="continue a prompt with a trained checkpoint (Engram rows hashed as tokens come)"
    )
    p.add_argument("--checkpoint", required=True, help="a run folder or a checkpoints/step-N folder")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: runs repeat exactly)")
    p.add_argument("--batch", type=int, default=1, help="sequences sampled from the same prompt")
    p.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    p.add_argument("--mask-engram", action="store_true", help="mask Engram's output (the ablation)")
    p.add_argument(
        "--offload",
        choices=["host", "ssd"],
        help="serve the Engram tables as FP8 from host memory or a memory-mapped file (engram.systems)",
    )
    p.add_argument(
        "--cache-rows", type=int, default=0, help="with --offload: hot rows kept cached (default 0)"
    )
    p.add_argument(
        "--offload-dir", help="with --offload ssd: folder for the table files (default: a temp folder)"
    )
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_generate)
    return p
