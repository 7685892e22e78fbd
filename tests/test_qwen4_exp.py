"""Qwen4-Exp's Per-Layer Embedding as our `qwen4-exp-ple` variant, with transformers' own modules
(`Qwen4ExpTextNGramEmbedding`, `Qwen4ExpTextPLELayer`, its `DynamicCache`) as the oracle: row ids
bit-exact, layer output equal on random weights in one pass and in incremental decoding, the
config keys of both families, and the weight loader's refusals. Tiny configs: runs in seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
q = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

from transformers import DynamicCache, Qwen4ExpConfig, Qwen4ExpTextConfig  # noqa: E402

from engram import EngramConfig, HashStream, NgramHasher  # noqa: E402
from engram.addressing.layout import Layout  # noqa: E402
from engram.checkpoint.hf_config import from_hf_dict, to_hf_dict  # noqa: E402
from engram.checkpoint.qwen4_exp import load_ple_layer, load_ple_model  # noqa: E402
from engram.config import Variant  # noqa: E402
from engram.model.module import Engram  # noqa: E402

EOS = 7


def text_config(
    ngram: int = 3, heads: int = 4, layers=(1, 3), hidden: int = 16, hc: int = 2, per_head: int = 4, **kw
) -> Qwen4ExpTextConfig:
    """A Qwen4ExpTextConfig small enough to build in milliseconds (all layers linear attention)."""
    base = {
        "vocab_size": 300,
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 4,
        "hc_count": hc,
        "hc_lowrank": 4,
        "ple_layer_ids": list(layers),
        "ple_embed_dim": (ngram - 1) * heads * per_head,
        "ngram_size": ngram,
        "heads_per_ngram": heads,
        "ngram_vocab_size_base": 1000,
        "make_ngram_vocab_size_divisible_by": 128,
        "eos_token_id": EOS,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    }
    return Qwen4ExpTextConfig(**{**base, **kw})


def random_ids(b: int, t: int, vocab: int, seed: int) -> torch.Tensor:
    """Random ids with EOS sprinkled in (about one in six), some back to back, one at position 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    ids[torch.rand(b, t, generator=g) < 0.15] = EOS
    ids[0, 0] = EOS
    ids[-1, 5:7] = EOS
    return ids


def their_rows(
    emb: torch.nn.Module, ids: torch.Tensor, cache=None, layer_idx: int | None = None
) -> torch.Tensor:
    """The row ids `Qwen4ExpTextNGramEmbedding` looks up, read through its own forward: its table is
    replaced by one whose row r holds r in every column (exact in float64)."""
    rows, dim = emb.ngram_embedding.weight.shape
    with torch.no_grad():
        emb.ngram_embedding.weight.data = torch.arange(rows, dtype=torch.float64)[:, None].repeat(1, dim)
    out = emb(ids, cache)  # (B, T, heads * dim)
    return out.view(*ids.shape, -1, dim)[..., 0].long()


@pytest.mark.parametrize(
    ("ngram", "heads", "layers"), [(3, 4, (1, 3)), (2, 3, (2,)), (4, 2, (1, 2, 4)), (5, 1, (3, 4))]
)
def test_row_ids_bit_exact(ngram: int, heads: int, layers: tuple[int, ...]) -> None:
    cfg = text_config(ngram=ngram, heads=heads, layers=layers)
    ours = EngramConfig.from_hf_config(cfg)
    assert ours.variant is Variant.QWEN4_EXP_PLE and ours.layer_ids == tuple(i - 1 for i in layers)
    hasher = NgramHasher(ours)  # no compression: raw ids
    ids = random_ids(3, 40, cfg.vocab_size, seed=ngram)
    rows = {backend: hasher.hash(ids.numpy(), backend=backend) for backend in ("numba", "numpy")}
    layout = Layout(ours)
    for index, lid in enumerate(ours.layer_ids):
        emb = q.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, lid, index)
        # the layout transformers builds: multipliers, primes, offsets, padded table size
        layer = layout.layer(lid)
        assert emb.layer_multipliers.tolist() == list(layer.multipliers)
        assert emb.ngram_heads_vocab_sizes.tolist() == layer.flat_primes.tolist()
        assert emb.ngram_heads_offsets.tolist() == layer.offsets.tolist()
        assert emb.ngram_embedding.weight.shape == (layer.table_rows, ours.head_dim)
        want = their_rows(emb, ids)
        for backend, got in rows.items():
            assert torch.equal(torch.from_numpy(got[:, :, index]), want), (backend, lid)


