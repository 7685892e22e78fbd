"""The studies' variants of the LM and its rows: the gate fixed at 1, the plain hashed n-gram input
embedding, rows that ignore the n-gram (apps.rows) and tokenizer compression off, each against a
plain computation from its definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.apps.lm.data import Document, TokenStream
from engram.apps.lm.rows import identity_compression, stream_rows
from engram.apps.lm.train_config import RowHash, TrainConfig
from engram.config import EngramConfig
from engram.model.lm import EngramLM, EngramMode, LMConfig
from test_eval_sample import WORDS, word_tokenizer

VOCAB = 52


def engram_cfg(**kw) -> EngramConfig:
    base = dict(
        name="t",
        layer_ids=(1,),
        max_ngram_size=3,
        n_heads=2,
        engram_vocab_size=(40, 40),
        vocab_size=VOCAB,
        compressed_vocab_size=VOCAB,
        pad_token_id=0,
        tokenizer=None,
        head_dim=8,
        hidden_size=16,
        hc_mult=1,
    )
    return EngramConfig(**(base | kw))


def lm(mode: str, **kw) -> EngramLM:
    torch.manual_seed(0)
    c = LMConfig(
        vocab_size=VOCAB,
        dim=16,
        n_layers=2,
        n_heads=2,
        mlp_hidden=24,
        max_seq_len=12,
        engram=engram_cfg(**kw),
        engram_mode=mode,
        engram_zero_init=False,
    )
    return EngramLM(c)


def rows_for(model: EngramLM, b: int = 2, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    from engram.addressing.hashing import NgramHasher

    comp = identity_compression(word_tokenizer())
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(3))
    return ids, torch.from_numpy(NgramHasher(model.config.engram, comp).hash(ids.numpy()))


def test_fixed_gate_is_h_plus_v():
    model = lm("fixed-gate")
    ids, rows = rows_for(model)
    got, gates = model(ids, rows, return_gates=True)
    assert torch.equal(gates[1], torch.ones_like(gates[1]))
    # plain: block 0, then h + (wkv e)[value part], then block 1
    module = model.engrams["1"]
    with torch.no_grad():
        x = model.embed(ids)[:, :, None]
        x = model.blocks[0](x, model.rope_cos[:7], model.rope_sin[:7])
        e = module.table.weight[rows[:, :, 0]].flatten(-2)  # (B, T, heads*hd)
        v = e @ module.wkv.weight[16:].T  # the value rows of the fused projection
        x = x + v[:, :, None]
        x = model.blocks[1](x, model.rope_cos[:7], model.rope_sin[:7])
        want = model.norm(x[:, :, 0]) @ model.embed.weight.T
    torch.testing.assert_close(got, want)
    gated = lm("gated")
    assert not torch.allclose(gated(ids, rows), got)


def test_input_embedding_is_mean_over_orders_of_concatenated_heads():
    model = lm("input-embedding")
    assert not model.engrams and model.ngram_embed is not None and model.needs_rows
    ids, rows = rows_for(model)
    got = model(ids, rows)
    w = model.ngram_embed.weight
    with torch.no_grad():
        r = rows[:, :, 0]  # (B, T, orders*heads): order 2's heads, then order 3's
        per_order = torch.stack([w[r[:, :, 0:2]].flatten(-2), w[r[:, :, 2:4]].flatten(-2)])  # (2, B, T, 16)
        x = (model.embed(ids) + per_order.mean(0))[:, :, None]
        for blk in model.blocks:
            x = blk(x, model.rope_cos[:7], model.rope_sin[:7])
        want = model.norm(x[:, :, 0]) @ model.embed.weight.T
    torch.testing.assert_close(got, want)
    p = model.num_params()
    assert p["engram_tables"] == w.numel() and p["activated"] == p["total"] - w.numel() + 4 * 8
    with pytest.raises(ValueError, match="n_heads \\* head_dim must equal dim"):
        LMConfig(
            vocab_size=VOCAB, dim=16, n_heads=2, engram=engram_cfg(head_dim=4), engram_mode="input-embedding"
        )
    with pytest.raises(ValueError, match="engram_mode='nope'"):
        LMConfig(vocab_size=VOCAB, dim=16, n_heads=2, engram_mode="nope")
    assert LMConfig.from_dict(model.config.to_dict()).engram_mode is EngramMode.INPUT_EMBEDDING


def docs_stream() -> TokenStream:
    rng = np.random.default_rng(0)
    docs = [Document(f"d{i}", " ".join(rng.choice(WORDS, size=n))) for i, n in enumerate([300, 120, 500])]
    return TokenStream(docs, word_tokenizer())


@pytest.mark.parametrize("how", list(RowHash))
def test_control_rows_stay_in_each_heads_segment(how):
    from engram.addressing.hashing import NgramHasher

    s = docs_stream()
    cfg = engram_cfg()
    comp = identity_compression(word_tokenizer())
    rows = stream_rows(cfg, comp, s, how, "train").numpy()  # (N, 1, 4)
    h = NgramHasher(cfg, comp)
    lo, size = h.offsets.reshape(1, -1), h.primes.reshape(1, -1)
    assert rows.shape == (len(s), 1, 4)
    assert np.all((rows >= lo) & (rows < lo + size))
    again = stream_rows(cfg, comp, s, how, "train").numpy()
    assert np.array_equal(rows, again)  # deterministic
    held = stream_rows(cfg, comp, s, how, "held_out").numpy()
    if how is RowHash.RANDOM:
        assert not np.array_equal(rows, held)  # held-out positions get rows training never saw
        assert len(np.unique(rows[:, 0, 0])) > 20
    elif how is RowHash.CONSTANT:
        assert np.array_equal(rows, np.broadcast_to(lo, rows.shape))  # capacity 1: one row per head
    elif how is RowHash.POSITION:
        starts = s.doc_offsets[:-1]
        assert np.array_equal(rows[starts[0]], rows[starts[1]]) and np.array_equal(
            rows[starts[1] + 5], rows[starts[2] + 5]
        )
        assert not np.array_equal(rows[starts[0]], rows[starts[0] + 1])
    else:
        assert np.array_equal(rows, h.hash(s.ids))


def test_identity_compression_and_config_checks():
    tok = word_tokenizer()
    comp = identity_compression(tok)
    assert comp.size == VOCAB and np.array_equal(comp.compress(np.arange(VOCAB)), np.arange(VOCAB))
    with pytest.raises(ValueError, match=r"row_hash='random'.*engram is None"):
        TrainConfig(engram=None, row_hash="random")
    with pytest.raises(ValueError, match="row_hash='x'"):
        TrainConfig(row_hash="x")
    with pytest.raises(ValueError, match="engram_mode='x'"):
        TrainConfig(engram_mode="x")
    with pytest.raises(ValueError, match="moe_top_k=5"):
        TrainConfig(moe_experts=4, moe_top_k=5)
    c = TrainConfig(row_hash="position", compression=False, engram_mode="fixed-gate", moe_experts=4)
    assert TrainConfig.from_dict(c.to_dict()) == c
