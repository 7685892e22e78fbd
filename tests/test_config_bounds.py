"""Issue 46, items 1 and 2: every size a config holds is checked against a stated bound (engram.config's
MAX_* constants, train_config's, hf settings') or against what it costs, before any work; every float
field is finite and in range (NaN passes `<= 0`). Each refusal is one line naming the value and the
bound, in well under a second, and a refused command leaves no folder behind. Also: the prime search's
skip pointers give the primes of the plain search (its reference twin here)."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_setup import CPU, refused
from engram import config as C
from engram.addressing.layout import Layout, find_head_primes
from engram.apps.hf.settings import HFTrainSettings
from engram.apps.lm.train_config import TrainConfig
from engram.apps.study.pretrained import PretrainedPlan
from engram.checkpoint.hf_config import from_hf_dict, to_hf_dict
from engram.config import EngramConfig

V41 = EngramConfig.preset("deepseek-v4.1")
NON_FINITE = (math.nan, math.inf, -math.inf)


def fast_refusal(call, pattern: str, kind: type[Exception] = ValueError) -> str:
    """`call()` raises `kind` matching `pattern` in under a second (no prime search, no allocation)."""
    t = time.perf_counter()
    with pytest.raises(kind, match=pattern) as e:
        call()
    assert time.perf_counter() - t < 1.0
    return str(e.value)


# ------------------------------------------------------------------------------------------- EngramConfig sizes
@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"n_heads": 10**9}, r"n_heads=1000000000: give 1 to 64 .*MAX_HEADS"),
        ({"n_heads": 65}, r"n_heads=65: give 1 to 64"),
        ({"max_ngram_size": 10**6}, r"max_ngram_size=1000000: .*give 2 to 16 \(MAX_NGRAM_SIZE"),
        ({"max_ngram_size": 10**12}, r"max_ngram_size=1000000000000"),  # never expands 10^12 bases
        ({"max_ngram_size": 17}, r"max_ngram_size=17"),
        ({"head_dim": 10**6}, r"head_dim=1000000: give 1 to 4,096 \(MAX_HEAD_DIM\)"),
        ({"hidden_size": 10**9}, r"hidden_size=1000000000: give 1 to 65,536 \(MAX_HIDDEN_SIZE\)"),
        ({"hc_mult": 10**4}, r"hc_mult=10000: give 1 to 64 \(MAX_HC_MULT\)"),
        ({"kernel_size": 10**4}, r"kernel_size=10000: give 1 to 64 \(MAX_KERNEL_SIZE\)"),
        ({"vocab_size": 10**9}, r"vocab_size=1000000000: give 1 to 16,777,216 \(MAX_VOCAB_SIZE\)"),
        ({"table_rows_multiple": 10**9}, r"table_rows_multiple=1000000000: .*MAX_TABLE_ROWS_MULTIPLE"),
        ({"layer_ids": (1, 10**9)}, r"layer 1000000000: give layer ids from 0 to 1023 \(MAX_LAYER_ID\)"),
        ({"engram_vocab_size": (10**15,) * 3}, r"rows a layer, over 68,719,476,736 \(MAX_LAYER_ROWS"),
        (
            {"n_heads": 64, "head_dim": 4096},
            r"3 \* 64 \* 4096 = 786,432 values, over 65,536 \(MAX_ENGRAM_DIM",
        ),
        (
            {"layer_ids": tuple(range(1024)), "n_heads": 8, "engram_vocab_size": (1000,) * 3, "head_dim": 8},
            r"1024 \* 3 \* 8 = 24,576 primes to search, over 16,384 \(MAX_PRIMES",
        ),
    ],
)
def test_absurd_sizes_refused_at_once(changes, pattern):
    fast_refusal(lambda: V41.replace(**changes), pattern)


@pytest.mark.parametrize("field", ["n_heads", "max_ngram_size", "head_dim", "hidden_size"])
def test_layout_of_an_absurd_config_never_starts(field):
    """`Layout(config)` searched 10^9 heads' primes for minutes: the config it takes refuses first."""
    fast_refusal(lambda: Layout(V41.replace(**{field: 10**9})), f"{field}=1000000000")


