"""Engram on an HF Llama under DDP (2 gloo processes): step time against the same model without
Engram under DDP, and the table memory per rank of each table mode, measured in the same run.

    python benchmarks/bench_hf_ddp.py [--world 2] [--hidden 256] [--layers 4] [--batch 4] [--seq 128]
                                      [--table-rows 400000] [--table-optimizer adam] [--steps 12]

Every rank builds the same random `LlamaForCausalLM` (vocabulary 8192, from a config) twice: plain,
and with `engram.hf.add_engram` at layer 1 (3-grams, 4 heads per order, rows of 32, each head about
`table-rows` rows: 8 x table-rows rows in all, rows hashed inside forward). Modes, each wrapped in
`DistributedDataParallel` after `engram.distributed.prepare_data_parallel(model, mode)`:
- plain: the model without Engram (the baseline);
- sharded: each rank owns 1/W of the table's rows (one row exchange per forward, gradients back to
  the owners after backward);
- replicated: each rank holds the whole table (sparse row gradients all-gathered before the step).
Step: forward + backward + `build_optimizer`'s step of `batch` x `seq` tokens per rank (new random
tokens each step); the modes alternate step by step and each reports its median over `steps`
steps (after 2 warm-up steps), measured on rank 0. The ratio is a mode's time over plain's
(target, issue 20: sharded <= 1.3x).

Memory per rank: the table's weight and its optimizer state on this rank, in bytes per table
parameter (whole table), and what DDP buckets (its parameters minus the ones it ignores): the table
never enters a bucket, and after a step its `.grad` is None (no dense zero gradient). Resident
memory per rank, not only tensor bytes (Linux): the resident set before `prepare_data_parallel` and
its peak during the call (VmHWM, reset just before it through /proc/self/clear_refs), and each
process's peak over the whole run (the three models live side by side). `--steps 0` measures the
set-up only. Every rank uses one torch thread.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.addressing.compression import TokenizerCompression
from engram.benchmarks.timing import status_mib
from engram.config import EngramConfig

VOCAB = 8192
MODES = ("plain", "sharded", "replicated")


def _reset_peak() -> tuple[bool, float]:
    """Make VmHWM the current resident set (Linux >= 4.0): (whether that was allowed, the peak it had)."""
    before = status_mib("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True, before
    except OSError:
        return False, before


def _model(args: argparse.Namespace, engram: bool) -> torch.nn.Module:
    import transformers

    from engram.hf import add_engram

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if not engram:
        return model
    econfig = EngramConfig(
        name="bench-hf-ddp",
        layer_ids=(1,),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(args.table_rows, args.table_rows),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=32,
        hidden_size=args.hidden,
        hc_mult=1,
    )
    identity = TokenizerCompression.identity(VOCAB, fingerprint="bench-identity")
    torch.manual_seed(1)  # the same table on every rank
    add_engram(model, econfig, compression=identity)
    with torch.no_grad():  # a trained-looking Engram (its value projection is not zero)
        model.engram.module(1).wkv.weight.normal_(std=0.02)
    return model


def _table_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(whole table parameters, this rank's table weight bytes, this rank's table optimizer state bytes)."""
    att = model.engram
    weights = att.tables()
    full = sum(m.table.num_rows * m.table.dim for m in att.layers.values())
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    ids = {id(w) for w in weights}
    state_bytes = 0
    for p, st in opt.tables.state.items():
        if id(p) in ids:
            state_bytes += sum(
                v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor)
            )
    return full, weight_bytes, state_bytes


