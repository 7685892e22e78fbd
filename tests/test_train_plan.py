"""engram.systems.train_plan and row_stats (`engram plan train`): the plan's memory and exchange against
a measured 2-rank run, its arithmetic, refusals, and the command.

The run: 2 gloo ranks train two sharded tables (one exchange) on a real text, the King James Bible
as bytes hashed through a small layout, 4 steps of 1024 tokens a rank, once per table optimizer; each
rank records its tensor bytes (shard, optimizer state, prefetched block, gradients) and the exchange
counters (engram.distributed.exchange_stats). The plan, from row statistics measured on the tokens
the run trained on (its rank batches, global batches and all its steps' tokens: the text's own
variation, up to 20 % between parts of the Bible at 1024 tokens, is the statistics' business, not the
plan's), must agree within 10 %.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engram import EngramConfig, Layout, NgramHasher
from engram.addressing.layout import layout_fingerprint
from engram.cli import main
from engram.systems.row_stats import load_row_stats, measure_row_stats, owner_bounds
from engram.systems.train_plan import TableOptimizer, TrainSetup, plan_training

CFG = EngramConfig(name="kjv-bytes", layer_ids=(1, 2), max_ngram_size=3, n_heads=4, engram_vocab_size=(20011, 20011),
                   vocab_size=256, compressed_vocab_size=256, pad_token_id=0, tokenizer=None, head_dim=16,
                   hidden_size=32, hc_mult=1)  # fmt: skip
WORLD, RANK_TOKENS, STEPS = 2, 1024, 4
OPTIMIZERS = ("adam", "adagrad", "sinkhorn", "dense-adam")
TOL = 0.10


@pytest.fixture(scope="module")
def text_rows() -> np.ndarray:
    """(tokens, layers, heads) rows of the Bible's first 400K characters as bytes."""
    from engram.apps.lm.corpus import kjv_text

    ids = np.frombuffer(kjv_text(400_000).encode(), dtype=np.uint8).astype(np.int64)
    return NgramHasher(CFG, backend="numpy").hash(ids)


def run_offset(n_tokens: int) -> int:
    return n_tokens // 3  # the run's tokens: STEPS * WORLD * RANK_TOKENS from here (the text's middle)


@pytest.fixture(scope="module")
def stats(text_rows):
    layout = Layout(CFG)
    heads = [layer.flat_primes.tolist() for layer in layout.layers]
    return measure_row_stats(text_rows, heads, layout.table_rows, config=CFG.name,
                             fingerprint=layout_fingerprint(layout), source="KJV bytes",
                             batch_tokens=(512, 1024, 2048, 4096, 8192, 16384))  # fmt: skip


