"""A table no rank could hold (issue 29 item 4): N gloo ranks, each capped below the whole table plus
its optimizer state, train an Engram table through the HF path, checkpoint it, resume it, save the
FP8 part without a gather; then one process serves `generate()` from it memory-mapped.

    python benchmarks/bench_born_sharded.py [--rows 250000] [--worlds 1,2,3] [--cap 0.9] [--steps 3]
        [--cap-one] [--lift-resume]

Per world size N (one spawned gloo job each, one torch thread per rank), every rank:
- builds the same random `LlamaForCausalLM` (vocabulary 512, hidden 64, 2 layers) and attaches
  Engram at layer 1 with `engram.hf.add_engram(..., lazy_tables=True)` (3-grams, 4 heads per order,
  rows of 32: 8 x `rows` rows in all, no memory yet);
- caps itself (N > 1; N = 1 too with `--cap-one`, which must then fail: the point of the cap) with
  `resource.setrlimit(RLIMIT_DATA)` at its data segment then (everything
  but the table) + `cap` x (table + SparseRowAdam state, whole). RLIMIT_DATA, not RLIMIT_AS: the
  address space counts reservations that hold no memory (glibc's per-thread malloc arenas, 64 MiB
  each, gloo's threads), which differ run to run; RLIMIT_DATA (Linux >= 4.7) counts the private
  writable mappings, i.e. what the process can fill, and not the read-only mapped files;
- `prepare_data_parallel(model, 'sharded')` (each rank draws only its rows), DDP, `build_optimizer`
  (SparseRowAdam on the table) and `steps` steps of `batch` x `seq` random tokens;
- checkpoints (`save_table_shards` on every rank, the dense model and optimizer state from rank 0),
  drops the model, builds it again and resumes (`load_table_shards`: each rank reads its rows; the
  rows' digest equals the one saved), takes one more step, all under the cap: the reader checks each
  file a block at a time, reads the optimizer state into fresh tensors the optimizer keeps and the
  rows straight into the table (by position, no mapping), so the resident peak grows by the rank's
  state and a block (printed; `--lift-resume` lifts the cap for `load_table_shards`, as the reader
  before, which grew it by 2.5-2.9x the rank's rows + state, needed);
- writes the FP8 part with `engram.distributed.export_fp8` (each rank quantises and writes its own
  rows at their offsets in the one file).
Then one process (spawned, its own peak measured) loads the part onto the backbone with
`engram.hf.load_engram(..., mmap=True)` (an `MmapFP8Table`) and runs `generate()`.

Printed per N: each rank's peak RSS (VmHWM over its whole job) against (table + state) / N + the
rest (the resident set before the table existed: Python, torch, transformers, the backbone), with
the ratio (target, issue 29: at most 1.15); the time per rank of initialisation (add_engram +
prepare_data_parallel) and of the part's save, as ratios against N = 1 (target: 1/N).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import resource
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.addressing.compression import TokenizerCompression
from engram.benchmarks.timing import status_mib
from engram.config import EngramConfig

VOCAB = 512
HIDDEN = 64
MIB = 1 << 20


def backbone(layers: int = 2, hidden: int = HIDDEN) -> torch.nn.Module:
    """The same random tiny Llama in every process."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def engram_config(rows: int, hidden: int = HIDDEN) -> EngramConfig:
    return EngramConfig(
        name="bench-born-sharded",
        layer_ids=(1,),
        max_ngram_size=3,
        n_heads=4,
        engram_vocab_size=(rows, rows),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=32,
        hidden_size=hidden,
        hc_mult=1,
    )


def compression() -> TokenizerCompression:
    return TokenizerCompression.identity(VOCAB, fingerprint="bench-identity")


def attach(model: torch.nn.Module, rows: int, lazy: bool | None = True) -> torch.nn.Module:
    from engram.hf import add_engram

    return add_engram(model, engram_config(rows), compression=compression(), seed=1234, lazy_tables=lazy)


