from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import training_setup
from cli_setup import CPU
from engram.addressing.hashing import NgramHasher
from engram.apps.lm.generate import MIN_TEMPERATURE, generate, load_generator
from engram.apps.lm.train import Trainer, build_model, prepare_data
from engram.model.lm import EngramLM

SEQ = 32


def tiny_cfg(corpus: str, **kw):
    """tests/training_setup.py's config, trained for 3 steps without evaluation."""
    return training_setup.tiny_cfg(corpus, **({"steps": 3, "warmup": 1, "eval_every": 0} | kw))


@pytest.fixture(scope="module")
def data(corpus):
    return prepare_data(tiny_cfg(corpus))


@pytest.fixture(scope="module")
def hasher(data) -> NgramHasher:
    return NgramHasher(data.engram_config, data.compression)


@pytest.fixture(scope="module")
def model(corpus, data) -> EngramLM:
    """An untrained Engram model with an untied head, weights large enough that its greedy choices
    vary and depend on Engram (whose output is made non-zero): rows and masking must matter."""
    config = dataclasses.replace(
        build_model(tiny_cfg(corpus, tie_embeddings=False), data).config, init_std=0.2
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        m = EngramLM(config)
        with torch.no_grad():
            for module in m.engrams.values():
                module.wkv.weight.normal_()
    return m.eval()


def prompt(data, n: int) -> np.ndarray:
    return data.held_out.ids[100 : 100 + n].copy()


def reference_greedy(model, hasher, ids, n, engram_scale=1.0) -> list[int]:
    """The plain twin: re-hash the whole text every step, run the last max_seq_len tokens."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            rows = torch.from_numpy(hasher.hash(np.array(seq)))[None, -SEQ:]
            x = torch.tensor(seq)[None, -SEQ:]
            seq.append(int(model(x, rows, engram_scale=engram_scale)[0, -1].argmax()))
    return seq


# ---------------------------------------------------------------------------- core loop
@pytest.mark.parametrize("n_prompt", [45, 5])  # 45 > max_seq_len: the window slides from the start
def test_stream_rows_equal_whole_sequence_hash(model, hasher, data, n_prompt):
    out = generate(model, prompt(data, n_prompt), hasher, max_new_tokens=30, batch_size=3, seed=0)
    assert out.token_ids.shape == (3, n_prompt + 30) and out.rows.shape == (3, n_prompt + 30, 1, 4)
    assert len({tuple(s) for s in out.new_ids.tolist()}) == 3  # the sequences differ: each has its stream
    for b in range(3):
        np.testing.assert_array_equal(out.rows[b].numpy(), hasher.hash(out.token_ids[b].numpy()))


@pytest.mark.parametrize("n_prompt", [40, 3])
def test_greedy_equals_reference_loop(model, hasher, data, n_prompt):
    ids = prompt(data, n_prompt)
    out = generate(model, ids, hasher, max_new_tokens=20, greedy=True, batch_size=2)
    ref = reference_greedy(model, hasher, ids, 20)
    assert out.token_ids.tolist() == [ref, ref]
    assert len(set(ref[n_prompt:])) > 1  # not a degenerate repetition of one token
    # temperature 0 is greedy too, and the seed does not matter then
    again = generate(model, ids, hasher, max_new_tokens=20, temperature=0, seed=5)
    assert again.token_ids[0].tolist() == ref


def test_seeded_sampling_is_reproducible(model, hasher, data):
    ids = prompt(data, 10)
    runs = [generate(model, ids, hasher, max_new_tokens=16, seed=s).new_ids for s in (0, 0, 1)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    hot = generate(model, ids, hasher, max_new_tokens=16, seed=0, temperature=5.0).new_ids
    assert not torch.equal(runs[0], hot)


def test_top_k_one_is_greedy(model, hasher, data):
    ids = prompt(data, 10)
    greedy = generate(model, ids, hasher, max_new_tokens=12, greedy=True).new_ids
    assert torch.equal(generate(model, ids, hasher, max_new_tokens=12, top_k=1, seed=3).new_ids, greedy)
    assert not torch.equal(generate(model, ids, hasher, max_new_tokens=12, top_k=50, seed=3).new_ids, greedy)


def test_mask_engram_is_the_baseline(model, hasher, data):
    ids = prompt(data, 40)
    base = EngramLM(model.config.without_engram())
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("engrams.")})
    plain = generate(base, ids, max_new_tokens=20, greedy=True)  # a baseline needs no hasher
    assert plain.rows is None
    masked = generate(model, ids, hasher, max_new_tokens=20, greedy=True, engram_scale=0.0)
    on = generate(model, ids, hasher, max_new_tokens=20, greedy=True)
    assert torch.equal(masked.token_ids, plain.token_ids)
    assert not torch.equal(on.token_ids, masked.token_ids)
    assert masked.token_ids[0].tolist() == reference_greedy(model, hasher, ids, 20, engram_scale=0.0)


def test_generate_errors(model, hasher, data):
    ids = prompt(data, 5)
    cases = [
        (dict(max_new_tokens=0), "tokens=0"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature=-1.0"),
        (dict(max_new_tokens=4, temperature=float("nan")), "temperature=nan"),
        (dict(max_new_tokens=4, top_k=0), "top_k=0"),
        (dict(max_new_tokens=4, batch_size=0), "batch_size=0"),
        # a tiny temperature overflows logits / T (1e-30: every finite logit gap is infinite)
        (
            dict(max_new_tokens=4, temperature=1e-30),
            r"temperature=1e-30 must be 0 or a finite number >= 0\.001",
        ),
        (
            dict(max_new_tokens=4, top_k=100_000_000),
            "top_k=100000000 is more than the model's vocabulary of 512",
        ),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            generate(model, ids, hasher, **kw)
    # the bounds themselves are taken: the smallest temperature, k = the whole vocabulary
    low = generate(model, ids, hasher, max_new_tokens=4, temperature=MIN_TEMPERATURE, top_k=512)
    assert low.new_ids.shape == (1, 4)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [], hasher, max_new_tokens=4)
    with pytest.raises(ValueError, match="512"):  # an id outside the vocabulary, named
        generate(model, [1, 512], hasher, max_new_tokens=4)
    with pytest.raises(ValueError, match="NgramHasher"):
        generate(model, ids, None, max_new_tokens=4)
    base = EngramLM(model.config.without_engram())
    with pytest.raises(ValueError, match="no Engram layers"):
        generate(base, ids, max_new_tokens=4, engram_scale=0.0)


# ---------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def runs(corpus, data, tmp_path_factory) -> dict[str, str]:
    """Checkpoints of 3-step runs: with Engram and the baseline."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, engram in (("engram", True), ("baseline", False)):
        cfg = tiny_cfg(corpus) if engram else tiny_cfg(corpus, engram=None)
        Trainer(cfg, data, build_model(cfg, data), out_dir=root / name).run()
        out[name] = str(root / name)
    # rows 32 wide (FP8 rows hold whole blocks of 32 values with one ue8m0 scale): for --offload
    cfg = tiny_cfg(corpus, engram_kw={"head_dim": 32})
    wide = prepare_data(cfg)
    Trainer(cfg, wide, build_model(cfg, wide), out_dir=root / "fp8able").run()
    out["fp8able"] = str(root / "fp8able")
    return out


@pytest.fixture
def main():
    """engram.cli.main (which registers `generate`) on the CPU (cli_setup.CPU), where the tokens it is
    compared with are generated."""
    from engram.cli import main

    return lambda argv: main([*argv, *CPU])


def test_cli_json(main, runs, data, capsys):
    text = "In the beginning God created the heaven and the earth. " * 3  # > 32 tokens
    argv = ["generate", "--checkpoint", runs["engram"], "--prompt", text, "--tokens", "12", "--json"]
    assert main([*argv, "--greedy"]) == 0
    res = json.loads(capsys.readouterr().out)
    model, tok, hasher, _ = load_generator(runs["engram"])
    prompt_ids = tok.encode(text, add_special_tokens=False).ids
    assert res["prompt"] == text and res["prompt_ids"] == prompt_ids and len(prompt_ids) > SEQ
    assert res["engram"] == "on" and res["greedy"] and res["step"] == 3 and res["tokens_per_s"] > 0
    direct = generate(model, prompt_ids, hasher, max_new_tokens=12, greedy=True)
    assert res["token_ids"] == direct.new_ids.tolist()
    assert res["text"] == [tok.decode(res["token_ids"][0], skip_special_tokens=False)]
    # the checkpoint's hasher hashes as training did
    ids = data.held_out.ids[:300]
    np.testing.assert_array_equal(hasher.hash(ids), data.held_rows[:300].numpy())

    assert main([*argv, "--seed", "1", "--batch", "2", "--top-k", "20"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*argv, "--seed", "1", "--batch", "2", "--top-k", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == a["token_ids"]
    assert len(a["token_ids"]) == 2 and all(len(s) == 12 for s in a["token_ids"])
    assert main([*argv, "--greedy", "--mask-engram"]) == 0
    assert json.loads(capsys.readouterr().out)["engram"] == "masked"


def test_cli_human_and_baseline(main, runs, capsys):
    assert (
        main(["generate", "--checkpoint", runs["baseline"], "--prompt", "And God said", "--tokens", "8"]) == 0
    )
    out, err = capsys.readouterr()
    assert out.startswith("And God said") and "tokens/s" in err and "engram none" in err
    argv = ["generate", "--checkpoint", runs["engram"], "--prompt", "And", "--tokens", "4", "--batch", "2"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count("--- sequence") == 2 and "engram on" in err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--checkpoint", "{missing}", "--prompt", "x"], "no such folder"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x", "--temperature", "-1"], "temperature=-1.0"),
        (
            ["--prompt", "x", "--temperature", "1e-30"],
            "temperature=1e-30 must be 0 or a finite number >= 0.001",
        ),
        (
            ["--prompt", "x", "--top-k", "100000000"],
            "top_k=100000000 is more than the model's vocabulary of 512",
        ),
        (["--checkpoint", "{baseline}", "--prompt", "x", "--mask-engram"], "no Engram modules to mask"),
        (["--checkpoint", "{baseline}", "--prompt", "x", "--offload", "host"], "has none; drop --offload"),
        (["--prompt", "x", "--cache-rows", "8"], "add --offload host|ssd"),
        (["--prompt", "x", "--offload", "host", "--cache-rows", "100000"], "--cache-rows 100000: more rows"),
    ],
)
def test_cli_errors(main, runs, tmp_path, capsys, args, match):
    subs = {"{missing}": str(tmp_path / "nope"), "{baseline}": runs["baseline"]}
    args = [subs.get(a, a) for a in args]
    if "--checkpoint" not in args:
        args = ["--checkpoint", runs["engram"], *args]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram generate: error: ") and match in err


