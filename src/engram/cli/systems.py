"""`engram profile`, `engram cache-sim`, `engram plan memory` (also `plan-memory`) and `engram plan train`:
row profiles, cache policies against Belady's optimum on a real text, the memory a table needs to
serve, and (`engram.cli.plan_train`) what training it row-sharded costs per rank.

Texts are tokenised and hashed with the config's layout. By default the profile (the pinned
policies' rows, and every cache's starting contents) is counted on the King James Bible's training
books and the replay runs on its held-out books (`engram.apps.lm.data`'s split), so no policy is scored
on the text it was built from; a --text-file without a profile is split the same way (its last
10 % replayed). The work is `engram.systems.cache_sim`, `.profile` and `.planner`'s; only argument
handling and printing here.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from engram.cli.options import (
    SIZE_HELP,
    add_config_options,
    add_text_options,
    byte_size,
    config_from_args,
    hasher_for,
    human_bytes,
    input_file,
    output_file,
    positive_float,
    positive_int,
    row_count,
    text_from_args,
)
from engram.cli.plan_train import add_plan_train
from engram.rowformat.fp8 import fp8_row_bytes
from engram.systems.cache_sim import CacheSimReport, plot_hit_rates, simulate_cache
from engram.systems.planner import PCIE_GBPS, SSD_GBPS, SSD_READ_BYTES, plan_memory
from engram.systems.policies import (
    DEFAULT_PINNED_POLICY,
    DEFAULT_POLICY,
    SIM_POLICIES,
    CachePolicy,
    default_policy,
)
from engram.systems.profile import Profile, build_profile, load_profile, save_profile

__all__ = ["register"]

CORPORA = ("kjv", "kjv-train", "kjv-held-out")


def register(sub: Any) -> None:
    """Add profile, cache-sim, plan-memory and plan (memory, train) to the `engram` subparsers."""
    p = sub.add_parser("profile", help="count how often a text uses each Engram row (for pinned caches)")
    add_config_options(p)
    add_text_options(p, "count")
    p.add_argument("--corpus", choices=CORPORA, help="a part of the King James Bible (default: kjv-train)")
    p.add_argument("--batch-tokens", type=positive_int, default=4096,
                   help="count a row once per batch of this many tokens (default 4096; 1: every use)")  # fmt: skip
    p.add_argument("--top", type=row_count, help=f"keep only the N hottest rows per layer ({SIZE_HELP})")
    p.add_argument("--out", type=output_file, required=True, help="the profile to write (safetensors)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser(
        "cache-sim",
        help="replay a real text's Engram rows through cache policies and Belady's optimum: hit rates, bytes/token",
    )
    _replay_options(p)
    p.add_argument(
        "--cache-rows",
        type=row_count,
        nargs="+",
        default=[1 << 16, 1 << 18, 1 << 20, 1 << 22],
        help=f"cache sizes in rows per layer, e.g. 64Ki 1Mi (default: 64Ki 256Ki 1Mi 4Mi; {SIZE_HELP})",
    )
    p.add_argument("--policies", nargs="+", default=list(SIM_POLICIES), metavar="POLICY",
                   help=f"policies to replay (default: all of {', '.join(SIM_POLICIES)})")  # fmt: skip
    p.add_argument("--plot", type=output_file, help="write hit rate vs cache size per policy to this PNG")
    p.set_defaults(func=cmd_cache_sim)

    _plan_memory_options(sub.add_parser("plan-memory", help=PLAN_MEMORY_HELP + " (also: engram plan memory)"))
    plan = sub.add_parser("plan", help="plan hardware: serving memory (plan memory), training (plan train)")
    what = plan.add_subparsers(dest="plan", metavar="WHAT", required=True)
    _plan_memory_options(what.add_parser("memory", help=PLAN_MEMORY_HELP))
    add_plan_train(what.add_parser("train", help=PLAN_TRAIN_HELP))


PLAN_MEMORY_HELP = "serving: rows per level (HBM, DRAM, SSD), hit rates, link traffic, bottleneck"
PLAN_TRAIN_HELP = (
    "training row-sharded tables: memory per rank (rows, optimizer state, staged rows, gradients), "
    "the row all-to-all's bytes and time per step"
)


def _plan_memory_options(p: argparse.ArgumentParser) -> None:
    _replay_options(p)
    p.add_argument(
        "--hbm", type=byte_size, required=True, help="device memory for the table cache, e.g. 16GiB"
    )
    p.add_argument(
        "--dram", type=byte_size, required=True, help="host memory for the table cache, e.g. 128GiB"
    )
    p.add_argument("--tokens-per-s", type=positive_float, required=True, help="tokens per second to serve")
    p.add_argument("--policy", help=f"cache policy of both levels (default {DEFAULT_PINNED_POLICY.value} with a "
                   f"profile, else {DEFAULT_POLICY.value}; one of {', '.join(c.value for c in CachePolicy)})")  # fmt: skip
    p.add_argument("--pcie-gbps", type=positive_float, default=PCIE_GBPS,
                   help=f"DRAM -> device bandwidth in GB/s (default {PCIE_GBPS:g}: PCIe 4.0 x16 in practice)")  # fmt: skip
    p.add_argument("--ssd-gbps", type=positive_float, default=SSD_GBPS,
                   help=f"SSD read bandwidth in GB/s (default {SSD_GBPS:g}: one PCIe 4.0 NVMe drive)")  # fmt: skip
    p.add_argument("--ssd-read-bytes", type=positive_int, default=SSD_READ_BYTES,
                   help=f"bytes read from SSD per missed row (default {SSD_READ_BYTES}: one page of the row file)")  # fmt: skip
    p.set_defaults(func=cmd_plan_memory)


def _replay_options(p: argparse.ArgumentParser) -> None:
    add_config_options(p)
    add_text_options(p, "replay")
    p.add_argument(
        "--profile", type=input_file, help="a profile written by `engram profile` (pinned rows, warm start)"
    )
    p.add_argument("--profile-text", type=input_file, help="count the profile on this text file instead")
    p.add_argument("--cold", action="store_true",
                   help="caches start empty (default: each starts holding the profile's hottest rows)")  # fmt: skip
    p.add_argument("--pinned-fraction", type=positive_float, default=0.5,
                   help="share of slots pinned by pinned+lru (default 0.5)")  # fmt: skip
    p.add_argument("--batch-tokens", type=positive_int, default=4096, help="tokens per fetch (default 4096)")


# ------------------------------------------------------------------------------------------- texts
def _kjv_parts(max_chars: int | None) -> dict[str, str]:
    from engram.apps.lm.corpus import kjv_text
    from engram.apps.lm.data import load_corpus, split_documents

    train, held = split_documents(load_corpus("kjv"))
    parts = {"kjv": kjv_text(), "kjv-train": "\n".join(d.text for d in train),
             "kjv-held-out": "\n".join(d.text for d in held)}  # fmt: skip
    return {k: v[:max_chars] for k, v in parts.items()}


def _encode(tok: Any, text: str, source: str) -> np.ndarray:
    ids = np.array(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"{source} holds no tokens; give a non-empty text file")
    return ids


def _replay_setup(args: argparse.Namespace) -> tuple[Any, Any, np.ndarray, str, Profile | None]:
    """(config, hasher, replay token ids, their source, profile or None) of cache-sim / plan-memory."""
    if args.profile and args.profile_text:
        raise ValueError("give --profile FILE or --profile-text FILE, not both")
    if args.pinned_fraction > 1:
        raise ValueError(f"--pinned-fraction {args.pinned_fraction}: give a share of the slots in (0, 1]")
    config = config_from_args(args)
    hasher, tok = hasher_for(config)
    profile_text = profile_source = None
    if args.text_file:
        text, source = text_from_args(args)
        if not args.profile and not args.profile_text:  # profile the first 90 %, replay the rest
            cut = text.rfind("\n", 0, int(len(text) * 0.9))
            cut = cut if cut > 0 else int(len(text) * 0.9)
            profile_text, profile_source = text[:cut], f"{source} (first 90 %)"
            text, source = text[cut:], f"{source} (last 10 %)"
    else:
        parts = _kjv_parts(args.max_chars)
        text, source = parts["kjv-held-out"], "King James Bible, held-out books"
        profile_text, profile_source = parts["kjv-train"], "King James Bible, training books"
    if args.profile_text:
        profile_text, profile_source = text_from_args(argparse.Namespace(text_file=[args.profile_text],
                                                                         max_chars=args.max_chars))  # fmt: skip
    ids = _encode(tok, text, source)
    if args.profile:
        profile = load_profile(args.profile, hasher)
    elif profile_text is not None:
        assert profile_source is not None
        profile = build_profile(
            hasher, _encode(tok, profile_text, profile_source), args.batch_tokens, profile_source
        )
    else:
        profile = None
    return config, hasher, ids, source, profile


# ------------------------------------------------------------------------------------------- profile
def cmd_profile(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    hasher, tok = hasher_for(config)
    if args.text_file and args.corpus:
        raise ValueError("give --text-file or --corpus, not both")
    if args.text_file:
        text, source = text_from_args(args)
    else:
        corpus = args.corpus or "kjv-train"
        text, source = _kjv_parts(args.max_chars)[corpus], f"King James Bible ({corpus})"
    t0 = time.perf_counter()
    profile = build_profile(hasher, _encode(tok, text, source), args.batch_tokens, source)
    nbytes = save_profile(profile, args.out, args.top)
    summary = {
        "out": args.out, "source": source, "config": config.name, "tokens": profile.tokens,
        "batch_tokens": profile.batch_tokens, "bytes": nbytes, "seconds": time.perf_counter() - t0,
        "layers": [_coverage(profile, lid) for lid in profile.layer_ids],
    }  # fmt: skip
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{args.out}: {source}, {profile.tokens:,} tokens, {config.name}, a row counted once per batch of "
          f"{profile.batch_tokens} tokens, {human_bytes(nbytes)}")  # fmt: skip
    for ly in summary["layers"]:
        cover = ", ".join(f"{k} rows {v:.1%}" for k, v in ly["share_of_lookups_in_top"].items())
        print(f"layer {ly['layer_id']}: {ly['rows']:,} distinct rows; the hottest hold: {cover}")
    return 0


def _coverage(profile: Profile, lid: int) -> dict[str, Any]:
    counts = profile.counts[profile.layer_ids.index(lid)]
    total = max(int(counts.sum()), 1)
    tops = {"64Ki": 1 << 16, "1Mi": 1 << 20, "4Mi": 1 << 22}
    return {"layer_id": lid, "rows": int(counts.shape[0]),
            "share_of_lookups_in_top": {k: float(counts[:n].sum()) / total for k, n in tops.items()}}  # fmt: skip


# ------------------------------------------------------------------------------------------- cache-sim
def cmd_cache_sim(args: argparse.Namespace) -> int:
    bad = [p for p in args.policies if p not in SIM_POLICIES]
    if bad:
        raise ValueError(f"--policies: unknown policy {bad[0]!r}; known: {', '.join(SIM_POLICIES)}")
    config, hasher, ids, source, profile = _replay_setup(args)
    warm = not args.cold and profile is not None
    t0 = time.perf_counter()
    rows = hasher.hash(ids)  # (N, layers, heads): the text as one stream
    reports = simulate_cache(rows, args.batch_tokens, args.cache_rows, fp8_row_bytes(config.head_dim),
                             list(config.layer_ids), args.policies, profile, warm, args.pinned_fraction)  # fmt: skip
    elapsed = time.perf_counter() - t0
    if args.plot:
        plot_hit_rates(reports, args.plot, f"{config.name}: {source}")
    if args.json:
        print(json.dumps({"source": source, "profile": None if profile is None else profile.source,
                          "config": config.name, "warm": warm, "seconds": elapsed,
                          "reports": [r.to_dict() for r in reports]}))  # fmt: skip
        return 0
    _print_cache_sim(reports, config, hasher, ids, source, profile, warm, args, elapsed)
    return 0


def _print_cache_sim(reports: list[CacheSimReport], config: Any, hasher: Any, ids: np.ndarray, source: str,
                     profile: Profile | None, warm: bool, args: argparse.Namespace, elapsed: float) -> None:  # fmt: skip
    r0 = reports[0]
    bpt = r0.bytes_per_token()
    table_rows = hasher.layout.layers[0].num_embeddings
    start = "holding the profile's hottest rows" if warm else "empty"
    print(
        f"{source}: {ids.size:,} tokens, {config.name} ({table_rows:,} rows a layer), batches of "
        f"{args.batch_tokens} tokens, {elapsed:.1f} s\nprofile: {'none' if profile is None else profile.source}; "
        f"every cache starts {start}\nper token and layer: {config.rows_per_token} rows = {bpt['no_dedup']:.0f} B, "
        f"{bpt['dedup']:.0f} B after deduplication per batch ({r0.rows_distinct / r0.rows_asked:.1%} distinct)\n"
    )
    pols = list(dict.fromkeys(r.policy for r in reports))
    by = {(r.layer_id, r.capacity, r.policy): r for r in reports}
    keys = list(dict.fromkeys((r.layer_id, r.capacity) for r in reports))
    head = f"{'layer':>5} {'cache rows':>11} {'cache MB':>9} " + " ".join(f"{p:>10}" for p in pols)
    for title, cell in (
        ("hit rate (of the distinct rows of each batch)", lambda r: f"{r.hit_rate:>10.1%}"),
        ("bytes per token and layer left for the next level",
         lambda r: f"{r.bytes_per_token()['dedup_and_cache']:>10,.0f}"),
    ):  # fmt: skip
        print(title)
        print(head)
        for lid, cap in keys:
            cells = " ".join(cell(by[lid, cap, p]) for p in pols)
            print(f"{lid:>5} {cap:>11,} {cap * r0.row_bytes / 1e6:>9,.0f} {cells}")
        print()
    print("belady: the offline optimum (evicts the row used furthest ahead), a bound for every policy "
          "starting from the same contents")  # fmt: skip


# ------------------------------------------------------------------------------------------- plan-memory
def cmd_plan_memory(args: argparse.Namespace) -> int:
    if args.policy is not None and args.policy not in {c.value for c in CachePolicy}:
        raise ValueError(
            f"--policy {args.policy!r} is not a cache policy a level can run; give one of "
            f"{', '.join(c.value for c in CachePolicy)} (belady is the simulator's bound only)"
        )
    config, hasher, ids, source, profile = _replay_setup(args)
    policy = default_policy(profile is not None) if args.policy is None else args.policy
    row_bytes = fp8_row_bytes(config.head_dim)
    rows = hasher.hash(ids)
    plan = plan_memory(
        rows, list(config.layer_ids), list(hasher.layout.num_embeddings), row_bytes, args.hbm, args.dram,
        args.tokens_per_s, config_name=config.name, batch_tokens=args.batch_tokens, policy=policy,
        profile=profile, warm=not args.cold and profile is not None, pcie_gbps=args.pcie_gbps,
        ssd_gbps=args.ssd_gbps, ssd_read_bytes=args.ssd_read_bytes, pinned_fraction=args.pinned_fraction,
    )  # fmt: skip
    d = plan.to_dict()
    if args.json:
        print(json.dumps(d | {"source": source, "profile": None if profile is None else profile.source}))
        return 0
    start = "holding the profile's hottest rows" if plan.warm else "empty"
    print(f"{config.name}, {row_bytes}-byte rows; {source}: {plan.tokens:,} tokens replayed, policy "
          f"{plan.policy}, caches start {start}\n")  # fmt: skip
    print(f"{'layer':>5} {'HBM rows':>13} {'DRAM rows':>13} {'SSD rows':>13} {'seen':>11} "
          f"{'HBM hit':>8} {'DRAM hit':>8} {'from SSD':>8}")  # fmt: skip
    for ly in plan.layers:
        print(f"{ly.layer_id:>5} {ly.hbm_rows:>13,} {ly.dram_rows:>13,} {ly.ssd_rows:>13,} "
              f"{ly.distinct_rows_seen:>11,} {ly.hbm_hit_rate:>8.1%} {ly.dram_hit_rate:>8.1%} {ly.ssd_rate:>8.1%}")  # fmt: skip
    big = [ly.layer_id for ly in plan.layers if ly.hbm_rows + ly.dram_rows >= ly.distinct_rows_seen]
    if big:
        print(f"note: the text touches fewer distinct rows than the caches hold (layers {big}): levels that "
              "large cannot be told apart on it; their hit rates are what this text shows, give a longer text")  # fmt: skip
    lim = plan.link_limits()
    n = plan.tokens_per_s
    print(f"\nat {n:,.0f} tokens/s:")
    for key, what, per, gbps in (
        ("dram_to_device", "DRAM -> device", plan.pcie_bytes_per_token, plan.pcie_gbps),
        ("ssd_to_dram", "SSD -> DRAM", plan.ssd_bytes_per_token, plan.ssd_gbps),
    ):  # fmt: skip
        most = "no limit" if lim[key] == float("inf") else f"at most {lim[key]:,.0f} tokens/s"
        print(f"  {what:<15} {per * n / 1e9:>8.2f} GB/s ({per:,.0f} B/token) of {gbps:g} GB/s: {most}")
    spread = plan.ssd_bytes_per_token_spread
    if spread < plan.ssd_bytes_per_token:
        share = max(ly.dram_first_touch for ly in plan.layers)
        most = "no limit" if spread == 0 else f"at most {plan.ssd_gbps * 1e9 / spread:,.0f} tokens/s"
        print(f"  {'':<15} {spread * n / 1e9:>8.2f} GB/s ({spread:,.0f} B/token) if the rows this text touches "
              f"first ({share:.0%} of DRAM's lookups) lay spread evenly outside HBM: {most}")  # fmt: skip
    verdict = "fits" if d["fits"] else "does NOT fit"
    link = {"dram_to_device": "DRAM -> device", "ssd_to_dram": "SSD -> DRAM"}[plan.bottleneck]
    print(f"the link that limits throughput: {link}; {n:,.0f} tokens/s {verdict}")
    return 0