def test_row_ids_incremental_with_their_cache() -> None:
    """Prefill then token by token: transformers' embedding with its cache, our HashStream."""
    cfg = text_config()
    hasher = NgramHasher(EngramConfig.from_hf_config(cfg))
    ids = random_ids(2, 24, cfg.vocab_size, seed=5)
    ids[1, 9] = EOS  # EOS as the last prefill token: the restart carries into the first step
    cache = DynamicCache(config=cfg)
    emb = q.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, 2, 1)
    stream = HashStream(hasher, 2)
    got = [stream.feed(ids[:, :10].numpy())[:, :, 1]]
    want = [their_rows(emb, ids[:, :10], cache)]
    for t in range(10, 24):
        got.append(stream.step(ids[:, t].numpy())[:, None, 1])
        want.append(their_rows(emb, ids[:, t : t + 1], cache))
    assert torch.equal(torch.from_numpy(np.concatenate(got, axis=1)), torch.cat(want, dim=1))
    assert torch.equal(torch.cat(want, dim=1), their_rows(emb, ids))  # the oracle agrees with itself


def ple_pair(cfg: Qwen4ExpTextConfig, lid: int, index: int, seed: int = 0) -> tuple[torch.nn.Module, Engram]:
    """transformers' PLE layer with random float64 weights, and ours with the same weights loaded."""
    torch.manual_seed(seed)
    theirs = q.Qwen4ExpTextPLELayer(cfg, lid, index).double()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 1.0)
    ours_cfg = EngramConfig.from_hf_config(cfg)
    ours = Engram(ours_cfg, lid, hasher=NgramHasher(ours_cfg), dtype=torch.float64)
    load_ple_layer(ours, theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("masked", [False, True])
def test_layer_output_one_pass(masked: bool) -> None:
    cfg = text_config()
    theirs, ours = ple_pair(cfg, 2, 1)
    b, t, hc, dim = 3, 20, cfg.hc_count, cfg.hidden_size
    ids = random_ids(b, t, cfg.vocab_size, seed=1)
    h = torch.randn(b, t, hc * dim, dtype=torch.float64)
    keep = torch.ones(b, t, dtype=torch.bool)
    if masked:  # left padding in row 1, as transformers' conv_mask (attention_mask) marks it
        keep[1, :4] = False
    with torch.no_grad():
        want = h + theirs(h, ids, None, conv_mask=keep if masked else None)
        # transformers hashes padding like any token; its conv_mask only zeroes the gated values
        rows = torch.from_numpy(ours.hasher.hash(ids.numpy())[:, :, 1])
        got = ours(h.view(b, t, hc, dim), rows, dead_mask=~keep if masked else None)
    torch.testing.assert_close(got.reshape(b, t, hc * dim), want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # token ids in: the module hashes them as transformers does
        by_ids = ours(h.view(b, t, hc, dim), token_ids=ids, dead_mask=~keep if masked else None)
    torch.testing.assert_close(by_ids, got, rtol=0, atol=0)


def test_layer_output_incremental() -> None:
    """Prefill then single tokens: transformers' layer with its DynamicCache against our module with
    a HashStream and a carried conv state; both equal the one-pass output."""
    cfg = text_config(ngram=3, heads=2, layers=(2,))
    theirs, ours = ple_pair(cfg, 1, 0, seed=3)
    b, t, p, hc, dim = 2, 18, 7, cfg.hc_count, cfg.hidden_size
    ids = random_ids(b, t, cfg.vocab_size, seed=2)
    h = torch.randn(b, t, hc * dim, dtype=torch.float64)
    cache = DynamicCache(config=cfg)
    stream = HashStream(ours.hasher, b)
    state = ours.new_conv_state(b)
    want, got = [], []
    with torch.no_grad():
        one_pass = h + theirs(h, ids, None)
        want.append(h[:, :p] + theirs(h[:, :p], ids[:, :p], cache))
        rows = torch.from_numpy(stream.feed(ids[:, :p].numpy())[:, :, 0])
        got.append(ours(h[:, :p].view(b, p, hc, dim), rows, conv_state=state))
        for i in range(p, t):
            hi = h[:, i : i + 1]
            want.append(hi + theirs(hi, ids[:, i : i + 1], cache))
            rows = torch.from_numpy(stream.step(ids[:, i].numpy())[:, None, 0])
            got.append(ours(hi.view(b, 1, hc, dim), rows, conv_state=state))
    want_all = torch.cat(want, dim=1)
    torch.testing.assert_close(want_all, one_pass, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.cat(got, dim=1).reshape(b, t, hc * dim), want_all, rtol=1e-12, atol=1e-12
    )


def test_layer_output_float32() -> None:
    cfg = text_config(hidden=32, hc=4)
    theirs, ours = ple_pair(cfg, 0, 0, seed=4)
    theirs, ours = theirs.float(), ours.float()
    b, t = 2, 16
    ids = random_ids(b, t, cfg.vocab_size, seed=4)
    h = torch.randn(b, t, 4 * 32)
    with torch.no_grad():
        want = h + theirs(h, ids, None)
        got = ours(h.view(b, t, 4, 32), token_ids=ids)
    torch.testing.assert_close(got.reshape(b, t, -1), want)


def test_load_from_whole_model() -> None:
    cfg = text_config(layers=(1, 3))
    model = q.Qwen4ExpTextModel(cfg).double()
    ours_cfg = EngramConfig.from_hf_config(cfg)
    mods = {lid: Engram(ours_cfg, lid, dtype=torch.float64) for lid in ours_cfg.layer_ids}
    load_ple_model(mods, model.state_dict())
    for lid, m in mods.items():
        assert torch.equal(m.table.weight, model.layers[lid].ple.ple_embedding.ngram_embedding.weight)
        assert torch.equal(m.key_proj.weight, model.layers[lid].ple.key_proj.weight)
    with pytest.raises(ValueError, match=r"modules\[2\] is the module of layer 0"):
        load_ple_model({2: mods[0]}, model.state_dict())
    with pytest.raises(ValueError, match=r"layers.1.ple"):
        load_ple_model({1: Engram(ours_cfg.replace(layer_ids=(1,)), 1)}, model.state_dict())


# ------------------------------------------------------------------------------------------ configs
def test_from_hf_config_both_families_round_trip() -> None:
    cfg = text_config(ngram=4, heads=2, layers=(3, 1), seed=99)
    ours = EngramConfig.from_hf_config(cfg)
    assert ours.layer_ids == (0, 2) and ours.seed == 99 and ours.head_dim == 4
    assert ours.restart_after_id == EOS == ours.pad_token_id
    assert EngramConfig.from_hf_config(cfg.to_dict()) == ours
    assert EngramConfig.from_hf_config(Qwen4ExpConfig(text_config=cfg.to_dict())) == ours
    back = text_config(**{k: v for k, v in to_hf_dict(ours).items() if k != "vocab_size"}, vocab_size=300)
    assert EngramConfig.from_hf_config(back) == ours
    assert from_hf_dict(to_hf_dict(ours)) == ours
    eos_list = cfg.to_dict() | {"eos_token_id": [EOS, 8]}
    assert EngramConfig.from_hf_config(eos_list) == ours
    for preset in ("deepseek-v4.1", "demo-v1", "tiny", "qwen4-exp-tiny"):
        c = EngramConfig.preset(preset)
        assert EngramConfig.from_hf_config(to_hf_dict(c), name=c.name, tokenizer=c.tokenizer) == c


def test_from_hf_config_refusals() -> None:
    with pytest.raises(ValueError, match=r"engram_layer_ids.*ple_layer_ids"):
        EngramConfig.from_hf_config({"hidden_size": 16})
    with pytest.raises(ValueError, match="ple_embed_dim=30 must be a positive multiple"):
        EngramConfig.from_hf_config(text_config().to_dict() | {"ple_embed_dim": 30})
    with pytest.raises(ValueError, match="no PLE layers"):
        EngramConfig.from_hf_config(text_config().to_dict() | {"ple_layer_ids": []})
    with pytest.raises(ValueError, match="eos_token_id must be set"):
        EngramConfig.from_hf_config(text_config().to_dict() | {"eos_token_id": None})
    with pytest.raises(TypeError, match="transformers config or a dict"):
        EngramConfig.from_hf_config(42)
    with pytest.raises(ValueError, match="raw token ids"):
        EngramConfig.preset("qwen4-exp-tiny").replace(compressed_vocab_size=500)
    with pytest.raises(ValueError, match="one base"):
        EngramConfig.preset("qwen4-exp-tiny").replace(engram_vocab_size=(4096, 5000))
    with pytest.raises(ValueError, match="multiplier_scheme='nope'"):
        EngramConfig.preset("qwen4-exp-tiny").replace(multiplier_scheme="nope")
    with pytest.raises(ValueError, match="pass its compression map"):
        NgramHasher(EngramConfig.preset("tiny"))


def test_loader_refusals() -> None:
    cfg = text_config()
    theirs = q.Qwen4ExpTextPLELayer(cfg, 2, 1)
    sd = theirs.state_dict()
    ours_cfg = EngramConfig.from_hf_config(cfg)
    m = Engram(ours_cfg, 2)
    before = m.key_proj.weight.clone()
    # weights of a config with other heads per n-gram: other shapes (table rows, projections)
    other = q.Qwen4ExpTextPLELayer(text_config(heads=2, per_head=8), 2, 1).state_dict()
    with pytest.raises(ValueError, match="has shape"):
        load_ple_layer(m, other)
    # the same shapes but another seed: the hash buffers differ
    with pytest.raises(ValueError, match=r"layer_multipliers.*hash layouts differ"):
        load_ple_layer(m, q.Qwen4ExpTextPLELayer(text_config(seed=5), 2, 1).state_dict())
    # the PLE of another layer index: other primes (here also another padded table size)
    with pytest.raises(ValueError, match=r"has shape|hash layouts differ"):
        load_ple_layer(m, q.Qwen4ExpTextPLELayer(cfg, 2, 0).state_dict())
    with pytest.raises(ValueError, match=r"lacks conv1d.weight"):
        load_ple_layer(m, {k: v for k, v in sd.items() if k != "conv1d.weight"})
    with pytest.raises(ValueError, match="unexpected keys"):
        load_ple_layer(m, {**sd, "extra.weight": torch.zeros(1)})
    with pytest.raises(TypeError, match="qwen4-exp-ple"):
        load_ple_layer(Engram(EngramConfig.preset("tiny"), 1), sd)
    assert torch.equal(m.key_proj.weight, before)  # nothing copied by a refused load
    with pytest.raises(ValueError, match="conv_state must have shape"):
        m(torch.zeros(2, 1, 2, 16), torch.zeros(2, 1, 8, dtype=torch.long), conv_state=torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="conv_state is for variant"):
        tiny = Engram(EngramConfig.preset("tiny"), 1)
        tiny(torch.zeros(1, 1, 2, 64), torch.zeros(1, 1, 8, dtype=torch.long), conv_state=torch.zeros(1))


class _RowIds(torch.nn.Module):
    """Stands in for a full-size n-gram table: returns the row ids it is asked for (as float64)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, 1, dtype=torch.float64))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.double()[..., None]


def test_row_ids_full_scale() -> None:
    """transformers' default sizes (248320 ids, base 20M, orders 2-3, 8 heads, seed 1234; tables of
    3.2e8 rows, not allocated): primes >= 4096 take the division-free modulo in our kernels."""
    cfg = text_config(
        ngram=3, heads=8, layers=(1, 2), vocab_size=248320, ngram_vocab_size_base=20_000_000, seed=1234
    )
    ours = EngramConfig.from_hf_config(cfg)
    hasher = NgramHasher(ours)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 248320, (2, 64), generator=g)
    ids[torch.rand(2, 64, generator=g) < 0.1] = EOS
    ids[:, 30:32] = torch.tensor([248319, 0])  # the extreme ids
    got = hasher.hash(ids.numpy())
    for index, lid in enumerate(ours.layer_ids):
        with torch.device("meta"):
            emb = q.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, lid, index)
        emb.layer_multipliers = q._build_layer_multipliers(cfg.vocab_size, 3, index, cfg.seed)
        emb.ngram_heads_vocab_sizes = torch.tensor(emb.head_vocab_sizes)
        emb.ngram_heads_offsets = torch.tensor(emb.head_offsets)
        emb.ngram_embedding = _RowIds()
        assert emb.head_vocab_sizes == Layout(ours).layer(lid).flat_primes.tolist()
        want = emb(ids, None).long()  # (B, T, heads)
        assert torch.equal(torch.from_numpy(got[:, :, index]), want), lid


def test_engram_pad_id_alias() -> None:
    d = to_hf_dict(EngramConfig.preset("deepseek-v4.1"))
    assert d["engram_pad_token_id"] == 2 and "engram_pad_id" not in d  # the published key alone
    alias = {k: v for k, v in d.items() if k != "engram_pad_token_id"} | {"engram_pad_id": 5}
    assert EngramConfig.from_hf_config(alias).pad_token_id == 5
    with pytest.raises(ValueError, match="disagree"):
        EngramConfig.from_hf_config(d | {"engram_pad_id": 5})