def test_bounds_are_generous_for_real_models():
    """The presets, and layouts well past them (many layers, all orders, wide rows), build in seconds."""
    for cfg in C.PRESETS.values():
        Layout(cfg)
    big = V41.replace(layer_ids=tuple(range(0, 1024, 2)), n_heads=8, max_ngram_size=5, head_dim=512)
    assert big.n_layers * big.rows_per_token == C.MAX_PRIMES
    t = time.perf_counter()
    assert len(Layout(big).layers) == 512
    assert time.perf_counter() - t < 30  # about a second on an idle core


def test_hf_config_sizes_refused(tmp_path):
    d = to_hf_dict(V41)
    fast_refusal(lambda: from_hf_dict({**d, "engram_n_heads": 10**9}), "n_heads=1000000000")
    fast_refusal(lambda: from_hf_dict({**d, "engram_max_ngram_size": 10**6}), "max_ngram_size=1000000")


# ------------------------------------------------------------------------------------------- the prime search
def reference_primes(config: EngramConfig) -> dict[int, tuple[tuple[int, ...], ...]]:
    """The plain search of SPEC §3: one nextprime per prime walked over, taken or not."""
    seen: set[int] = set()
    out = {}
    for layer_id in config.layer_ids:
        per_order = []
        for base in config.engram_vocab_size:
            c, heads = base - 1, []
            for _ in range(config.n_heads):
                p = int(sympy.nextprime(c))
                while p in seen:
                    p = int(sympy.nextprime(p))
                seen.add(p)
                heads.append(p)
                c = p
            per_order.append(tuple(heads))
        out[layer_id] = tuple(per_order)
    return out


@settings(max_examples=60, deadline=None)
@given(
    layers=st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
    n=st.integers(2, 5),
    heads=st.integers(1, 6),
    bases=st.lists(st.integers(2, 120), min_size=4, max_size=4),
)
def test_prime_search_equals_the_plain_search(layers, n, heads, bases):
    """Overlapping bases (every layer restarting below primes earlier ones took) give the same primes."""
    cfg = EngramConfig(
        layer_ids=tuple(layers), max_ngram_size=n, n_heads=heads, engram_vocab_size=tuple(bases[: n - 1]),
        head_dim=8, tokenizer=None,
    )  # fmt: skip
    assert find_head_primes(cfg) == reference_primes(cfg)


def test_prime_search_of_v41_is_unchanged():
    assert find_head_primes(V41) == reference_primes(V41)


def test_many_layers_of_one_base_are_not_quadratic():
    """1000 layers x 15 orders x 1 head of one base: 15,000 primes (the plain search walked 10^8)."""
    cfg = V41.replace(layer_ids=tuple(range(1000)), max_ngram_size=16, n_heads=1, head_dim=8)
    t = time.perf_counter()
    primes = find_head_primes(cfg)
    assert time.perf_counter() - t < 30  # under a second on an idle core
    flat = [p for per_order in primes.values() for order in per_order for p in order]
    assert len(set(flat)) == 15_000 and min(flat) == sympy.nextprime(16_000_000 - 1)


# ------------------------------------------------------------------------------------------- floats
@pytest.mark.parametrize("field", ["norm_eps", "gate_clamp"])
@pytest.mark.parametrize("value", [*NON_FINITE, 0.0, -1e-6, 2.0])
def test_eps_out_of_range_refused(field, value):
    fast_refusal(lambda: V41.replace(**{field: value}), rf"{field}={value!r} is out of range: .*\(0, 1\]")


