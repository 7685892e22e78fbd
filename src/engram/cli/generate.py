"""`engram generate`: continue a prompt with a trained checkpoint, optionally with offloaded tables and
memory patches (`--patch`, `engram.apps.memory.files`).

The generation itself is `engram.apps.lm.generate` (`load_generator`, `generate`); the offload is
`engram.systems.offload_engram`. Only option checks, the run and the printing here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

import torch

from engram.apps.lm.generate import MIN_TEMPERATURE, check_options, generate, load_generator
from engram.apps.memory.files import PatchFile, apply_patches, read_patches
from engram.cli.options import (
    add_device_options,
    add_verify_option,
    device_from_args,
    human_bytes,
    input_file,
    input_folder,
    non_negative_int,
    output_folder,
    positive_int,
    seed,
    set_threads,
    threads,
    utf8_text,
    whole_number,
)
from engram.device import Precision
from engram.model.lm import EngramLM

__all__ = ["register"]

# One forward per new token: a million is days of work on a CPU, and its buffers still fit in memory.
MAX_NEW_TOKENS = 1_000_000


def register(sub: Any) -> None:
    """Add `generate --checkpoint DIR --prompt TEXT [--tokens N] ...` to the `engram` subparsers."""
    p = sub.add_parser(
        "generate", help="continue a prompt with a trained checkpoint (Engram rows hashed as tokens come)"
    )
    p.add_argument(
        "--checkpoint", type=input_folder, required=True, help="a run folder or a checkpoints/step-N folder"
    )
    p.add_argument("--prompt", type=utf8_text, required=True, help="text to continue")
    p.add_argument(
        "--tokens",
        type=whole_number(1, MAX_NEW_TOKENS),
        default=64,
        help=f"tokens to generate (default 64, at most {MAX_NEW_TOKENS:,})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help=f"sampling temperature, 0 (greedy) or at least {MIN_TEMPERATURE:g} (default 1)",
    )
    p.add_argument(
        "--top-k",
        type=positive_int,
        help="sample among the k likeliest tokens only, k at most the vocabulary size (default: all)",
    )
    p.add_argument("--seed", type=seed, default=0, help="sampling seed (default 0: runs repeat exactly)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences sampled from the same prompt")
    p.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    p.add_argument("--mask-engram", action="store_true", help="mask Engram's output (the ablation)")
    p.add_argument(
        "--offload",
        choices=["host", "ssd"],
        help="serve the Engram tables as FP8 from host memory or a memory-mapped file (engram.systems)",
    )
    p.add_argument(
        "--cache-rows",
        type=non_negative_int,
        default=0,
        help="with --offload: hot rows kept cached (default 0; at most the table's rows)",
    )
    p.add_argument(
        "--offload-dir",
        type=output_folder,
        help="with --offload ssd: folder for the table files (default: a temp folder)",
    )
    p.add_argument(
        "--patch",
        action="append",
        type=input_file,
        metavar="PATCH",
        help="a memory patch file for this checkpoint's Engram tables, applied before generating (and "
        "before --offload); repeat it for several, applied in the order given",
    )
    add_device_options(p, "generate")
    add_verify_option(p)
    p.add_argument("--threads", type=threads, help="torch threads (default: one per idle core)")
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text for the model to continue")
    check_options(args.tokens, args.temperature, args.top_k, args.batch)
    if not args.offload and (args.cache_rows or args.offload_dir):
        raise ValueError("--cache-rows and --offload-dir apply to offloaded tables: add --offload host|ssd")
    device, precision = device_from_args(args)
    set_threads(args)
    patches = read_patches(args.patch or ())  # checked before the model loads
    model, tok, hasher, state = load_generator(args.checkpoint, verify=args.verify, device=device)
    if args.mask_engram and not model.engrams:
        raise ValueError(f"{state['path']} has no Engram modules to mask; drop --mask-engram")
    if patches:
        if hasher is None:
            raise ValueError(
                f"{state['path']} has no Engram layers, so a memory patch has no rows to write; drop --patch"
            )
        # into the tables in memory, before --offload quantises and moves them (the patched rows with them)
        apply_patches(model, patches, hasher=hasher)
    with tempfile.TemporaryDirectory(prefix="engram-generate-") as tmp:  # --offload ssd's default folder
        tables = _offload(model, args, args.offload_dir or tmp) if args.offload else {}
        return _generate_and_print(args, model, tok, hasher, state, tables, precision, patches)


def _generate_and_print(
    args: argparse.Namespace,
    model: EngramLM,
    tok: Any,
    hasher: Any,
    state: dict[str, Any],
    tables: dict,
    precision: Precision,
    patches: list[PatchFile],
) -> int:
    prompt_ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not prompt_ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; give some text to continue")
    _check_memory(args, model, hasher, len(prompt_ids))
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
        precision=precision,
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
            "device": str(next(model.parameters()).device),
            "precision": precision.value,
            "seconds": out.seconds,
            "tokens_per_s": out.tokens_per_s,
            "offload": offload or None,
            "patches": [{"path": p.path, "name": p.patch.name} for p in patches],
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
        f"{state['path']} (step {state['step']}), engram {engram}, {how}"
        + "".join(f", patch {p.path}" for p in patches),
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


def _check_memory(args: argparse.Namespace, model: EngramLM, hasher: Any, n_prompt: int) -> None:
    """Refuse a --batch x --tokens whose buffers alone (token ids, Engram rows, one step's logits) pass
    the memory of the model's device (this machine's, or its GPU's), naming both, before anything is
    allocated."""
    c = model.config
    length = n_prompt + args.tokens
    rows = math.prod(hasher.output_shape(())) if hasher is not None else 0  # row ids a position
    per_sequence = 8 * length * (1 + rows) + 4 * min(length, c.max_seq_len) * c.vocab_size
    need = args.batch * per_sequence
    device = next(model.parameters()).device
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"
    if need > have:
        raise ValueError(
            f"--batch {args.batch} x --tokens {args.tokens}: the buffers alone need {human_bytes(need)}, "
            f"more than {where} {human_bytes(have)} of memory; ask for fewer sequences or tokens"
        )


def _offload(model: EngramLM, args: argparse.Namespace, folder: str) -> dict[int, Any]:
    """--offload host|ssd: the Engram tables quantised to FP8 + ue8m0 (V4.1's format, lossy for a table
    trained in float) and served by `engram.systems.TieredTable` from DRAM or a memory-mapped file in
    `folder`, with `--cache-rows` hot rows kept beside the model."""
    from engram.systems import offload_engram

    if not model.engrams:
        raise ValueError("--offload moves Engram tables, but this checkpoint has none; drop --offload")
    largest = max(m.table.num_rows for m in model.engrams.values())
    if args.cache_rows > largest:  # a cache past the table holds nothing more, and is allocated whole
        raise ValueError(
            f"--cache-rows {args.cache_rows}: more rows than the largest Engram table holds ({largest:,}); "
            "give at most that"
        )
    device = next(model.parameters()).device
    ssd_dir = folder if args.offload == "ssd" else None
    return offload_engram(
        model, args.offload, cache_rows=args.cache_rows, device=device, quantize=True, ssd_dir=ssd_dir
    )
