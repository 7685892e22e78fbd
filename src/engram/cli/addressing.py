"""`engram layout`, `compress`, `hash`, `collisions`: the addressing layer seen from the command line.

Each command prints a readable view by default and one JSON object with `--json`; the work is
done by `engram.addressing` (the layout, the compression map, the hasher, the collision analysis).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import numpy as np

from engram.cli.options import (
    add_config_options,
    add_text_options,
    config_from_args,
    hasher_for,
    human,
    human_bytes,
    output_file,
    positive_int,
    text_from_args,
    tokenizer_source,
    utf8_text,
)

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add layout, compress, hash and collisions to the `engram` subparsers."""
    p = sub.add_parser("layout", help="primes, offsets, multipliers and sizes of a config's hash layout")
    add_config_options(p, tokenizer=False)
    p.set_defaults(func=cmd_layout, tokenizer=None)

    p = sub.add_parser("compress", help="build a tokenizer's compression map and show what merged")
    p.add_argument(
        "--tokenizer",
        type=tokenizer_source,
        default="deepseek-v4",
        help="'deepseek-v4' or a tokenizer.json path",
    )
    p.add_argument("--top", type=positive_int, default=10, help="how many of the largest groups to show")
    p.add_argument(
        "--save",
        type=output_file,
        help="write the map (safetensors, with the tokenizer's fingerprint) to this path",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object for machines")
    p.set_defaults(func=cmd_compress)

    p = sub.add_parser("hash", help="the table rows of every token of a text, per layer and order")
    add_config_options(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", type=utf8_text, help="text to tokenize and hash")
    g.add_argument("--ids", help="token ids, space or comma separated")
    p.add_argument("--all-heads", action="store_true", help="show all heads of each order, not only head 0")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser("collisions", help="n-gram, mix and row collision statistics over a real text")
    add_config_options(p)
    add_text_options(p, "analyse")
    p.add_argument("--strict", action="store_true", help="exit 1 if the CRT property is violated")
    p.set_defaults(func=cmd_collisions)


# ---------------------------------------------------------------------------- layout
def cmd_layout(args: argparse.Namespace) -> int:
    from engram.addressing.layout import Layout

    t0 = time.perf_counter()
    layout = Layout(config_from_args(args))
    elapsed = time.perf_counter() - t0
    d = layout.to_dict()
    if args.json:
        print(json.dumps(d))
        return 0
    c = layout.config
    print(f"Engram layout: {c.name} ({c.variant.value})  [primes found in {elapsed * 1000:.0f} ms]")
    print(
        f"  orders {c.orders[0]}..{c.orders[-1]}, {c.n_heads} heads per order, {c.rows_per_token} rows/token/layer, "
        f"rows {c.head_dim} wide; compressed vocab {c.compressed_vocab_size}, pad id {c.pad_token_id}"
    )
    for layer in d["layers"]:
        print(
            f"\n  layer {layer['layer_id']}: {layer['num_embeddings']:,} rows"
            + (
                f" (table padded to {layer['table_rows']:,})"
                if layer["table_rows"] != layer["num_embeddings"]
                else ""
            )
            + f", {human(layer['params'])} params"
        )
        print(f"    multipliers {layer['multipliers']}")
        for order, primes in zip(c.orders, layer["primes"], strict=True):
            print(f"    {order}-gram primes {primes[0]:,} .. {primes[-1]:,}: {', '.join(map(str, primes))}")
    b = d["bytes"]
    print(f"\n  total: {d['total_rows']:,} rows = {d['total_params']:,} params ({human(d['total_params'])})")
    print(
        f"  storage: FP8+ue8m0 {human_bytes(b['fp8_ue8m0_total'])} ({b['fp8_ue8m0_row']} B/row), "
        f"bf16 {human_bytes(b['bf16_total'])}, fp32 {human_bytes(b['fp32_total'])}"
    )
    print(
        f"  read per token: {human_bytes(b['fp8_ue8m0_per_token_per_layer'])} per layer, "
        f"{human_bytes(b['fp8_ue8m0_per_token'])} over {c.n_layers} layers"
    )
    return 0


# ---------------------------------------------------------------------------- compress
def cmd_compress(args: argparse.Namespace) -> int:
    from engram.addressing.compression import TokenizerCompression, resolve_tokenizer

    tok = resolve_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    comp = TokenizerCompression.from_tokenizer(tok)
    elapsed = time.perf_counter() - t0
    if args.save:
        comp.save(args.save)
    groups = comp.top_groups(args.top, tok)
    if args.json:
        print(json.dumps({**comp.summary(), "seconds": elapsed, "top_groups": groups, "saved": args.save}))
        return 0
    s = comp.summary()
    print(
        f"tokenizer {args.tokenizer}: {s['vocab_size']:,} ids -> {s['compressed_vocab_size']:,} compressed ids "
        f"({s['reduction']:.1%} fewer; {s['merged_away']:,} merged away) in {elapsed:.2f} s"
    )
    print(f"fingerprint {s['fingerprint']}")
    if args.save:
        print(f"saved to {args.save}")
    print(f"\nlargest groups (of {args.top}):")
    for g in groups:
        members = ", ".join(repr(m) for m in g["members"])
        more = " ..." if g["count"] > len(g["members"]) else ""
        print(f"  {g['compressed_id']:>6}  {g['count']:>4} ids  key {g['key']!r:<8} <- {members}{more}")
    return 0


# ---------------------------------------------------------------------------- hash
def cmd_hash(args: argparse.Namespace) -> int:
    values = None if args.ids is None else _id_values(args.ids)  # refused before the hasher is built
    config = config_from_args(args)
    hasher, tok = hasher_for(config)
    if values is not None:
        ids = _int64_ids(values, tok.get_vocab_size(with_added_tokens=True))
    else:
        ids = np.array(tok.encode(args.text, add_special_tokens=False).ids, dtype=np.int64)
    rows = hasher.hash(ids)  # (T, n_layers, heads)
    pieces = [tok.decode([int(i)], skip_special_tokens=False) for i in ids]
    xc = hasher.compression.lookup[ids]
    k = config.n_heads
    if args.json:
        out = {
            "preset": config.name,
            "token_ids": ids.tolist(),
            "tokens": pieces,
            "compressed_ids": xc.tolist(),
            "columns": [f"{n}-gram/head{h}" for n in config.orders for h in range(k)],
            "rows": {str(lid): rows[:, li].tolist() for li, lid in enumerate(config.layer_ids)},
        }
        print(json.dumps(out, ensure_ascii=False))
        return 0
    shown = k if args.all_heads else 1
    print(
        f"{len(ids)} tokens, {config.name}: rows per token per layer = {config.rows_per_token} "
        f"({'all heads' if args.all_heads else 'head 0 of each order shown; --all-heads for all'})"
    )
    for li, lid in enumerate(config.layer_ids):
        print(f"\nlayer {lid} (table of {hasher.layout.layer(lid).num_embeddings:,} rows)")
        header = f"{'pos':>4} {'token':<16} {'cid':>6}"
        for n in config.orders:
            header += f"  {f'{n}-gram':<24} {'rows' if shown > 1 else 'row':>{10 * shown}}"
        print(header)
        for t in range(len(ids)):
            line = f"{t:>4} {pieces[t]!r:<16} {int(xc[t]):>6}"
            for oi, n in enumerate(config.orders):
                gram = "|".join(pieces[t - i] if t - i >= 0 else "<pad>" for i in range(n - 1, -1, -1))
                vals = rows[t, li, oi * k : oi * k + shown]
                line += f"  {gram[:24]:<24} " + " ".join(f"{int(v):>9}" for v in vals)
            print(line)
    return 0


def _id_values(text: str) -> list[int]:
    """--ids '1 2,3' -> [1, 2, 3]: ids separated by spaces or by one comma each. An empty id (',,', a
    leading or trailing comma, nothing at all) or a word that is not an int is refused by position."""
    if not text.strip():
        raise ValueError("--ids is empty: give token ids separated by spaces or commas, e.g. --ids '1,2,3'")
    values = []
    for i, word in enumerate(re.split(r"\s*,\s*|\s+", text.strip())):
        if not word:
            raise ValueError(
                f"--ids {text!r}: no id at position {i} (an empty id between commas, or a comma at an end); "
                "give whole numbers separated by spaces or single commas, e.g. --ids '1,2,3'"
            )
        try:
            values.append(int(word))
        except ValueError:
            raise ValueError(
                f"--ids: {word!r} (position {i}) is not a token id; give whole numbers"
            ) from None
    return values


def _int64_ids(values: list[int], vocab_size: int) -> np.ndarray:
    """The ids as int64; one past int64 is refused by position (ids inside int64 but past the
    vocabulary are the hasher's to refuse)."""
    for i, value in enumerate(values):
        if not -(2**63) <= value < 2**63:
            raise ValueError(
                f"--ids: {value} (position {i}) is out of range; token ids run from 0 to {vocab_size - 1}"
            )
    return np.array(values, dtype=np.int64)


# ---------------------------------------------------------------------------- collisions
def cmd_collisions(args: argparse.Namespace) -> int:
    from engram.addressing.collisions import analyze_collisions

    config = config_from_args(args)
    text, source = text_from_args(args)  # read the text first: a missing file fails before any work
    if not text.strip():
        raise ValueError(f"{source} holds no tokens to analyse; give a non-empty text file")
    hasher, tok = hasher_for(config)
    ids = np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    t0 = time.perf_counter()
    reports = analyze_collisions(hasher, ids)
    elapsed = time.perf_counter() - t0
    ok = all(r.crt_ok for r in reports)
    if args.json:
        print(
            json.dumps(
                {
                    "source": source,
                    "tokens": int(ids.size),
                    "seconds": elapsed,
                    "crt_ok": ok,
                    "orders": [r.to_dict() for r in reports],
                }
            )
        )
        return 0 if ok or not args.strict else 1
    print(f"{source}: {ids.size:,} tokens, {config.name}, analysed in {elapsed:.1f} s\n")
    print(
        f"{'layer':>5} {'n':>2} {'distinct n-grams':>16} {'distinct mixes':>14} {'same mix':>8} "
        f"{'rows shared/head':>16} {'pairs 1 head':>12} {'pairs 2 heads':>13} {'max heads':>9}  CRT"
    )
    for r in reports:
        shared = np.mean([h.rows_shared for h in r.heads])
        crt = "ok" if r.crt_ok else "VIOLATED"
        crt += " (guaranteed)" if r.crt_guaranteed else " (not guaranteed: primes too small)"
        print(
            f"{r.layer_id:>5} {r.order:>2} {r.distinct_ngrams:>16,} {r.distinct_mixes:>14,} "
            f"{r.ngrams_sharing_a_mix:>8,} {shared:>16,.1f} {r.pairs_sharing_one_head:>12,} "
            f"{r.pairs_sharing_two_heads:>13,} {r.max_heads_shared:>9}  {crt}"
        )
    print(
        "\nsame mix: n-grams whose 64-bit mix equals another's (they share every row); "
        "max heads: most heads any two different mixes share (CRT bound: 2)"
    )
    return 0 if ok or not args.strict else 1
