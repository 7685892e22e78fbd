from __future__ import annotations

import dataclasses

import pytest

from engram import PRESETS, EngramConfig, Layout, Variant
from engram.checkpoint.hf_config import from_hf_dict, to_hf_dict


def test_presets_exist_and_are_frozen():
    assert set(PRESETS) >= {"deepseek-v4.1", "demo-v1", "tiny"}
    c = EngramConfig.preset("deepseek-v4.1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_ngram_size = 3  # type: ignore[misc]


def test_v41_preset_numbers():
    c = EngramConfig.preset("deepseek-v4.1")
    assert c.variant is Variant.V4_1
    assert c.layer_ids == (1, 14)
    assert c.orders == (2, 3, 4)
    assert c.rows_per_token == 24
    assert c.engram_dim == 6144
    assert c.head_dim == 256 and c.hidden_size == 5120 and c.hc_mult == 4
    assert c.compressed_vocab_size == 99092 and c.vocab_size == 129280 and c.pad_token_id == 2


def test_demo_v1_preset_numbers():
    c = EngramConfig.preset("demo-v1")
    assert c.variant is Variant.DEMO_V1
    assert c.layer_ids == (1, 15)
    assert c.orders == (2, 3)
    assert c.n_heads == 8 and c.head_dim == 64 and c.n_heads * c.head_dim == 512
    assert c.engram_vocab_size == (129280 * 5, 129280 * 5)
    assert c.kernel_size == 4


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match=r"deepseek-v4\.1"):
        EngramConfig.preset("nope")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_round_trip(name):
    c = EngramConfig.preset(name)
    d = to_hf_dict(c)
    keys = (
        ("ple_layer_ids", "ple_embed_dim", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base")
        if c.variant is Variant.QWEN4_EXP_PLE
        else (
            "engram_layer_ids",
            "engram_num_embeddings",
            "engram_max_ngram_size",
            "engram_vocab_size",
            "engram_n_heads",
            "engram_head_dim",
            "engram_pad_token_id",
            "engram_compressed_vocab_size",
        )
    )
    for key in keys:
        assert key in d
    back = from_hf_dict(d, name=c.name, tokenizer=c.tokenizer)
    assert back == c
    assert to_hf_dict(back) == d


# DeepSeek-V4.1-Flash's own config.json, its Engram keys (what vLLM's V4.1 Engram layout reads)
FLASH_ENGRAM_KEYS = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "engram_seed": 0,
}


def test_v41_hf_dict_is_the_published_form():
    """One row count per Engram layer and `engram_pad_token_id`, as the Flash config.json has them
    (a single number once made vLLM's layout fail with "'int' object is not iterable")."""
    d = to_hf_dict(EngramConfig.preset("deepseek-v4.1"))
    assert {k: d[k] for k in FLASH_ENGRAM_KEYS} == FLASH_ENGRAM_KEYS
    assert all(isinstance(n, int) for n in d["engram_num_embeddings"])
    assert "engram_pad_id" not in d
    # both forms of engram_num_embeddings, and either pad key, still read
    for changes in ({}, {"engram_num_embeddings": 384016682}):
        flash = {**d, **changes}
        assert from_hf_dict(flash) == EngramConfig.preset("deepseek-v4.1").replace(name="hf", tokenizer=None)
    legacy = {k: v for k, v in d.items() if k != "engram_pad_token_id"} | {"engram_pad_id": 2}
    assert from_hf_dict(legacy).pad_token_id == 2


def test_hf_num_embeddings_mismatch_is_refused_with_both_numbers():
    d = to_hf_dict(EngramConfig.preset("deepseek-v4.1"))
    d["engram_num_embeddings"] = 384016681
    with pytest.raises(ValueError, match=r"384016681.*384016682"):
        from_hf_dict(d)
    d["engram_num_embeddings"] = [384006168, 384016683]
    with pytest.raises(ValueError, match=r"384016683.*384016682"):
        from_hf_dict(d)


def test_hf_per_layer_num_embeddings_accepted():
    d = to_hf_dict(EngramConfig.preset("deepseek-v4.1"))
    d["engram_num_embeddings"] = [384006168, 384016682]
    c = from_hf_dict(d)
    assert c.declared_num_embeddings == (384006168, 384016682)
    assert Layout(c).num_embeddings == (384006168, 384016682)


def test_hf_missing_keys_named():
    with pytest.raises(ValueError, match="engram_n_heads"):
        from_hf_dict({"engram_layer_ids": [1]})


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"layer_ids": ()}, "layer_ids is empty"),
        ({"layer_ids": (1, 1)}, "repeats"),
        ({"layer_ids": (-1,)}, "negative"),
        ({"max_ngram_size": 1}, "at least 2-grams"),
        ({"engram_vocab_size": (16000000,)}, "need 3"),
        ({"n_heads": 0}, "n_heads"),
        ({"compressed_vocab_size": 200000}, "compressed_vocab_size=200000"),
        ({"pad_token_id": 129280}, "pad_token_id=129280"),
        ({"head_dim": 0}, "head_dim"),
    ],
)
def test_validation_errors(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngramConfig.preset("deepseek-v4.1").replace(**changes)


def test_type_errors():
    with pytest.raises(TypeError, match="n_heads"):
        EngramConfig(n_heads=8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer_ids"):
        EngramConfig(layer_ids=(1.5,))  # type: ignore[arg-type]


def test_replace_max_ngram_expands_bases():
    c = EngramConfig.preset("deepseek-v4.1").replace(max_ngram_size=3)
    assert c.engram_vocab_size == (16000000, 16000000)


def test_layer_index():
    c = EngramConfig.preset("deepseek-v4.1")
    assert c.layer_index(14) == 1
    with pytest.raises(ValueError, match=r"layer 2 has no Engram module.*\(1, 14\)"):
        c.layer_index(2)


def test_hf_round_trip_keeps_gate_numbers():
    c = EngramConfig.preset("tiny").replace(norm_eps=1e-5, gate_clamp=1e-4)
    back = from_hf_dict(to_hf_dict(c), name=c.name, tokenizer=c.tokenizer)
    assert back.norm_eps == 1e-5 and back.gate_clamp == 1e-4


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plain_dict_round_trip(name):
    import json

    c = EngramConfig.preset(name).replace(declared_num_embeddings=None)
    back = EngramConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c and back.to_dict() == c.to_dict()


def test_plain_dict_refuses_unknown_keys():
    d = EngramConfig.preset("tiny").to_dict() | {"engram_layer_ids": [1]}
    with pytest.raises(ValueError, match="unknown keys"):
        EngramConfig.from_dict(d)
