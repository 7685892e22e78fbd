"""benchmarks/bench_hf_pretrained.py runs end to end on a tiny HF folder and reports what it promises."""

from __future__ import annotations

import pytest
import torch

import hf_setup as S

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(S.save_folder(tmp_path_factory.mktemp("bench") / "tiny", layers=3))


def test_main_on_a_tiny_folder(folder, capsys) -> None:
    from engram.benchmarks import bench_hf_pretrained as bench

    args = ["--folder", folder, "--batch", "2", "--seq", "16", "--repeats", "1", "--prompt", "8"]
    assert bench.main([*args, "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "train step, backbone frozen / plain's" in out and "Engram (frozen) / LoRA alone" in out
    assert "generate() per token / plain's" in out and "bytes per table parameter" in out


def test_rows(folder) -> None:
    from engram.benchmarks import bench_hf_pretrained as bench

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = bench.run(
            folder, batch=2, seq=16, repeats=1, prompt=8, new_tokens=3, lora=False, progress=False
        )
        assert torch.get_num_threads() == 2  # the run's one thread not left behind
    finally:
        torch.set_num_threads(threads)
    ratios = [r for r in rows if "ratio" in r]
    assert [r.get("target") for r in ratios] == [1.15, 1.10]  # no LoRA row
    assert all(r["ratio"] > 0 and r["seconds"] > 0 and r["cpu_ratio"] > 0 for r in ratios)
    mem = next(r for r in rows if r["op"] == "memory")
    n, b = mem["table_parameters"], mem["bytes"]
    assert b["tables"] == 4 * n  # float32 tables, counted tensor by tensor
    # SparseRowAdam: a float32 momentum per value, a second moment and a step per row (rows of 32)
    assert b["table_optimizer_state"] == n * (4 + 8 / 32)
    assert mem["inference_bytes_per_table_param"] > 4
    assert mem["training_held_bytes_per_table_param"] > mem["inference_bytes_per_table_param"] + 4
    assert b["staged_rows"] == 2 * 16 * 1 * 8 * 8  # (B, T, layers, 4 heads x 2 orders) int64
    assert b["table_sparse_grads"] > 0 and b["saved_activations_engram"] > b["saved_activations_plain"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--folder", "/nonexistent/model"], "/nonexistent/model: no such folder"),
        (["--batch", "0"], "--batch 0: give a whole number >= 1"),
        (["--new-tokens", "1"], "--new-tokens 1: give a whole number >= 2"),
    ],
)
def test_bad_input(folder, capsys, args, message) -> None:
    from engram.benchmarks import bench_hf_pretrained as bench

    full = args if args[0] == "--folder" else ["--folder", folder, *args]
    assert bench.main(full) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_two_clocks_alternate_the_order() -> None:
    from engram.benchmarks.bench_hf_pretrained import best_times_two_clocks

    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "ab"}
    wall, cpu = best_times_two_clocks(fns, 3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then a round each way
    assert set(wall) == set(cpu) == {"a", "b"} and all(0 <= t < 1 for t in (*wall.values(), *cpu.values()))


def test_switch_off_is_the_plain_model() -> None:
    """The plain arm runs the Engram model with its hooks removed: exactly the model without Engram."""
    from engram.benchmarks.bench_hf_pretrained import EngramSwitch
    from engram.hf import add_engram

    model = add_engram(S.llama(seed=4), S.engram_config(), compression=S.compression())
    with torch.no_grad():  # a trained-looking Engram: it changes the logits
        model.engram.module(1).wkv.weight.normal_(std=0.5)
    plain, x = S.llama(seed=4), S.batch()
    norm = model.model.layers[1].input_layernorm.weight
    switch, hooks = EngramSwitch(model, [norm]), len(model.engram.handles)
    with torch.no_grad():
        switch(False)
        assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits) and norm.requires_grad
        switch(True)
        switch(True)  # on twice: the hooks installed once
        assert len(model.engram.handles) == hooks and not norm.requires_grad
        assert not torch.allclose(model(input_ids=x).logits, plain(input_ids=x).logits)