@pytest.mark.parametrize("field", ["norm_eps", "gate_clamp"])
def test_eps_must_be_a_number(field):
    fast_refusal(lambda: V41.replace(**{field: "1e-6"}), f"{field} must be a number", TypeError)
    fast_refusal(lambda: V41.replace(**{field: True}), f"{field} must be a number", TypeError)


def test_eps_in_range_kept_as_float():
    c = V41.replace(norm_eps=1, gate_clamp=1e-30)
    assert c.norm_eps == 1.0 and isinstance(c.norm_eps, float) and c.gate_clamp == 1e-30


@pytest.mark.parametrize(
    ("key", "value"),
    [("engram_norm_eps", math.inf), ("engram_norm_eps", math.nan), ("engram_gate_clamp", math.nan),
     ("engram_gate_clamp", -1.0), ("engram_norm_eps", "small")],
)  # fmt: skip
def test_hf_keys_non_finite_refused(key, value):
    """from_hf_dict accepted engram_norm_eps=inf: refused, naming the config.json key."""
    with pytest.raises((ValueError, TypeError), match=key):
        from_hf_dict({**to_hf_dict(V41), key: value})


@pytest.mark.parametrize("value", NON_FINITE)
def test_qwen4_exp_rms_norm_eps_refused(value):
    d = to_hf_dict(C.PRESETS["qwen4-exp-tiny"])
    with pytest.raises(ValueError, match=f"rms_norm_eps={value!r}"):
        EngramConfig.from_hf_config({**d, "rms_norm_eps": value})


# NaN of other payloads and signs too: a check that compares, not one that looks for math.nan itself
ANY_NON_FINITE = st.sampled_from(
    [math.nan, -math.nan, math.inf, -math.inf, struct.unpack("<d", b"\x01\0\0\0\0\0\xf8\x7f")[0]]
)


@given(ANY_NON_FINITE)
def test_any_non_finite_float_refused_by_every_config(x):
    """Every float field of EngramConfig, TrainConfig, HFTrainSettings and PretrainedPlan refuses it."""
    assert not math.isfinite(x)
    for field in ("norm_eps", "gate_clamp"):
        with pytest.raises(ValueError, match=field):
            V41.replace(**{field: x})
    for field in ("lr", "table_lr", "min_lr_ratio", "weight_decay", "grad_clip", "moe_aux_coef"):
        with pytest.raises(ValueError, match=field):
            TrainConfig(**{field: x})
    with pytest.raises(ValueError, match="embedding_lr"):
        TrainConfig(embedding_optimizer="sinkhorn", embedding_lr=x)
    for field in ("lr", "table_lr", "held_out"):
        with pytest.raises(ValueError, match=field.replace("_", "-")):
            HFTrainSettings(folder="m", corpus="c", out="o", **{field: x})
    for field in ("lora_lr", "full_lr", "engram_lr", "table_lr"):
        with pytest.raises(ValueError, match=field):
            PretrainedPlan(**{field: x})
    with pytest.raises(ValueError, match="pilot_factors"):
        PretrainedPlan(pilot_factors=(1.0, x))


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_eps_accepted_exactly_in_range(x):
    """Any float: accepted as norm_eps / gate_clamp exactly when finite and in (0, 1]."""
    ok = math.isfinite(x) and 0 < x <= 1
    for field in ("norm_eps", "gate_clamp"):
        if ok:
            assert getattr(V41.replace(**{field: x}), field) == x
        else:
            with pytest.raises(ValueError, match=f"{field}="):
                V41.replace(**{field: x})


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_learning_rates_accepted_exactly_when_finite_and_positive(x):
    ok = math.isfinite(x) and x > 0
    for make in (
        lambda: TrainConfig(lr=x),
        lambda: HFTrainSettings(folder="m", corpus="c", out="o", table_lr=x),
        lambda: PretrainedPlan(engram_lr=x),
    ):
        if ok:
            make()
        else:
            with pytest.raises(ValueError, match="lr"):
                make()