def _worker(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from engram.distributed import prepare_data_parallel
    from engram.hf import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        runs, peaks = {}, []  # peaks: VmHWM before each reset (the process's peak is the largest)
        for mode in MODES:
            model = _model(args, engram=mode != "plain")
            memory = {}
            if mode != "plain":
                memory["rss_mb"] = status_mib("VmRSS")
                reset, peak = _reset_peak()
                peaks.append(peak)
                prepare_data_parallel(model, mode)
                memory["prepare_peak_mb"] = status_mib("VmHWM") if reset else float("nan")
            ddp = DistributedDataParallel(model)
            if mode == "plain":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            else:
                opt = build_optimizer(model, lr=1e-4, table_lr=1e-2, table_optimizer=args.table_optimizer)
            ignored = set(ddp.parameters_to_ignore)
            bucketed = sum(
                p.numel() * p.element_size()
                for n, p in model.named_parameters()
                if n not in ignored and p.requires_grad
            )
            runs[mode] = {
                "model": model, "ddp": ddp, "opt": opt, "times": [], "bucketed": bucketed, "memory": memory
            }  # fmt: skip
        gen = torch.Generator().manual_seed(100 + rank)
        for i in range(args.steps + 2):
            batch = torch.randint(2, VOCAB, (args.batch, args.seq), generator=gen)
            for mode in MODES:
                r = runs[mode]
                dist.barrier()
                t0 = time.perf_counter()
                r["ddp"](input_ids=batch, labels=batch).loss.backward()
                r["opt"].step()
                r["opt"].zero_grad(set_to_none=True)
                dist.barrier()
                if i >= 2:
                    r["times"].append(time.perf_counter() - t0)
        res = {"peak_rss_mb": max([status_mib("VmHWM"), *peaks])}
        for mode, r in runs.items():
            times = r["times"] or [float("nan")]
            entry = {"step_s": statistics.median(times), "bucketed_bytes": r["bucketed"], **r["memory"]}
            if mode != "plain":
                full, wb, sb = _table_bytes(r["model"], r["opt"])
                entry.update(
                    table_params=full,
                    weight_bytes=wb,
                    state_bytes=sb,
                    table_grads=[w.grad is not None for w in r["model"].engram.tables()],
                )
            res[mode] = entry
        torch.save(res, f"{out}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--table-rows", type=int, default=400_000)
    ap.add_argument("--table-optimizer", default="adam", choices=("adam", "adagrad", "sinkhorn"))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per mode (0: measure the set-up only)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(args.world, str(Path(d) / "init"), d, args), nprocs=args.world)
        ranks = [torch.load(Path(d) / f"rank-{r}.pt", weights_only=False) for r in range(args.world)]
    base = ranks[0]["plain"]["step_s"]
    print(
        f"world {args.world} (gloo, 1 thread each), Llama hidden {args.hidden} x {args.layers} layers, "
        f"{args.batch} x {args.seq} tokens per rank, table optimizer {args.table_optimizer}"
    )
    print(
        f"{'mode':<11} {'step s':>8} {'x plain':>8} {'table B/param/rank':>19} {'DDP-bucketed MB':>16} table .grad"
    )
    for mode in MODES:
        r0 = ranks[0][mode]
        per = ""
        grads = ""
        if mode != "plain":
            per_rank = [
                (r[mode]["weight_bytes"] + r[mode]["state_bytes"]) / r[mode]["table_params"] for r in ranks
            ]
            per = " / ".join(f"{x:.2f}" for x in per_rank)
            grads = "none" if not any(any(r[mode]["table_grads"]) for r in ranks) else "DENSE"
        print(
            f"{mode:<11} {r0['step_s']:>8.4f} {r0['step_s'] / base:>7.2f}x {per:>19} "
            f"{r0['bucketed_bytes'] / 2**20:>16.1f} {grads}"
        )
    t = ranks[0]["sharded"]["table_params"]
    print(f"table: {t:,} parameters ({t * 4 / 2**20:.1f} MB fp32); target: sharded step <= 1.3x plain")
    print("resident memory per rank (MB): before prepare_data_parallel -> its peak during the call")
    for mode in MODES[1:]:
        per = " / ".join(f"{r[mode]['rss_mb']:.0f} -> {r[mode]['prepare_peak_mb']:.0f}" for r in ranks)
        print(f"  {mode:<11} {per}")
    peaks = " / ".join(f"{r['peak_rss_mb']:.0f}" for r in ranks)
    print(f"process peak over the run (MB per rank): {peaks}")


if __name__ == "__main__":
    main()