def worker(rank: int, init_file: str, out: str, rows: torch.Tensor) -> None:
    import torch.distributed as dist

    from engram.distributed import ShardedTable, prefetch_tables, sync_table_grads
    from engram.distributed.exchange_stats import exchange_stats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    exchange_stats().count_served_distinct = True
    res = {}
    for name in OPTIMIZERS:
        tables = [ShardedTable(n, CFG.head_dim, seed=i) for i, n in enumerate(Layout(CFG).table_rows)]
        opt = _optimizer(name, tables)
        steps = []
        for step in range(STEPS):
            lo = (step * WORLD + rank) * RANK_TOKENS
            batch = rows[lo : lo + RANK_TOKENS]  # (tokens, layers, heads)
            before = exchange_stats().copy()
            prefetch_tables([(t, batch[:, i]) for i, t in enumerate(tables)])
            block = sum(t._block.nbytes for t in tables)  # the staged rows
            loss = sum(
                (t.gather(batch[:, i]) * (1 + batch[:, i, :, None] % 7)).sum() for i, t in enumerate(tables)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            block_grad = sum(t._block.grad.nbytes for t in tables)
            sync_table_grads(tables)
            shard_grad = sum(t.weight.grad._nnz() * t.weight.grad.shape[1] * 4 for t in tables)
            opt.step()
            counters = (exchange_stats() - before).to_dict()
            steps.append({"block": block, "block_grad": block_grad, "shard_grad": shard_grad, "x": counters})
        state = sum(v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        res[name] = {"steps": steps, "state": state, "rows": sum(t.weight.nbytes for t in tables)}
    torch.save(res, Path(out) / f"rank-{rank}.pt")
    dist.destroy_process_group()


def _optimizer(name: str, tables: list) -> torch.optim.Optimizer:
    from engram.distributed import ShardedSinkhorn
    from engram.model.optim import DenseTableAdam, SparseRowAdagrad, SparseRowAdam

    weights = [t.weight for t in tables]
    if name == "sinkhorn":
        return ShardedSinkhorn(tables)
    return {"adam": SparseRowAdam, "adagrad": SparseRowAdagrad, "dense-adam": DenseTableAdam}[name](weights)


@pytest.fixture(scope="module")
def measured(text_rows, tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("plan-run")
    off = run_offset(text_rows.shape[0])
    rows = torch.from_numpy(np.ascontiguousarray(text_rows[off : off + STEPS * WORLD * RANK_TOKENS]))
    mp.spawn(worker, args=(str(d / "init"), str(d), rows), nprocs=WORLD)
    return [torch.load(d / f"rank-{r}.pt", weights_only=False) for r in range(WORLD)]


def close(plan: float, got: float, what: str) -> None:
    assert abs(plan - got) <= TOL * got, (
        f"{what}: planned {plan:,.0f}, measured {got:,.0f} ({plan / got - 1:+.1%})"
    )


def _mean(xs) -> float:
    return float(np.mean(list(xs)))


@pytest.fixture(scope="module")
def run_stats(text_rows):
    """Row statistics of the run's own tokens, at its batch sizes: a rank's, a step's, all steps'."""
    layout = Layout(CFG)
    off = run_offset(text_rows.shape[0])
    rows = text_rows[off : off + STEPS * WORLD * RANK_TOKENS]
    heads = [layer.flat_primes.tolist() for layer in layout.layers]
    return measure_row_stats(rows, heads, layout.table_rows, config=CFG.name, fingerprint=layout_fingerprint(layout),
                             source="the run's tokens", batch_tokens=(RANK_TOKENS, WORLD * RANK_TOKENS,
                             STEPS * WORLD * RANK_TOKENS))  # fmt: skip


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_plan_matches_a_measured_two_rank_run(measured, run_stats, name):
    layout = Layout(CFG)
    stats = run_stats
    active = 1.0
    if name == "sinkhorn":  # active rows after STEPS steps: the distinct rows of their tokens, per owner
        tokens = STEPS * WORLD * RANK_TOKENS
        per_owner = np.sum([stats.owner_rows(i, tokens, WORLD) for i in range(CFG.n_layers)], axis=0)
        active = float(per_owner.max()) / sum(-(-n // WORLD) for n in layout.table_rows)
    setup = TrainSetup(WORLD * RANK_TOKENS, WORLD, name, active_share=active)
    plan = plan_training(CFG, layout.table_rows, stats, setup)
    ranks = [m[name] for m in measured]
    steps = [s for r in ranks for s in r["steps"]]
    m, x = plan.memory, plan.exchange
    close(m.rows, max(r["rows"] for r in ranks), "shard rows")
    close(m.optimizer_state, max(r["state"] for r in ranks), "optimizer state")
    close(m.staged_rows, _mean(s["block"] for s in steps), "staged rows")
    row_b = CFG.head_dim * 4
    grads = max(
        _mean(s["block_grad"] + s["x"]["rows_served"] * row_b + s["shard_grad"] for s in r["steps"])
        for r in ranks
    )
    close(m.gradients - (m.rows if name == "dense-adam" else 0), grads, "gradients")
    close(x.lookups, _mean(s["x"]["lookups"] for s in steps), "lookups")
    close(x.rows_requested, _mean(s["x"]["rows_requested"] for s in steps), "distinct rows asked")
    close(
        x.rows_served_distinct, _mean(s["x"]["rows_served_distinct"] for s in steps), "distinct rows served"
    )
    close(
        x.rows_served_max,
        max(_mean(s["x"]["rows_served"] for s in r["steps"]) for r in ranks),
        "busiest owner",
    )
    close(x.sent_total, _mean(s["x"]["sent_remote"]["total"] for s in steps), "bytes sent")
    close(x.received_total, _mean(s["x"]["received_remote"]["total"] for s in steps), "bytes received")
    for key, phase in (("sent_max", "sent_remote"), ("received_max", "received_remote")):
        busiest = max(_mean(s["x"][phase]["total"] for s in r["steps"]) for r in ranks)
        close(sum(getattr(x, key).values()), busiest, f"busiest owner's {phase}")
    close(sum(x.undeduped.values()), _mean(s["x"]["undeduped_remote"]["total"] for s in steps), "undeduped")


def test_plan_arithmetic(stats):
    """Shards, state per optimizer and the exchange's shape, from the definitions."""
    layout = Layout(CFG)
    d = CFG.head_dim
    plans = {
        o: plan_training(CFG, layout.table_rows, stats, TrainSetup(1 << 14, 4, o, param_dtype="bf16"))
        for o in TableOptimizer
    }
    shard = sum(-(-n // 4) for n in layout.table_rows)
    assert plans[TableOptimizer.ADAM].memory.rows == shard * d * 2
    assert plans[TableOptimizer.ADAM].memory.optimizer_state == shard * (4 * d + 8)
    assert plans[TableOptimizer.ADAGRAD].memory.optimizer_state == shard * 4
    assert plans[TableOptimizer.SINKHORN].memory.optimizer_state == shard * (4 * d + 8)
    # one workspace for every table (each table's step reuses it): the largest shard's rows, not their sum
    assert plans[TableOptimizer.SINKHORN].memory.optimizer_work == max(
        -(-n // 4) for n in layout.table_rows
    ) * (4 * d + 9)
    assert plans[TableOptimizer.DENSE_ADAM].memory.optimizer_state == shard * 8 * d
    x = plans[TableOptimizer.ADAM].exchange
    assert x.lookups == (1 << 12) * CFG.rows_per_token * 2
    assert x.rows_requested < x.lookups and x.rows_served_max >= x.rows_served
    assert sum(x.undeduped.values()) > x.sent_total
    # bytes double from bf16 to fp32 (the counts phase aside); time falls with the link's bandwidth
    fp32 = plan_training(CFG, layout.table_rows, stats, TrainSetup(1 << 14, 4, link_gbps=100.0))
    assert fp32.exchange.sent["rows"] == pytest.approx(2 * x.sent["rows"])
    assert fp32.exchange.seconds < x.seconds
    # table ranks: 2 owners of 4 ranks hold twice the rows and serve twice as many
    owners2 = plan_training(
        CFG, layout.table_rows, stats, TrainSetup(1 << 14, 4, table_ranks=2, param_dtype="bf16")
    )
    assert owners2.memory.rows == sum(-(-n // 2) for n in layout.table_rows) * d * 2
    assert owners2.exchange.rows_served == pytest.approx(2 * x.rows_served)


def test_owner_rows_follow_the_heads_and_sum_to_the_batch(stats):
    """A 2-gram head's block is asked for fewer distinct rows than a 3-gram head's: the owner of the first
    half of a table (the 2-gram heads) gets fewer; every owner split sums to the batch's distinct rows."""
    for owners in (1, 2, 3, 7):
        split = stats.owner_rows(0, 1024, owners)
        assert split.sum() == pytest.approx(stats.distinct(0, 1024))
    two = stats.owner_rows(0, 1024, 2)
    assert two[0] < two[1]
    assert list(owner_bounds(10, 3)) == [0, 3, 6, 10]
    # the distinct share falls as the batch grows; interpolation stays between the measured points
    assert stats.distinct(0, 2048) / 2048 < stats.distinct(0, 1024) / 1024
    assert stats.distinct(0, 1024) < stats.distinct(0, 1500) < stats.distinct(0, 2048)


def test_row_stats_file_round_trip_and_refusals(stats, tmp_path):
    f = tmp_path / "stats.json"
    stats.save(f)
    assert load_row_stats(f, stats.fingerprint) == stats
    with pytest.raises(ValueError, match="another layout"):
        load_row_stats(f, "0" * 64)
    f.write_text("{}")
    with pytest.raises(ValueError, match="not a row statistics file"):
        load_row_stats(f)
    with pytest.raises(ValueError, match="fewer than the smallest batch"):
        measure_row_stats(
            np.zeros((10, 1, 2), np.int64), [[5, 5]], [10], config="c", fingerprint="f", source="s"
        )


def test_sinkhorn_steps_give_the_active_rows_of_that_many_batches(stats):
    """With the run's steps, Sinkhorn's active rows are the distinct rows of that many global batches on
    the fullest owner (at most its shard); the workspace in use is the largest table's active rows."""
    layout = Layout(CFG)
    d, w, tokens = CFG.head_dim, 2, 2048
    shard = [-(-n // w) for n in layout.table_rows]
    for steps in (1, 3, 40):
        plan = plan_training(CFG, layout.table_rows, stats, TrainSetup(tokens, w, "sinkhorn", steps=steps))
        per = np.stack([stats.owner_rows(i, steps * tokens, w) for i in range(CFG.n_layers)], axis=1)
        per = np.minimum(per, shard)
        active = [int(np.ceil(x)) for x in per[int(np.argmax(per.sum(axis=1)))]]
        assert plan.memory.optimizer_state == sum(active) * (4 * d + 8), steps
        assert plan.memory.optimizer_work == max(active) * (4 * d + 9), steps
        assert any("up to 1.5x" in note for note in plan.notes)
    # a long run: every row of the shard active (each owner asked for at most its range)
    long = plan_training(CFG, layout.table_rows, stats, TrainSetup(tokens, w, "sinkhorn", steps=100_000))
    assert long.memory.optimizer_state == sum(shard) * (4 * d + 8)
    assert stats.distinct(0, 1e12) == sum(stats.head_rows[0])


@pytest.mark.parametrize(
    ("kw", "needles"),
    [
        ({"steps": 0}, ["steps=0", ">= 1"]),
        ({"steps": 5, "active_share": 0.5}, ["steps=5", "active_share=0.5", "one of them"]),
        ({"ranks": 0}, ["ranks=0", ">= 1"]),
        ({"tokens_per_step": 0}, ["tokens_per_step=0", ">= 1"]),
        ({"optimizer": "sgd"}, ["'sgd'", "adam, adagrad, sinkhorn, dense-adam"]),
        ({"link_gbps": 0.0}, ["link_gbps=0.0", "> 0"]),
        ({"link_gbps": -5.0}, ["link_gbps=-5.0", "> 0"]),
        ({"link_gbps": float("nan")}, ["link_gbps=nan"]),
        ({"table_ranks": 9}, ["table_ranks=9", "[1, 8]"]),
        ({"param_dtype": "fp8"}, ["param_dtype='fp8'", "fp32"]),
        ({"active_share": 0.0}, ["active_share=0.0", "(0, 1]"]),
    ],
)
def test_bad_setups_are_refused_naming_value_and_fix(kw, needles):
    args = {"tokens_per_step": 1024, "ranks": 8} | kw
    with pytest.raises(ValueError) as e:
        TrainSetup(**args)
    for n in needles:
        assert n in str(e.value)


def _tiny_stats(path: Path) -> None:
    """Row statistics of the tiny preset from made-up Zipf rows (no tokenizer needed)."""
    tiny = EngramConfig.preset("tiny")
    layout = Layout(tiny)
    heads = [layer.flat_primes.tolist() for layer in layout.layers]
    g = np.random.default_rng(0)
    starts = np.concatenate([[0], np.cumsum(heads[0])[:-1]])
    rows = (g.zipf(1.3, size=(20_000, 1, len(heads[0]))) % np.array(heads[0]) + starts).astype(np.int64)
    measure_row_stats(rows, heads, layout.table_rows, config=tiny.name, fingerprint=layout_fingerprint(layout),
                      source="made-up", batch_tokens=(256, 1024, 4096)).save(path)  # fmt: skip


def test_cli_plan_train(tmp_path, capsys):
    f = tmp_path / "tiny.json"
    _tiny_stats(f)
    argv = ["plan", "train", "--preset", "tiny", "--row-stats", str(f), "--tokens-per-step", "8Ki",
            "--ranks", "2", "4", "--optimizer", "dense-adam", "sinkhorn"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(p["setup"]["ranks"], p["setup"]["optimizer"]) for p in out["plans"]] == [
        (2, "dense-adam"), (2, "sinkhorn"), (4, "dense-adam"), (4, "sinkhorn")]  # fmt: skip
    tiny = EngramConfig.preset("tiny")
    want = plan_training(tiny, Layout(tiny).table_rows, load_row_stats(f), TrainSetup(8192, 4, "sinkhorn"))
    assert out["plans"][3]["memory"]["total"] == want.memory.total
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "dense-adam" in text and "sinkhorn" in text and "made-up" in text
    assert "note: the global batch (8,192 tokens) is longer than the largest batch measured" in text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--ranks", "0"], "ranks=0"),
        (["--ranks", "8", "--optimizer", "sgd"], "optimizer='sgd' is not a table optimizer"),
        (["--ranks", "8", "--link-gbps", "0"], "link_gbps=0.0"),
        (["--ranks", "8", "--link-gbps", "-1"], "link_gbps=-1.0"),
    ],
)
def test_cli_refuses_bad_setups_in_one_line(tmp_path, capsys, extra, needle):
    """Refused before any text is measured (no --row-stats file: the Bible would be hashed)."""
    argv = ["plan", "train", "--preset", "tiny", "--tokens-per-step", "1Mi", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram plan: error: ") and needle in err and "Traceback" not in err


def test_cli_refuses_stats_of_another_layout(tmp_path, capsys):
    f = tmp_path / "tiny.json"
    _tiny_stats(f)
    assert main(["plan", "train", "--preset", "demo-v1", "--row-stats", str(f), "--tokens-per-step", "1Ki",
                 "--ranks", "2"]) == 2  # fmt: skip
    assert "row statistics of another layout" in capsys.readouterr().err


def test_plan_memory_kept_beside_plan_train():
    from engram.cli import build_parser
    from engram.cli.systems import cmd_plan_memory

    p = build_parser()
    common = ["--preset", "tiny", "--hbm", "1MB", "--dram", "10MB", "--tokens-per-s", "100"]
    assert p.parse_args(["plan-memory", *common]).func is cmd_plan_memory
    assert p.parse_args(["plan", "memory", *common]).func is cmd_plan_memory
