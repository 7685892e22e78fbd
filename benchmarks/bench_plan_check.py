"""`engram plan train` against measured runs (issue 29 item 6): N gloo ranks train a born-sharded Engram
table through the HF path, and each rank's tensor bytes and exchange counters are set beside the plan.

    python benchmarks/bench_plan_check.py [--rows 60000] [--dim 32] [--worlds 1,2,3] [--steps 3]

Per world size N (one spawned gloo job, one torch thread per rank) and per table optimizer and dtype
(SparseRowAdam, row-wise Adagrad and Sinkhorn on fp32 tables, SparseRowAdam on bf16 ones), every rank
builds the same random `LlamaForCausalLM` (vocabulary 256: the text's bytes), attaches Engram at layers 0
and 1 (`engram.hf.add_engram(..., lazy_tables=True)`: two tables, one exchange; 3-grams, 4 heads an
order), prepares it with
`engram.distributed.prepare_data_parallel(model, "sharded")` (each rank draws its own rows), wraps it
in DDP, builds `engram.hf.build_optimizer` and takes `steps` steps on `batch` x `seq` tokens of the
King James Bible (as bytes; rank r of step s reads the (s * N + r)-th block of the text). Measured per
rank, as tensor bytes (exact accounting, not the resident set):
- rows: the shard (`ShardedTable.weight`); optimizer state: every tensor of the table optimizer's
  state (its logical bytes; the storage behind it is printed too: the CPU Sinkhorn keeps room to grow);
  Sinkhorn's work: its workspace in use, the largest table's active rows' (the buffer it keeps, grown
  by half when outgrown, is printed: 1 to 1.5x that, by the order the active sets grew in);
- staged rows: the prefetched blocks after backward; gradients: the blocks' gradients + the rows
  served as owner (their gradients arrive in one buffer: `rows_served` x row bytes) + the shard's
  sparse gradient (`ShardedTableSync.flush`, before the table step);
- the exchange per step: `engram.distributed.exchange_stats` counters (bytes to / from other ranks).
The plan (`engram.systems.train_plan.plan_training`) gets the same config, tokens per step (N x batch
x seq), ranks, optimizer and dtype, and row statistics measured on the very rows these steps looked up
(`measure_row_stats` at a rank's batch, a step's and the whole run's: the batches' own distinct rows,
so what is compared is the plan's model of the exchange and of memory, not the sampling of a text).
Sinkhorn's active rows: the plan's own, for the run's steps (`TrainSetup.steps`). Compared: the
fullest rank's rows, state and gradients (max over ranks), the mean rank's staged rows and bytes
(mean over ranks and steps), the busiest owner's bytes (max over ranks of its mean). The resident set
(peak minus the process before the model) is printed beside the plan's total as a cross-check.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.addressing.compression import TokenizerCompression
from engram.addressing.layout import Layout, layout_fingerprint
from engram.benchmarks.timing import status_mib
from engram.config import EngramConfig

VOCAB = 256  # the text's bytes
HIDDEN = 32
RUNS = (("adam", "fp32"), ("adagrad", "fp32"), ("sinkhorn", "fp32"), ("adam", "bf16"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = 0.10  # issue 29: the plan within 10 % of the measured


def engram_config(rows: int, dim: int) -> EngramConfig:
    return EngramConfig(name="plan-check", layer_ids=(0, 1), max_ngram_size=3, n_heads=4,
                        engram_vocab_size=(rows, rows), vocab_size=VOCAB, compressed_vocab_size=VOCAB,
                        pad_token_id=0, tokenizer=None, head_dim=dim, hidden_size=HIDDEN, hc_mult=1)  # fmt: skip


def compression() -> TokenizerCompression:
    return TokenizerCompression.identity(VOCAB, fingerprint="bench-plan-bytes")


def token_batches(world: int, steps: int, batch: int, seq: int) -> torch.Tensor:
    """(steps, world * batch, seq) bytes of the Bible: rank r of step s takes rows [r * batch, (r+1) * batch)."""
    from engram.apps.lm.corpus import kjv_text

    n = steps * world * batch * seq
    ids = np.frombuffer(kjv_text(2 * n).encode(), dtype=np.uint8)[:n].astype(np.int64)
    if ids.size < n:
        raise ValueError(f"the text has {ids.size:,} bytes, the run needs {n:,}: take fewer steps or tokens")
    return torch.from_numpy(ids.reshape(steps, world * batch, seq).copy())


def backbone(dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _peak_reset() -> float:
    """VmHWM back to the resident set now (Linux clear_refs); the resident set (MiB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return status_mib("VmRSS")


def _one_run(rank: int, world: int, ids: torch.Tensor, optimizer: str, dtype: str, rows: int, dim: int,
             batch: int) -> dict[str, Any]:  # fmt: skip
    from torch.nn.parallel import DistributedDataParallel

    from engram.distributed import prepare_data_parallel
    from engram.distributed.exchange_stats import exchange_stats
    from engram.hf import add_engram, build_optimizer

    counters = exchange_stats()
    rest = _peak_reset()
    model = backbone(DTYPES[dtype])
    # zero_init=False: the tables get gradients from the first step on (zero-initialised values would
    # give every row of step 1 a zero gradient, which Sinkhorn's active set drops at once)
    add_engram(
        model,
        engram_config(rows, dim),
        compression=compression(),
        seed=1234,
        lazy_tables=True,
        zero_init=False,
    )
    prepare_data_parallel(model, "sharded")
    ddp = DistributedDataParallel(model)
    opt = build_optimizer(model, lr=1e-3, table_lr=1e-2, table_optimizer=optimizer)
    sync = model.engram.table_sync
    tables = sync.tables
    steps = []
    for s in range(ids.shape[0]):
        x = ids[s, rank * batch : (rank + 1) * batch]  # (batch, seq)
        before = counters.copy()
        ddp(input_ids=x, labels=x).loss.backward()
        # the prefetched blocks (U_t, dim) and their gradients, held from forward until the flush
        staged = sum(t.staged.nbytes for t in tables)
        block_grad = sum(t.staged.grad.nbytes for t in tables if t.staged.grad is not None)
        sync.flush()  # the gradients to their owners (the table step's own flush then has nothing left)
        shard_grad = sum(g.coalesce().values().nbytes for g in sync.grads.values())
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"staged": staged, "block_grad": block_grad, "shard_grad": shard_grad,
                      "x": (counters - before).to_dict()})  # fmt: skip
    table_opt = sync.optimizer
    state = [v for st in table_opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    kept = getattr(table_opt, "workspace_bytes", None)  # Sinkhorn's buffers kept between steps
    work_bytes = kept() if kept is not None else 0
    active = [int(st["rows"].numel()) for st in table_opt.state.values() if "rows" in st]
    out = {
        "rows": sum(t.weight.nbytes for t in tables),
        "state": sum(v.nbytes for v in state),
        "state_storage": _storage_bytes(state),
        "work_kept": work_bytes,
        # the workspace the passes used: (A, dim) fp32, (A,) fp64, (A,) bool of the largest table's A
        "work": max(active, default=0) * (tables[0].dim * 4 + 9),
        "steps": steps,
        "rss_mb": status_mib("VmHWM") - rest,
    }
    del model, ddp, opt, sync, tables
    return out


def rank_job(rank: int, world: int, *, rows: int, dim: int, steps: int, batch: int, seq: int,
             runs: tuple[tuple[str, str], ...] | list[list[str]] = RUNS, warm: bool = False) -> dict[str, Any]:  # fmt: skip
    """One rank's measurements, every (optimizer, dtype) of `runs` in turn (the process group is up);
    `warm`: build a backbone first (for the resident set's cross-check)."""
    from engram.distributed.exchange_stats import exchange_stats

    ids = token_batches(world, steps, batch, seq)
    if warm:  # transformers imported and torch warmed up before the first run's resident set
        backbone(torch.float32)
    counters = exchange_stats()
    kept = counters.enabled, counters.count_served_distinct
    counters.enabled = counters.count_served_distinct = True
    try:
        out = {f"{o}/{d}": _one_run(rank, world, ids, o, d, rows, dim, batch) for o, d in runs}
    finally:
        counters.enabled, counters.count_served_distinct = kept
    return {"rank": rank, "world": world, "runs": out}


def run_stats(world: int, *, rows: int, dim: int, steps: int, batch: int, seq: int) -> Any:
    """Row statistics of the rows the world's run looked up: at a rank's batch and at the first k steps'
    tokens, for every k (the active set of Sinkhorn after k steps)."""
    from engram.addressing.hashing import NgramHasher
    from engram.systems.row_stats import measure_row_stats

    cfg = engram_config(rows, dim)
    layout = Layout(cfg)
    ids = token_batches(world, steps, batch, seq)
    looked = np.asarray(
        NgramHasher(cfg, compression()).hash(ids.reshape(-1, seq).numpy())
    )  # (S*N*B, T, L, H)
    looked = looked.reshape(-1, *looked.shape[2:])  # (tokens, layers, heads): rank batches in order
    heads = [layer.flat_primes.tolist() for layer in layout.layers]
    rank = batch * seq
    return measure_row_stats(looked, heads, layout.table_rows, config=cfg.name,
                             fingerprint=layout_fingerprint(layout), source="the run's own rows",
                             batch_tokens=(rank, *(k * world * rank for k in range(1, steps + 1))))  # fmt: skip


def _mean(xs: Any) -> float:
    return float(np.mean(list(xs)))


def compare(world: int, ranks: list[dict], *, rows: int, dim: int, steps: int, batch: int, seq: int,
            runs: Any = RUNS) -> list[dict[str, Any]]:  # fmt: skip
    """(quantity, predicted, measured, ratio) of every run of one world size, from its ranks' results."""
    from engram.systems.train_plan import PARAM_BYTES, TrainSetup, plan_training

    cfg = engram_config(rows, dim)
    table_rows = Layout(cfg).table_rows
    stats = run_stats(world, rows=rows, dim=dim, steps=steps, batch=batch, seq=seq)
    tokens = world * batch * seq
    out: list[dict[str, Any]] = []
    for optimizer, dtype in runs:
        key = f"{optimizer}/{dtype}"
        got = [r["runs"][key] for r in ranks]
        every = [s for g in got for s in g["steps"]]
        # Sinkhorn: the plan's active rows after the run's steps
        setup = TrainSetup(tokens, world, optimizer, param_dtype=dtype, steps=steps)
        plan = plan_training(cfg, table_rows, stats, setup)
        m, x = plan.memory, plan.exchange
        row_b = dim * PARAM_BYTES[dtype]
        grads = max(_mean(s["block_grad"] + s["x"]["rows_served"] * row_b + s["shard_grad"] for s in g["steps"])
                    for g in got)  # fmt: skip
        pairs = [
            ("rows B", m.rows, max(g["rows"] for g in got)),
            ("optimizer state B", m.optimizer_state, max(g["state"] for g in got)),
            ("staged rows B", m.staged_rows, _mean(s["staged"] for s in every)),
            ("gradients B", m.gradients, grads),
            ("rows asked", x.rows_requested, _mean(s["x"]["rows_requested"] for s in every)),
            ("busiest owner serves", x.rows_served_max,
             max(_mean(s["x"]["rows_served"] for s in g["steps"]) for g in got)),
            ("sent B/step", x.sent_total, _mean(s["x"]["sent_remote"]["total"] for s in every)),
            ("received B/step", x.received_total, _mean(s["x"]["received_remote"]["total"] for s in every)),
            ("busiest sent B/step", sum(x.sent_max.values()),
             max(_mean(s["x"]["sent_remote"]["total"] for s in g["steps"]) for g in got)),
            ("busiest received B/step", sum(x.received_max.values()),
             max(_mean(s["x"]["received_remote"]["total"] for s in g["steps"]) for g in got)),
            ("undeduped B/step", sum(x.undeduped.values()),
             _mean(s["x"]["undeduped_remote"]["total"] for s in every)),
        ]  # fmt: skip
        if optimizer == "sinkhorn":
            pairs.insert(2, ("optimizer work B", m.optimizer_work, max(g["work"] for g in got)))
        for name, pred, meas in pairs:
            ratio = pred / meas if meas else (1.0 if pred == meas else float("inf"))
            out.append({"world": world, "run": key, "quantity": name, "predicted": float(pred),
                        "measured": float(meas), "ratio": ratio, "ok": abs(pred - meas) <= TOL * meas})  # fmt: skip
        if optimizer == "sinkhorn":
            kept = max(g["work_kept"] for g in got)
            out.append({"world": world, "run": key, "quantity": "work kept B (grown by half, not compared)",
                        "predicted": float(m.optimizer_work), "measured": float(kept),
                        "ratio": m.optimizer_work / kept, "ok": True})  # fmt: skip
        out.append({"world": world, "run": key, "quantity": "state storage B (CPU room, not compared)",
                    "predicted": float(m.optimizer_state), "measured": float(max(g["state_storage"] for g in got)),
                    "ratio": m.optimizer_state / max(g["state_storage"] for g in got), "ok": True})  # fmt: skip
        rss = max(g["rss_mb"] for g in got)
        out.append({"world": world, "run": key, "quantity": "resident MiB (cross-check, not compared)",
                    "predicted": m.total / 2**20, "measured": rss, "ratio": m.total / 2**20 / rss, "ok": True})  # fmt: skip
    return out


def _rank_main(rank: int, world: int, folder: str, kw: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        torch.save(rank_job(rank, world, warm=True, **kw), f"{folder}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(rows: int = 60_000, dim: int = 32, worlds: tuple[int, ...] = (1, 2, 3), steps: int = 3,
        batch: int = 4, seq: int = 512, runs: Any = RUNS) -> list[dict[str, Any]]:  # fmt: skip
    """One spawned gloo job per world size; a row per (world, run, quantity)."""
    kw = {
        "rows": rows,
        "dim": dim,
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "runs": tuple(map(tuple, runs)),
    }
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for w in worlds:
            sub = Path(d) / f"world-{w}"
            sub.mkdir()
            mp.spawn(_rank_main, args=(w, str(sub), kw), nprocs=w)
            ranks = [torch.load(sub / f"rank-{r}.pt", weights_only=False) for r in range(w)]
            out += compare(w, ranks, **kw)
    return out


def report(rows: list[dict[str, Any]]) -> None:
    print(f"{'N':>2} {'run':<13} {'quantity':<42} {'predicted':>14} {'measured':>14} {'ratio':>7}")
    for r in rows:
        flag = "" if r["ok"] else "  OFF BY MORE THAN 10 %"
        print(f"{r['world']:>2} {r['run']:<13} {r['quantity']:<42} {r['predicted']:>14,.0f} "
              f"{r['measured']:>14,.0f} {r['ratio']:>7.3f}{flag}")  # fmt: skip
    compared = [r for r in rows if "not compared" not in r["quantity"] and r["measured"]]
    if compared:
        ratios = [r["ratio"] for r in compared]
        print(f"compared: {len(compared)} (nonzero), ratio predicted / measured {min(ratios):.3f} .. {max(ratios):.3f}; "
              f"{sum(not r['ok'] for r in rows)} off by more than 10 %")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=60_000, help="rows per head (8 heads: 8 x rows rows)")
    ap.add_argument("--dim", type=int, default=32, help="the table's row width")
    ap.add_argument("--worlds", default="1,2,3", help="world sizes, one gloo job each")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences a rank a step")
    ap.add_argument("--seq", type=int, default=512, help="tokens a sequence")
    args = ap.parse_args()
    worlds = tuple(int(x) for x in args.worlds.split(","))
    report(run(args.rows, args.dim, worlds, args.steps, args.batch, args.seq))


if __name__ == "__main__":
    main()