def whole_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(the tables' bytes, their SparseRowAdam state's bytes), whole: 4 B a parameter for the fp32
    table; exp_avg 4 B a parameter + exp_avg_sq_row and step 8 B a row."""
    table = state = 0
    for m in model.engram.layers.values():
        n, d = m.table.num_rows, m.table.dim
        table += 4 * n * d
        state += 4 * n * d + 8 * n
    return table, state


def cap_data(extra_bytes: int) -> int:
    """Cap this process's data segment (the soft limit) at what it holds now + `extra_bytes`;
    returns the limit."""
    limit = int(status_mib("VmData") * MIB) + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
    return limit


def _set_soft_limit(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))


def _reset_peak() -> float:
    """Reset VmHWM to the resident set now (Linux: /proc/self/clear_refs); returns that (NaN if not allowed)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    return status_mib("VmRSS")


def _mark(res: dict, stage: str) -> None:
    """The data segment (MiB) at a stage of the job (what RLIMIT_DATA caps)."""
    res.setdefault("data_mb", {})[stage] = round(status_mib("VmData"), 1)


def _step(ddp, opt, gen: torch.Generator, batch: int, seq: int) -> float:
    ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    loss = ddp(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _trainable(rows: int, lr: float = 1e-3):
    """Backbone + lazy Engram, prepared sharded, DDP, build_optimizer; (model, ddp, opt, init s)."""
    from torch.nn.parallel import DistributedDataParallel

    from engram.distributed import prepare_data_parallel
    from engram.hf import build_optimizer

    model = backbone()
    t0, c0 = time.perf_counter(), time.process_time()
    attach(model, rows)
    prepare_data_parallel(model, "sharded")
    init_s = (time.perf_counter() - t0, time.process_time() - c0)
    ddp = DistributedDataParallel(model)
    opt = build_optimizer(model, lr=lr, table_lr=1e-2, table_optimizer="adam")
    return model, ddp, opt, init_s


def rank_job(rank: int, world: int, folder: str, rows: int, cap: float | None, steps: int,
             batch: int, seq: int, lift_resume: bool = False) -> dict:  # fmt: skip
    """One rank's whole run (the process group is up); returns what it measured. `cap`: the data
    segment's allowance beyond the rest, as a fraction of the whole table + state (None: no cap),
    kept through the resume unless `lift_resume` (then lifted for `load_table_shards` alone).
    `resume_grew_mb`: how much the resident peak grew in `load_table_shards`."""
    from engram.distributed import export_fp8, load_table_shards, save_table_shards, tensor_digest

    probe = attach(backbone(), rows)  # imports transformers; the table is lazy: no memory
    table_b, state_b = whole_bytes(probe)
    gc.collect()
    rest_mb = status_mib("VmRSS")  # Python, torch, transformers, the process group, a backbone
    del probe
    gc.collect()
    res: dict = {"rank": rank, "world": world, "table_b": table_b, "state_b": state_b}
    if cap is not None:
        res["cap_extra_b"] = int(cap * (table_b + state_b))
        res["limit_b"] = cap_data(res["cap_extra_b"])
    res["rest_mb"] = rest_mb
    _mark(res, "capped")
    gen = torch.Generator().manual_seed(100 + rank)
    model, ddp, opt, (res["init_s"], res["init_cpu_s"]) = _trainable(rows)
    sync = model.engram.table_sync
    res["shard_rows"] = [t.hi - t.lo for t in sync.tables]
    _mark(res, "init")
    res["losses"] = [_step(ddp, opt, gen, batch, seq) for _ in range(steps)]

    _mark(res, "trained")
    ckpt = f"{folder}/ckpt"
    Path(ckpt).mkdir(exist_ok=True)
    t0 = time.perf_counter()
    save_table_shards(model, ckpt)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{ckpt}/rank0.pt")
    dist.barrier()
    res["checkpoint_s"] = time.perf_counter() - t0
    saved = [tensor_digest(t.weight.detach()) for t in sync.tables]
    del model, ddp, opt, sync
    gc.collect()
    _mark(res, "checkpointed")

    model, ddp, opt, _ = _trainable(rows)
    t0 = time.perf_counter()
    state = torch.load(f"{ckpt}/rank0.pt", weights_only=False)
    model.load_state_dict(state["model"], strict=False)  # the dense part: the sharded table is not in it
    opt.load_state_dict(state["optimizer"])
    del state
    lift = res["lift_resume"] = "limit_b" in res and lift_resume
    if lift:
        _set_soft_limit(resource.RLIM_INFINITY)
    peak = res["peak_train_mb"] = status_mib("VmHWM")  # init, train, checkpoint (and a model built)
    before = _reset_peak()
    load_table_shards(model, ckpt)
    res["resume_grew_mb"] = status_mib("VmHWM") - before  # the resident peak's growth in the read
    if lift:
        _set_soft_limit(res["limit_b"])
    res["resume_s"] = time.perf_counter() - t0
    sync = model.engram.table_sync
    res["resumed_equal"] = [tensor_digest(t.weight.detach()) for t in sync.tables] == saved
    res["losses"].append(_step(ddp, opt, gen, batch, seq))

    _mark(res, "resumed")
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    export_fp8(model, f"{folder}/part-fp8")
    res["save_s"], res["save_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    _mark(res, "saved")
    if rank == 0:  # the backbone, for the serving process (a few MB)
        dense = {k: v for k, v in model.state_dict().items() if not k.startswith("engram.")}
        torch.save(dense, f"{folder}/backbone.pt")
    dist.barrier()
    res["peak_mb"] = max(peak, status_mib("VmHWM"))
    return res


def serve(folder: str, new_tokens: int = 8) -> dict:
    """One process: the backbone, the FP8 part loaded memory-mapped, generate()."""
    from engram.hf import load_engram

    model = backbone()
    model.load_state_dict(torch.load(f"{folder}/backbone.pt", weights_only=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer to check the identity map against
        load_engram(model, f"{folder}/part-fp8", mmap=True)
    table = model.engram.module(1).table
    prompt = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return {
        "table": type(table).__name__,
        "rows": table.num_rows,
        "generated": out.shape[1] - prompt.shape[1],
        "peak_mb": status_mib("VmHWM"),
    }


def _rank_main(rank: int, world: int, folder: str, kw: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    try:
        res = rank_job(rank, world, folder, **kw)
    except (MemoryError, RuntimeError, ValueError) as e:  # ValueError: a check that it will not fit
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-6:]
        res = {"rank": rank, "world": world, "error": f"{type(e).__name__}: {str(e)[:500]}",
               "where": " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(where))}  # fmt: skip
    torch.save(res, f"{folder}/rank-{rank}.pt")
    dist.destroy_process_group()


def _serve_main(_: int, folder: str) -> None:
    torch.set_num_threads(1)
    torch.save(serve(folder), f"{folder}/serve.pt")


def run(rows: int = 250_000, worlds: tuple[int, ...] = (1, 2, 3), cap: float = 0.9, steps: int = 3,
        batch: int = 2, seq: int = 64, folder: str | None = None, lift_resume: bool = False,
        cap_one: bool = False) -> list[dict]:  # fmt: skip
    """Every world size's job (capped for N > 1, and N = 1 with `cap_one`), then one serving process
    after the last; a row per rank and one for the serving process."""
    out: list[dict] = []
    with tempfile.TemporaryDirectory(dir=folder) as d:
        for w in worlds:
            sub = Path(d) / f"world-{w}"
            sub.mkdir()
            kw = {"rows": rows, "cap": cap if w > 1 or cap_one else None, "steps": steps, "batch": batch,
                  "seq": seq, "lift_resume": lift_resume}  # fmt: skip
            mp.spawn(_rank_main, args=(w, str(sub), kw), nprocs=w)
            out += [torch.load(sub / f"rank-{r}.pt", weights_only=False) for r in range(w)]
        if (sub / "backbone.pt").exists():  # the last job wrote its part
            mp.spawn(_serve_main, args=(str(sub),), nprocs=1)
            out.append({"serve": True, **torch.load(sub / "serve.pt", weights_only=False)})
    return out


def report(rows: list[dict], verbose: bool = False) -> None:
    ranks = [r for r in rows if "serve" not in r]
    for r in ranks:
        if "error" in r:
            print(f"world {r.get('world', '?')} rank {r['rank']}: FAILED {r['error']} at {r.get('where')}")
    ranks = [r for r in ranks if "error" not in r]
    if not ranks:
        return
    t, s = ranks[0]["table_b"], ranks[0]["state_b"]
    print(f"table {t / MIB:.1f} MiB + SparseRowAdam state {s / MIB:.1f} MiB = {(t + s) / MIB:.1f} MiB whole")
    n0 = min(x["world"] for x in ranks)  # the baseline (1 unless N = 1 failed, e.g. capped)
    one = [r for r in ranks if r["world"] == n0]
    base = {k: float(np.mean([r[k] for r in one])) for k in ("init_s", "init_cpu_s", "save_s", "save_cpu_s")}
    print(f"{'N':>2} {'rank':>4} {'cap':>5} {'rest':>5} {'expect':>6} {'peak':>5} {'ratio':>5} {'train':>5} "
          f"{'ratio':>5} {'init s wall/cpu':>15} {f'x N={n0}':>11} {'save s wall/cpu':>15} {f'x N={n0}':>11} resumed")  # fmt: skip
    for r in ranks:
        n = r["world"]
        expected = (t + s) / n / MIB + r["rest_mb"]
        cap = f"{r['cap_extra_b'] / MIB:.0f}" if "cap_extra_b" in r else "-"
        times = []
        for k in ("init", "save"):
            w, c = r[f"{k}_s"], r[f"{k}_cpu_s"]
            times.append(f"{w:>7.2f}/{c:<7.2f} {w / base[f'{k}_s']:>5.2f}/{c / base[f'{k}_cpu_s']:<5.2f}")
        print(
            f"{n:>2} {r['rank']:>4} {cap:>5} {r['rest_mb']:>5.0f} {expected:>6.0f} {r['peak_mb']:>5.0f} "
            f"{r['peak_mb'] / expected:>5.2f} {r['peak_train_mb']:>5.0f} {r['peak_train_mb'] / expected:>5.2f} "
            f"{times[0]} {times[1]} {r['resumed_equal']}"
        )
        print(f"     load_table_shards grew the resident peak by {r['resume_grew_mb']:.0f} MiB "
              f"(this rank's table + state: {(t + s) / n / MIB:.0f} MiB, its state {s / n / MIB:.0f}; "
              f"{r['resume_grew_mb'] * MIB * n / (t + s):.2f}x)")  # fmt: skip
        if verbose:
            print("     data segment MiB by stage: " + ", ".join(f"{k} {v}" for k, v in r["data_mb"].items()))
    lifted = any(r.get("lift_resume") for r in ranks)
    print(
        "MiB; cap: each rank's data-segment allowance beyond the rest (RLIMIT_DATA"
        + ("; lifted for load_table_shards)" if lifted else ", the resume included)")
    )
    print("expect: (table + state) / N + rest; peak: the whole job's; train: before the resume (init, steps,")
    print(
        f"checkpoint); target peak / expect <= 1.15; init, save (wall / this rank's CPU): {n0}/N of N = {n0}"
    )
    for r in rows:
        if "serve" in r:
            print(f"served: {r['table']} of {r['rows']:,} rows, generate() made {r['generated']} tokens, "
                  f"peak RSS {r['peak_mb']:.0f} MiB")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=250_000, help="rows per head (the table: 8 x rows x 32 fp32)")
    ap.add_argument("--worlds", default="1,2,3", help="world sizes, one job each (capped when > 1)")
    ap.add_argument("--cap", type=float, default=0.9,
                    help="each rank's allowance beyond the rest, as a fraction of the whole table + state")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument(
        "--folder", default=None, help="where the checkpoints and parts go (default: a temp folder)"
    )
    ap.add_argument("--lift-resume", action="store_true", help="lift the cap for load_table_shards")
    ap.add_argument("--cap-one", action="store_true", help="cap N = 1 too (it cannot fit: it must fail)")
    ap.add_argument("--verbose", action="store_true", help="each rank's data segment by stage")
    args = ap.parse_args()
    worlds = tuple(int(x) for x in args.worlds.split(","))
    rows = run(args.rows, worlds, args.cap, args.steps, args.batch, args.seq, args.folder, args.lift_resume,
               args.cap_one)  # fmt: skip
    report(rows, args.verbose)


if __name__ == "__main__":
    main()