@given(st.floats(min_value=1e-300, max_value=1.0))
def test_any_eps_in_range_accepted(x):
    assert V41.replace(norm_eps=x, gate_clamp=x).norm_eps == x


def test_forward_finite_with_the_smallest_eps():
    """The NaN of issue 46 came from eps = NaN; the smallest eps accepted keeps the forward finite."""
    import torch

    from engram.model.module import Engram

    cfg = C.PRESETS["tiny"].replace(norm_eps=1e-30, gate_clamp=1e-30, tokenizer=None)
    m = Engram(cfg, layer_id=cfg.layer_ids[0])
    h = torch.randn(1, 5, cfg.hc_mult, cfg.hidden_size)
    rows = torch.randint(0, 100, (1, 5, cfg.rows_per_token))
    assert torch.isfinite(m(h, rows)).all()


# ------------------------------------------------------------------------------------------- TrainConfig
@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"dim": 10**9}, r"dim=1000000000 must be >= 1 and at most 65,536"),
        ({"n_layers": 10**6}, r"n_layers=1000000 must be >= 1 and at most 1,024"),
        ({"n_heads": 0}, r"n_heads=0 must be >= 1"),
        ({"n_heads": 129}, r"n_heads=129 must be >= 1 and at most 128 \(dim\)"),
        ({"mlp_hidden": 10**9}, r"mlp_hidden=1000000000"),
        ({"seq_len": 10**9}, r"seq_len=1000000000"),
        ({"batch_size": 10**9}, r"batch_size=1000000000"),
        ({"hc": 0}, r"hc=0 must be >= 1"),
        ({"bpe_vocab_size": 10**9}, r"bpe_vocab_size=1000000000"),
        ({"moe_experts": 10**6}, r"moe_experts=1000000: give at most 1024"),
        ({"moe_experts": 4, "moe_hidden": 10**9}, r"moe_hidden=1000000000"),
    ],
)
def test_train_config_sizes_refused(changes, pattern):
    fast_refusal(lambda: TrainConfig(**changes), pattern)


def test_train_bytes_counts_tables_and_parameters():
    cfg = TrainConfig()
    e = cfg.engram
    assert cfg.train_bytes() >= e.n_heads * sum(e.engram_vocab_size) * (8 * e.head_dim + 8)
    assert (
        TrainConfig(engram=None, tokenizer="bpe").train_bytes()
        > TrainConfig(engram=None, dim=64).train_bytes() / 2
    )
    assert cfg.replace(table_optimizer="dense-adam").train_bytes() > cfg.train_bytes()


# ------------------------------------------------------------------------------------------- engram train
def write_config(tmp_path: Path, engram_kw: dict | None = None, **changes) -> str:
    """A `train --config` file: TrainConfig(**changes), its EngramConfig's fields updated by `engram_kw`
    (written as they are: the file is what refuses)."""
    d = TrainConfig(**changes).to_dict()
    if engram_kw is not None:
        d["engram"].update(engram_kw)
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(d))
    return str(p)


@pytest.mark.parametrize(
    ("engram", "needle"),
    [
        ({"n_heads": 10**9}, "n_heads=1000000000: give 1 to 64"),
        ({"max_ngram_size": 10**6}, "max_ngram_size=1000000"),
        ({"head_dim": 10**6}, "head_dim=1000000: give 1 to 4,096"),
        ({"hidden_size": 10**9}, "hidden_size=1000000000"),
        ({"layer_ids": [1, 10**9]}, "give layer ids from 0 to 1023"),
        ({"norm_eps": 0.0}, "norm_eps=0.0 is out of range"),
        ({"gate_clamp": -1}, "gate_clamp=-1 is out of range"),
    ],
)
def test_train_config_file_refused_without_a_folder(tmp_path, capsys, engram, needle):
    """`engram train --config` of an absurd EngramConfig ran for minutes and left an empty run folder."""
    out = tmp_path / "run"
    t = time.perf_counter()
    refused(capsys, ["train", "--config", write_config(tmp_path, engram), "--out", str(out), *CPU], needle)
    assert time.perf_counter() - t < 5
    assert not out.exists()


