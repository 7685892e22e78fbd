"""engram.hf.add_engram: exact logits at attach, row ids from input_ids or a collator, padding kept
out of the n-gram windows, and every bad input refused with nothing half-attached."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_setup as S
from engram.addressing.compression import TokenizerCompression
from engram.addressing.hashing import NgramHasher
from engram.hf import EngramCollator, add_engram, find_decoder_layers

transformers = pytest.importorskip("transformers")


def _attach(model, layers=(1,), **kw):
    return add_engram(model, S.engram_config(layers), compression=S.compression(), **kw)


def _models():
    tf = transformers
    common = {"vocab_size": S.vocab(), "pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 1}
    llama_like = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **common,
    }
    yield "llama", tf.LlamaForCausalLM(tf.LlamaConfig(**llama_like))
    yield "qwen2", tf.Qwen2ForCausalLM(tf.Qwen2Config(**llama_like))
    yield "qwen3", tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, **llama_like))
    yield "mistral", tf.MistralForCausalLM(tf.MistralConfig(**llama_like))
    yield "gemma", tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=8, **llama_like))
    yield "gpt2", tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, **common))


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gemma", "gpt2"])
def test_exact_logits_at_attach_and_engram_acts(name):
    torch.manual_seed(0)
    model = dict(_models())[name].eval()
    backbone = {k: v.clone() for k, v in model.state_dict().items()}
    x = S.batch(2, 10)
    ref = model(x).logits
    assert add_engram(model, S.engram_config((0, 1)), compression=S.compression()) is model
    assert torch.equal(model(x).logits, ref)  # zero value projection: exactly the original
    for k, v in backbone.items():  # backbone weights untouched
        assert torch.equal(model.state_dict()[k], v)
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_()
    assert not torch.equal(model(x).logits, ref)


@pytest.mark.parametrize("variant", ["demo-v1", "qwen4-exp-ple"])
def test_exact_logits_at_attach_for_the_other_variants(variant):
    """zero_init zeroes each variant's value projection (it had assumed V4.1's fused wkv)."""
    torch.manual_seed(0)
    model = dict(_models())["llama"].eval()
    x = S.batch(2, 10)
    ref = model(x).logits
    cfg = S.engram_config((0, 1))
    if variant == "qwen4-exp-ple":  # raw ids, one prime base
        cfg = cfg.replace(
            variant=variant,
            compressed_vocab_size=cfg.vocab_size,
            multiplier_scheme="splitmix64",
            engram_vocab_size=(257, 257),
        )
        comp = TokenizerCompression.identity(cfg.vocab_size)
    else:
        cfg, comp = cfg.replace(variant=variant), S.compression()
    add_engram(model, cfg, compression=comp)
    assert torch.equal(model(x).logits, ref)
    with torch.no_grad():
        model.engram.module(1).value_proj.weight.normal_()
    assert not torch.equal(model(x).logits, ref)


def test_engram_output_matches_a_plain_implementation():
    """The hooked model equals running the decoder layers by hand with Engram added before layer 1."""
    model = _attach(S.llama(layers=2))
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.2)
    x = S.batch(2, 9)
    got = model(x).logits
    hasher = NgramHasher(model.engram.config, S.compression())
    rows = torch.from_numpy(hasher.hash(x.numpy()))[:, :, 0]  # (B, T, heads)
    m = model.model
    h = m.embed_tokens(x)
    pos = torch.arange(x.shape[1])[None]
    pe = m.rotary_emb(h, position_ids=pos)
    mask = transformers.masking_utils.create_causal_mask(
        config=m.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
    )
    for i, layer in enumerate(m.layers):
        if i == 1:
            h = model.engram.module(1)(h[:, :, None], rows)[:, :, 0]
        h = layer.forward(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
    ref = model.lm_head(m.norm(h))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_padding_never_enters_a_window():
    """Left- or right-padded sequences get the rows (and logits) of the unpadded ones."""
    model = _attach(S.llama())
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.2)
    a, b = S.batch(1, 7, seed=1), S.batch(1, 4, seed=2)
    la, lb = model(a).logits, model(b).logits
    pad = torch.zeros(1, 3, dtype=torch.long)
    x = torch.cat([a, torch.cat([pad, b], 1)])  # b left-padded
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    out = model(x, attention_mask=mask).logits
    torch.testing.assert_close(out[0], la[0], rtol=1e-5, atol=1e-5)
    y = torch.cat([a, torch.cat([b, pad], 1)])  # b right-padded
    mask_r = torch.ones_like(y)
    mask_r[1, 4:] = 0
    out = model(y, attention_mask=mask_r).logits
    torch.testing.assert_close(out[1, :4], lb[0], rtol=1e-5, atol=1e-5)
    # the rows themselves: padding is dead, so the first real token sees only pads behind it
    rows = {}

    def keep(module, args, output):
        rows["r"] = args[1]

    model.engram.layers["1"].register_forward_hook(keep)
    model(x, attention_mask=mask)
    hasher = model.engram.hasher
    np.testing.assert_array_equal(rows["r"][1, 3:].numpy(), hasher.hash(b.numpy())[0, :, 0])


def test_collator_rows_equal_forward_hashing():
    model = _attach(S.llama())
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.2)
    collate = EngramCollator(model, pad_token_id=0)
    feats = [
        {"input_ids": ids} for ids in S.encode("And God said", "Let there be light: and there was light.")
    ]
    batch = collate(feats)
    assert set(batch) >= {"input_ids", "attention_mask", "engram_rows", "labels"}
    assert batch["engram_rows"].shape[:2] == batch["input_ids"].shape
    with_rows = model(**batch)
    without = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    assert torch.equal(with_rows.logits, without.logits)
    assert torch.equal(with_rows.loss, without.loss)


def test_inputs_embeds_without_ids_refused():
    model = _attach(S.llama())
    emb = model.get_input_embeddings()(S.batch(1, 5))
    with pytest.raises(ValueError, match="inputs_embeds alone"):
        model(inputs_embeds=emb)


def test_find_decoder_layers_rule_and_errors():
    model = S.llama(layers=2)
    assert find_decoder_layers(model) == list(model.model.layers)
    assert find_decoder_layers(model, "model.layers") == list(model.model.layers)
    with pytest.raises(ValueError, match=r"tried model\.layers, transformer\.h"):
        find_decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="does not name a list"):
        find_decoder_layers(model, "model.nothing")


def _assert_untouched(model, params_before):
    assert not hasattr(model, "engram") or not isinstance(getattr(model, "engram", None), torch.nn.Module)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)
    assert [n for n, _ in model.named_parameters()] == params_before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": S.engram_config((5,))}, r"layer ids \[5\] are out of range"),
        ({"config": S.engram_config(hidden=64)}, "hidden size is 32 but"),
        ({"config": S.engram_config().replace(hc_mult=2)}, "hc_mult=2"),
        ({"config": S.engram_config().replace(vocab_size=400)}, "tokenizer does not match"),
        ({"decoder_layers": "model.norm"}, "does not name a list"),
        ({"boundaries": "sentences"}, "boundaries='sentences'"),
    ],
)
def test_bad_input_refused_and_nothing_attached(kwargs, match):
    model = S.llama()
    before = [n for n, _ in model.named_parameters()]
    kw = {"config": S.engram_config(), "compression": S.compression(), **kwargs}
    with pytest.raises(ValueError, match=match):
        add_engram(model, **kw)
    _assert_untouched(model, before)


def test_tokenizer_of_another_vocabulary_refused():
    from tokenizers import Tokenizer, models

    other = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    model = S.llama()
    before = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="tokenizer does not match"):
        add_engram(model, S.engram_config(), tokenizer=other)
    _assert_untouched(model, before)


def test_attach_twice_refused():
    model = _attach(S.llama())
    with pytest.raises(ValueError, match="already"):
        _attach(model)


def test_deepcopy_gives_an_independent_engram_model():
    import copy

    model = _attach(S.llama())
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.2)
    x = S.batch(2, 8)
    ref = model(x).logits
    twin = copy.deepcopy(model)
    assert torch.equal(twin(x).logits, ref)
    with torch.no_grad():
        twin.engram.module(1).wkv.weight.zero_()
    assert torch.equal(model(x).logits, ref)  # the original's hooks still drive the original
    assert not torch.equal(twin(x).logits, ref)  # the copy's hooks drive the copy's modules


def test_a_transformers_tokenizer_builds_the_same_compression():
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=S.tokenizer())
    model = add_engram(S.llama(), S.engram_config(), tokenizer=tok)
    np.testing.assert_array_equal(model.engram.compression.lookup, S.compression().lookup)


def test_remove_engram_restores_the_plain_model():
    from engram.hf import remove_engram

    model = S.llama()
    x = S.batch(1, 6)
    ref = model(x).logits
    before = [n for n, _ in model.named_parameters()]
    _attach(model)
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_()
    assert not torch.equal(model(x).logits, ref)
    remove_engram(model)
    _assert_untouched(model, before)
    assert torch.equal(model(x).logits, ref)


def test_calling_forward_directly_works_as_wrappers_do():
    """peft's LoRA wrapper calls the outer model's forward() directly (no hooks run there)."""
    model = _attach(S.llama())
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.2)
    batch = EngramCollator(model, pad_token_id=0)([{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}])
    ref = model(**batch)
    direct = model.forward(**batch)  # engram_rows reaches the decoder stack through **kwargs
    assert torch.equal(direct.logits, ref.logits) and torch.equal(direct.loss, ref.loss)
    no_rows = {k: v for k, v in batch.items() if k != "engram_rows"}
    assert torch.equal(model.forward(**no_rows).logits, ref.logits)


def test_bf16_model_exact_at_attach_and_engram_in_its_dtype():
    model = S.llama().to(torch.bfloat16)
    x = S.batch(2, 8)
    ref = model(x).logits
    _attach(model)
    assert model.engram.module(1).wkv.weight.dtype == torch.bfloat16
    assert torch.equal(model(x).logits, ref)


def _as_4d(mask: torch.Tensor, kind: str) -> torch.Tensor:
    """The causal 4-D mask [B, 1, T, T] equivalent to a 2-D padding mask, bool or additive float."""
    t = mask.shape[1]
    attends = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None] & mask.bool()[:, None, None, :]
    if kind == "bool":
        return attends
    return torch.zeros(attends.shape).masked_fill(~attends, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_4d_attention_mask_marks_padding_dead(kind):
    """A 4-D mask gives the logits of the equivalent 2-D mask at live tokens (padding stays out of the
    windows); before, Engram ignored it and live-token logits moved by ~0.1."""
    model = _attach(S.llama())
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.5)
    a, b = S.batch(1, 7, seed=1), S.batch(1, 4, seed=2)
    pad = torch.full((1, 3), 7, dtype=torch.long)  # not Engram's pad id: padding seen in a window shows
    x = torch.cat([a, torch.cat([pad, b], 1)])  # b left-padded
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    want = model(x, attention_mask=mask).logits
    got = model(x, attention_mask=_as_4d(mask, kind)).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], rtol=1e-5, atol=1e-5)


def test_an_attention_mask_of_another_shape_is_refused():
    model = _attach(S.llama())
    x = S.batch(2, 5)
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(x, attention_mask=torch.ones(2, 1, 4, 5, dtype=torch.bool))  # 4 queries for 5 tokens
    with pytest.raises(ValueError, match="2-D"):
        model(x, attention_mask=torch.ones(2, 5, 5))