@pytest.mark.parametrize(
    ("option", "value"),
    [("--tokens", "0"), ("--tokens", "1000001"), ("--top-k", "0"), ("--batch", "0"), ("--cache-rows", "-1")],
)
def test_cli_refuses_numbers_when_parsing(main, runs, capsys, option, value):
    """Out-of-range counts are argparse's to refuse, before the checkpoint is read: usage, then one line."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "--checkpoint", runs["engram"], "--prompt", "x", option, value])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"engram generate: error: argument {option}: {value} is out of range")


@pytest.mark.parametrize("where", ["host", "ssd"])
def test_cli_offload_equals_fp8_tables(main, runs, capsys, tmp_path, where):
    """--offload serves the tables as FP8 through engram.systems: the tokens are those of the same model
    with its tables quantised in place (FP8Table.from_float), and the counters add up."""
    from engram.model.table import FP8Table

    text = "And God said, Let there be light"
    argv = ["generate", "--checkpoint", runs["fp8able"], "--prompt", text, "--tokens", "10", "--greedy"]
    extra = ["--offload-dir", str(tmp_path)] if where == "ssd" else []
    assert main([*argv, "--json", "--offload", where, "--cache-rows", "64", *extra]) == 0
    res = json.loads(capsys.readouterr().out)
    model, tok, hasher, _ = load_generator(runs["fp8able"])
    for m in model.engrams.values():
        m.table = FP8Table.from_float(m.table.weight)
    prompt_ids = tok.encode(text, add_special_tokens=False).ids
    direct = generate(model, prompt_ids, hasher, max_new_tokens=10, greedy=True)
    assert res["token_ids"] == direct.new_ids.tolist()
    (stats,) = res["offload"].values()
    assert stats["placement"] == where and stats["gathers"] == 10
    assert stats["cache_hits"] + stats["cache_misses"] == stats["rows_distinct"] > 0
    assert stats["bytes_fetched"] == stats["cache_misses"] * (32 + 1)  # 32 FP8 values + 1 scale a row
    if where == "ssd":
        assert list(tmp_path.glob("engram_layer*.safetensors"))
    assert main([*argv, "--offload", where, *extra]) == 0
    assert "table on " + where in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kw", "expect"),
    [
        (
            {"engram_mode": "input-embedding", "engram_kw": {"head_dim": 16}},
            None,
        ),  # rows feed the input embedding, not a module
        ({"compression": False}, None),  # the run hashed raw ids: the hasher must too
        ({"row_hash": "random"}, "row_hash='random'"),  # a study control: refused, not silently wrong
    ],
)
def test_cli_study_variants(main, corpus, tmp_path, capsys, kw, expect):
    """Checkpoints of the studies' variants: generation hashes as training did, or refuses."""
    cfg = tiny_cfg(corpus, **kw)
    bundle = prepare_data(cfg)
    Trainer(cfg, bundle, build_model(cfg, bundle), out_dir=tmp_path / "run").run()
    args = [
        "generate",
        "--checkpoint",
        str(tmp_path / "run"),
        "--prompt",
        "And God",
        "--tokens",
        "3",
        "--json",
    ]
    code = main(args)
    captured = capsys.readouterr()
    if expect is None:
        assert code == 0, captured.err
        assert [len(s) for s in json.loads(captured.out)["token_ids"]] == [3]
        _, _, hasher, _ = load_generator(tmp_path / "run")
        assert np.array_equal(hasher.compression.lookup, bundle.compression.lookup)
    else:
        assert code == 2 and expect in captured.err