def test_train_tables_over_memory_refused_without_a_folder(tmp_path, capsys):
    """Tables within the row bound but beyond the machine (2^36 rows of 32 values: 18 TB to train)."""
    out = tmp_path / "run"
    conf = write_config(tmp_path, {"engram_vocab_size": [2**33, 2**33]})
    refused(capsys, ["train", "--config", conf, "--out", str(out), *CPU], "needs at least", "GB available")
    assert not out.exists()


def test_train_model_refusal_after_data_leaves_no_folder(tmp_path, capsys, corpus):
    """A refusal only the model makes (dim 34 does not split into 2 heads of even width) comes after
    the data is prepared: the run folder is created after it, so none is left."""
    out = tmp_path / "run"
    conf = write_config(
        tmp_path, None, corpus=corpus, engram=None, dim=34, n_heads=2, n_layers=1, bpe_vocab_size=300, steps=1
    )
    refused(capsys, ["train", "--config", conf, "--out", str(out), "--no-progress", *CPU], "even width")
    assert not out.exists()


# ------------------------------------------------------------------------------------------- engram hf-train
@pytest.fixture
def hf_args(tmp_path) -> list[str]:
    """hf-train of a model folder that need not exist: its sizes are refused before it is read."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning God created the heaven and the earth.\n")
    return [
        "hf-train",
        str(tmp_path / "model"),
        "--corpus",
        str(corpus),
        "--out",
        str(tmp_path / "out"),
        *CPU,
    ]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--heads", "1000000000"], "--heads 1000000000: give 1 to 64"),
        (["--head-dim", "1000000"], "--head-dim 1000000: give a row width from 1 to 4096"),
        (["--heads", "64", "--head-dim", "4096"], "over 65,536"),
        (["--table-rows", "1T"], "--table-rows 1,000,000,000,000: give at most 68,719,476,736"),
        (["--layers", "1,1000000000"], "[1000000000] out of range: give decoder layer ids from 0 to 1023"),
        (["--layers", ",".join(map(str, range(200))), "--heads", "64"], "primes to search, over 16,384"),
        (["--mode", "lora", "--lora-rank", "1000000"], "--lora-rank 1000000: give 1 to 4096"),
    ],
)
def test_hf_train_sizes_refused_without_a_folder(tmp_path, capsys, hf_args, extra, needle):
    t = time.perf_counter()
    refused(capsys, [*hf_args, *extra], needle)
    assert time.perf_counter() - t < 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # no OUT, no partial folder


def test_hf_train_settings_library_checks():
    """The checks are the settings' own (a Python caller gets them too), head_dim 0 included."""
    base = {"folder": "m", "corpus": "c", "out": "o"}
    with pytest.raises(ValueError, match="--head-dim 0"):
        HFTrainSettings(**base, head_dim=0)
    with pytest.raises(ValueError, match=r"--held-out '0\.1'"):
        HFTrainSettings(**base, held_out="0.1")  # type: ignore[arg-type]
    HFTrainSettings(**base, heads=64, head_dim=512, layers=tuple(range(128)), table_rows=2**36)


@pytest.mark.parametrize("field", ["rope_theta", "norm_eps", "init_std"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
def test_lm_config_float_fields_are_finite_and_in_range(field, value):
    from engram.model.lm import LMConfig

    with pytest.raises(ValueError, match=rf"LMConfig.{field}=.* must be a finite number"):
        LMConfig(vocab_size=64, **{field: value})


@pytest.mark.parametrize("std", [float("nan"), float("inf"), -0.1])
def test_a_tables_init_std_is_finite(std):
    from engram.model.table_init import RowInit

    with pytest.raises(ValueError, match="init std must be a finite number"):
        RowInit(8, 4, std, 0, torch.float32, torch.device("cpu"))
