"""engram.hf.base: a part records the base model it was trained on (config sizes, a sample of every
weight) under its seal; `load_engram` onto another base of the same shapes (a freshly initialised
Llama, another config) warns (`BaseModelWarning`, naming what differs), the same base does not (in
another dtype either); the vLLM plugin compares with the served folder's files the same way."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram, load_engram, save_engram
from engram.hf.base import BaseModelWarning, base_differences, base_record, file_weights, model_weights

transformers = pytest.importorskip("transformers")


def _part(tmp_path, seed: int = 0):
    """A part trained on S.llama(seed=seed), saved into an HF folder with that backbone."""
    model = add_engram(S.llama(seed=seed), S.engram_config((1,)), compression=S.compression())
    d = tmp_path / "hf"
    model.save_pretrained(
        d, state_dict={k: v for k, v in model.state_dict().items() if not k.startswith("engram.")}
    )
    S.tokenizer().save(str(d / "tokenizer.json"))
    save_engram(model, d)
    return d


def test_the_same_base_loads_quietly_in_any_dtype(tmp_path):
    d = _part(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseModelWarning)
        load_engram(S.llama(), d)
        load_engram(S.llama().to(torch.bfloat16), d)  # a cast rounds by < 1 %: the same weights
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            d
        )  # its part attached, checked the same way
        assert hasattr(loaded, "engram")


def test_another_base_of_the_same_shapes_warns(tmp_path):
    """A freshly initialised Llama of the same sizes loaded silently: now a BaseModelWarning naming the
    tensors whose values differ; the part still attaches (a warning, not a refusal)."""
    d = _part(tmp_path)
    fresh = S.llama(seed=7)
    with pytest.warns(BaseModelWarning, match=r"engram was trained on another base model than LlamaForCausalLM: "
                      r"\d+ of \d+ tensors hold other values \(e.g. .*then, .* now.*attach it to that model"):  # fmt: skip
        load_engram(fresh, d)
    assert hasattr(fresh, "engram")
    other = S.llama(hidden_act="gelu")  # the same weights, another config
    with pytest.warns(BaseModelWarning, match=r"config.json: hidden_act 'silu' then, 'gelu' now"):
        load_engram(other, d)


def test_the_record_is_sealed_and_compact(tmp_path):
    from engram.checkpoint.files import open_tensors
    from engram.checkpoint.v41.format import BASE_MODEL_KEY, file_crc32s

    d = _part(tmp_path)
    meta = open_tensors(d / "engram" / "model-00001-of-00001.safetensors").metadata
    file_crc32s(meta, "part")  # the seal covers the record
    record = json.loads(meta[BASE_MODEL_KEY])
    model = S.llama()
    assert record["config"]["hidden_size"] == S.HIDDEN and record["config"]["model_type"] == "llama"
    assert set(record["weights"]) == {n for n, _ in model.named_parameters()}  # Engram's own left out
    assert all(len(s) == 8 for _, s in record["weights"].values())
    assert record == json.loads(
        base_record(add_engram(model, S.engram_config((1,)), compression=S.compression()))
    )


def test_differences_name_config_shapes_and_values():
    model = S.llama()
    saved = json.loads(base_record(model))
    same = model_weights(model)
    assert base_differences(saved, saved["config"], same) == []
    moved = {n: (s, [v * 1.005 for v in x]) for n, (s, x) in same.items()}  # within a cast's rounding
    assert base_differences(saved, saved["config"], moved) == []
    name = "model.layers.0.mlp.up_proj.weight"
    changed = dict(same)
    changed[name] = (same[name][0], [v + 1 for v in same[name][1]])
    del changed["model.norm.weight"]
    diffs = base_differences(saved, {**saved["config"], "hidden_size": 64}, changed)
    assert diffs[0] == f"config.json: hidden_size {S.HIDDEN} then, 64 now"
    assert diffs[1].startswith("1 of its") and "model.norm.weight" in diffs[1]
    assert diffs[2].startswith(f"1 of {len(same)} tensors hold other values (e.g. {name}")


def test_the_served_folder_is_compared_from_its_files(tmp_path):
    """The vLLM plugin's folder check reads the backbone's samples from the folder's safetensors files
    (what vLLM loads): the same as the model's; another model's files warn."""
    from engram.vllm.folder import read_part

    d = _part(tmp_path)
    model = S.llama()
    want = model_weights(model)
    assert file_weights(d, want) == want
    shape = {"hidden_size": S.HIDDEN, "num_layers": 3, "vocab_size": S.vocab()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseModelWarning)
        read_part(d, **shape)
    S.llama(seed=9).save_pretrained(d)  # another backbone in the folder, the part kept
    with pytest.warns(
        BaseModelWarning, match=r"was trained on another base model than the model in .*hold other values"
    ):
        read_part(d, **shape)
