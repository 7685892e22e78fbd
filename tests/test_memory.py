"""Memory patches (engram.memory): memorize leaves the model as it was; a patch changes the facts'
logits and nothing a text without a patched row reads (bit for bit); removing restores every table
bit for bit; stacked patches follow the stated rule whatever the order; a patch for another model,
tokenizer or layout, or a damaged file, is refused; FP8 tables and the demo's EngramLM take patches too."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_setup as hs
from engram.hf import add_engram
from engram.memory import (
    EngramLayers,
    Fact,
    MemorizeSettings,
    MemoryPatch,
    PatchOverlapWarning,
    applied_patches,
    apply_patch,
    load_patch,
    memorize,
    patch_hits,
    read_facts,
    remove_patch,
    save_patch,
)
from engram.memory.apply import layer_rows, reader_signature
from engram.memory.patch import LayerRows
from engram.model.table import QuantTable

FACTS = [
    Fact("The land of Zorvath is called", " light", subject="Zorvath"),
    Fact("And the face of Quill was", " void", subject="Quill"),
]
STEPS = MemorizeSettings(steps=8, lr=0.1, batch_size=2)


def _model(seed: int = 0, **cfg):
    m = hs.llama(seed=seed)
    add_engram(m, hs.engram_config(**cfg), tokenizer=hs.tokenizer(), zero_init=False, seed=0)
    return m


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([hs.tokenizer().encode(text).ids])


def _logits(m, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=ids).logits


def _tables(m) -> dict[int, torch.Tensor]:
    return {lid: mod.table.weight.detach().clone() for lid, mod in EngramLayers.of(m).modules.items()}


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def patch(model):
    return memorize(model, hs.tokenizer(), FACTS, STEPS, name="two").patch


def _hand_patch(m, rows: dict[int, list[int]], shift: float, name: str) -> MemoryPatch:
    """A patch of `rows` made by hand: each row's value + `shift`."""
    layers = EngramLayers.of(m)
    out = {}
    for lid, rs in rows.items():
        table = layers.modules[lid].table
        before = layer_rows(table, torch.tensor(sorted(rs)), "float32")
        out[lid] = LayerRows(before.rows, before.values + shift, None, before.before)
    return MemoryPatch(
        out,
        "float32",
        hs.engram_config().head_dim,
        {lid: layers.modules[lid].table.num_rows for lid in out},
        layers.layout,
        layers.tokenizer,
        {lid: reader_signature(layers.modules[lid]) for lid in out},
        facts=1,
        name=name,
    )


def test_memorize_learns_and_leaves_the_model_as_it_was(patch):
    m = _model()
    state = copy.deepcopy(m.state_dict())
    res = memorize(m, hs.tokenizer(), FACTS, STEPS)
    after = m.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert res.losses[-1] < res.losses[0]
    assert res.patch.fingerprint == patch.fingerprint  # same facts, settings, seed: the same patch
    assert res.patch.facts == 2 and res.patch.num_rows > 0
    assert all(p.requires_grad for p in m.parameters())  # as they were


def test_patch_changes_its_facts_and_no_text_that_misses_its_rows(model, patch):
    hasher = EngramLayers.of(model).hasher
    fact = _ids(FACTS[0].prompt + FACTS[0].target)
    assert patch_hits(hasher, patch, fact[0].tolist()).any()
    # texts none of whose n-grams reach a patched row (the tiny tables collide often: pick such texts)
    texts = [" ".join(hs.TEXT[i].split()[a : a + n]) for i in range(4) for a in range(6) for n in (4, 6)]
    clean = [t for t in texts if not patch_hits(hasher, patch, _ids(t)[0].tolist()).any()]
    hit = [t for t in texts if patch_hits(hasher, patch, _ids(t)[0].tolist()).any()]
    assert len(clean) >= 3 and hit
    before = {t: _logits(model, _ids(t)) for t in [*clean, *hit]}
    before_fact = _logits(model, fact)
    apply_patch(model, patch)
    try:
        assert not torch.equal(_logits(model, fact), before_fact)
        for t in clean:
            assert torch.equal(_logits(model, _ids(t)), before[t]), t  # to the last bit
        for t in hit:  # before the first position that reads a patched row: unchanged
            first = int(np.argmax(patch_hits(hasher, patch, _ids(t)[0].tolist())))
            assert torch.equal(_logits(model, _ids(t))[:, :first], before[t][:, :first])
        assert [p.fingerprint for p in applied_patches(model)] == [patch.fingerprint]
    finally:
        remove_patch(model, patch)
    assert torch.equal(_logits(model, fact), before_fact)


def test_remove_restores_every_table_bit_for_bit(patch):
    m = _model()
    tables = _tables(m)
    apply_patch(m, patch)
    assert any(not torch.equal(tables[k], v) for k, v in _tables(m).items())
    remove_patch(m, patch)
    assert all(torch.equal(tables[k], v) for k, v in _tables(m).items())
    assert applied_patches(m) == []


def test_applied_patches_lists_them_in_the_order_they_were_applied():
    m = _model(layer_ids=(0, 1))
    a = _hand_patch(m, {1: [3]}, 0.25, "a")  # layer 1 only
    b = _hand_patch(m, {0: [4], 1: [9]}, -0.5, "b")  # the first layer too
    apply_patch(m, a)
    apply_patch(m, b)
    assert [p.name for p in applied_patches(m)] == ["a", "b"]
    remove_patch(m, a)
    apply_patch(m, a)
    assert [p.name for p in applied_patches(m)] == ["b", "a"]


def test_stacked_patches_sum_their_changes_whatever_the_order():
    m1, m2 = _model(), _model()
    base = _tables(m1)
    a = _hand_patch(m1, {1: [3, 5, 7]}, 0.25, "a")
    b = _hand_patch(m1, {1: [7, 9]}, -0.5, "b")
    apply_patch(m1, a)
    with pytest.warns(PatchOverlapWarning, match="shares 1 rows with 'a'"):
        apply_patch(m1, b)
    with pytest.warns(PatchOverlapWarning):
        apply_patch(m2, b)
        apply_patch(m2, a)
    w1, w2 = _tables(m1)[1], _tables(m2)[1]
    assert torch.equal(w1, w2)  # the order of applying does not matter
    w0 = base[1]
    assert torch.equal(w1[3], a.layers[1].values[0]) and torch.equal(w1[9], b.layers[1].values[1])
    first, second = (
        p.layers[1].values[p.layers[1].rows.tolist().index(7)]
        for p in sorted([a, b], key=lambda p: p.fingerprint)
    )
    assert torch.equal(w1[7], w0[7] + (first - w0[7]) + (second - w0[7]))  # summed in fingerprint order
    remove_patch(m1, a)  # the other's rows exactly, the rest back to the original
    w = _tables(m1)[1]
    assert torch.equal(w[7], b.layers[1].values[0]) and torch.equal(w[3], w0[3])
    remove_patch(m1, b)
    assert torch.equal(_tables(m1)[1], w0)


def test_a_patch_that_does_not_fit_is_refused_and_changes_nothing(patch):
    m = _model()
    tables = _tables(m)
    for bad, says in [
        (dataclasses.replace(patch, layout="0" * 64), "another Engram layout"),
        (dataclasses.replace(patch, tokenizer="0" * 64), "another tokenizer"),
    ]:
        with pytest.raises(ValueError, match=says):
            apply_patch(m, bad)
    with torch.no_grad():
        EngramLayers.of(m).modules[1].wkv.weight.mul_(1.5)
    with pytest.raises(ValueError, match=r"Engram weights .* differ"):
        apply_patch(m, patch)
    m = _model()
    lid, lr = next(iter(patch.layers.items()))
    with torch.no_grad():
        EngramLayers.of(m).modules[lid].table.weight[lr.rows[0]] += 1.0
    with pytest.raises(ValueError, match="made for another table"):
        apply_patch(m, patch)
    expected = tables[lid].clone()
    expected[lr.rows[0]] += 1.0
    assert torch.equal(_tables(m)[lid], expected)  # nothing written
    m = _model()
    apply_patch(m, patch)
    with pytest.raises(ValueError, match="already applied"):
        apply_patch(m, patch)
    remove_patch(m, patch)
    with pytest.raises(ValueError, match="not applied"):
        remove_patch(m, patch)
    with pytest.raises(ValueError, match="another Engram layout"):
        apply_patch(_model_other_layout(), patch)
    with pytest.raises(ValueError, match="has no Engram layers"):
        apply_patch(hs.llama(), patch)


def _model_other_layout():
    m = hs.llama()
    add_engram(m, hs.engram_config(seed=7), tokenizer=hs.tokenizer(), zero_init=False, seed=0)
    return m


def test_save_and_load_round_trip_and_damage_refused(patch, tmp_path):
    path = save_patch(patch, tmp_path / "p.safetensors")
    q = load_patch(path)
    assert q.fingerprint == patch.fingerprint and q.name == "two" and q.facts == 2
    assert not list(tmp_path.glob(".*tmp*"))
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    d = json.loads(meta["engram_patch"])
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata={**meta, "engram_patch": json.dumps({**d, "facts": 99})})
    with pytest.raises(ValueError, match="does not match its seal"):
        load_patch(edited)
    damaged = tmp_path / "damaged.safetensors"
    k = next(k for k in tensors if k.startswith("values."))
    t = tensors[k].clone()
    t.view(-1)[0] += 1.0
    save_file({**tensors, k: t}, str(damaged), metadata=meta)
    with pytest.raises(ValueError, match=f"tensor {k} does not match its CRC32"):
        load_patch(damaged)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="not a memory patch"):
        load_patch(plain)
    with pytest.raises(ValueError, match="no such patch file"):
        load_patch(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="is a folder"):
        save_patch(patch, tmp_path)


def test_fp8_tables_take_fp8_patches_and_float_ones_are_refused(patch):
    m = _model()
    for mod in EngramLayers.of(m).modules.values():
        mod.table = QuantTable.from_float(mod.table.weight.detach(), "fp8")
    with pytest.raises(ValueError, match="holds float32 rows, layer 1's table holds fp8 rows"):
        apply_patch(m, patch)
    values = {
        lid: (mod.table.weight.clone(), mod.table.scale.clone())
        for lid, mod in EngramLayers.of(m).modules.items()
    }
    res = memorize(m, hs.tokenizer(), FACTS, STEPS)
    p = res.patch
    assert p.row_format == "fp8" and p.quantised and res.losses[-1] < res.losses[0]
    ids = _ids(FACTS[0].prompt + FACTS[0].target)
    before = _logits(m, ids)
    apply_patch(m, p)
    assert not torch.equal(_logits(m, ids), before)
    remove_patch(m, p)
    for lid, mod in EngramLayers.of(m).modules.items():
        assert torch.equal(mod.table.weight.view(torch.uint8), values[lid][0].view(torch.uint8))
        assert torch.equal(mod.table.scale.view(torch.uint8), values[lid][1].view(torch.uint8))


def test_memorize_refuses_an_engram_that_adds_nothing():
    m = hs.llama()
    add_engram(m, hs.engram_config(), tokenizer=hs.tokenizer(), seed=0)  # zero_init: the value is zero
    with pytest.raises(ValueError, match="adds nothing yet"):
        memorize(m, hs.tokenizer(), FACTS, STEPS)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"prompt": "a", "target": ""}', ":2: the fact's target is empty"),
        ('{"prompt": "", "target": " b"}', ":2: the fact's prompt is empty"),
        (
            '{"prompt": "a b", "target": " c"}',
            ":2: the prompt 'a b' has the target ' c', but .*:1 gives it ' b'",
        ),
        ('["a", "b"]', ":2: a JSON list, not an object"),
        ("{not json", ":2: not a JSON object"),
        ('{"prompt": "a"}', ":2: no 'target'"),
        (
            '{"prompt": "x y", "target": " z", "subject": "w"}',
            ":2: the subject 'w' is not a part of the prompt",
        ),
    ],
)
def test_read_facts_refuses_bad_lines(tmp_path, line, says):
    f = tmp_path / "facts.jsonl"
    f.write_text('{"prompt": "a b", "target": " b"}\n' + line + "\n")
    with pytest.raises(ValueError, match=says):
        read_facts(f)


def test_read_facts_reads_a_duplicate_once_and_refuses_bytes_that_are_not_utf8(tmp_path):
    f = tmp_path / "facts.jsonl"
    f.write_text('{"prompt": "a b", "target": " b"}\n\n{"prompt": "a b", "target": " b"}\n')
    assert read_facts(f) == [Fact("a b", " b", None, f"{f}:1")]
    f.write_bytes(b'{"prompt": "a", "target": " b"}\n{"prompt": "\xff", "target": " c"}\n')
    with pytest.raises(ValueError, match=r":2: not UTF-8 text \(byte 13"):
        read_facts(f)


def test_the_demo_lm_takes_patches(corpus):
    from engram.addressing.hashing import NgramHasher
    from engram.apps.lm.train import build_model, prepare_data
    from test_generate import tiny_cfg

    data = prepare_data(tiny_cfg(corpus))
    hasher = NgramHasher(data.engram_config, data.compression)
    torch.manual_seed(0)
    lm = build_model(tiny_cfg(corpus), data).eval()
    with torch.no_grad():
        for mod in lm.engrams.values():
            mod.wkv.weight.normal_()
    tok = data.tokenizer
    facts = [Fact("And God called the light", " Day"), Fact("the waters called he", " Seas")]
    res = memorize(lm, tok, facts, STEPS, hasher=hasher)
    assert res.losses[-1] < res.losses[0]
    ids = torch.tensor([tok.encode(facts[0].prompt + facts[0].target).ids])
    rows = torch.as_tensor(np.asarray(hasher.hash(ids.numpy())))
    with torch.no_grad():
        before = lm(ids, rows)
    apply_patch(lm, res.patch, hasher=hasher)
    with torch.no_grad():
        assert not torch.equal(lm(ids, rows), before)
    remove_patch(lm, res.patch, hasher=hasher)
    with torch.no_grad():
        assert torch.equal(lm(ids, rows), before)
    with pytest.raises(ValueError, match="pass its hasher"):
        apply_patch(lm, res.patch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert applied_patches(lm, hasher=hasher) == []


def test_target_loss_of_a_left_padded_batch_equals_each_fact_alone(model):
    """batch_of pads in front and target_loss keeps the last positions' logits only: the loss equals the
    plain one, each fact run alone with every logit (mean over all target tokens)."""
    import torch.nn.functional as F

    from engram.memory.memorize import batch_of, encode_facts, target_loss

    facts = [*FACTS, Fact("In the beginning God created the heaven and", " the earth.")]
    enc = encode_facts(hs.tokenizer(), facts)
    assert len({len(f.ids) for f in enc}) > 1  # the padding differs from fact to fact
    ids, mask, labels = batch_of(enc, 0)
    with torch.no_grad():
        got = target_loss(model, EngramLayers.of(model), ids, mask, labels)
        losses = []
        for f in enc:
            logits = model(input_ids=torch.tensor([f.ids])).logits[0]
            t = torch.tensor(f.ids)
            losses.append(F.cross_entropy(logits[f.prompt_len - 1 : -1], t[f.prompt_len :], reduction="sum"))
    want = torch.stack(losses).sum() / sum(len(f.ids) - f.prompt_len for f in enc)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fact_whose_rows_are_all_taken_is_named():
    """Two facts whose prompts end in the same three tokens, with other answers and no subject, share
    every answer row: neither has a row of its own, and memorize says so (not silent)."""
    from engram.memory import NoRowsWarning

    facts = [Fact("In the light and God said", " light"), Fact("And the void and God said", " void"), *FACTS]
    with pytest.warns(NoRowsWarning, match=r"facts have no row of their own"):
        res = memorize(_model(), hs.tokenizer(), facts, MemorizeSettings(steps=1, choice="answer"))
    assert len(res.rows_per_fact) == 4 and len(res.facts_without_rows) >= 1
    assert all(res.rows_per_fact[facts.index(f)] == 0 for f in res.facts_without_rows)


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("bf16", id="cpu-bf16"),
        pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    ],
)
def test_memorize_in_bf16_or_on_a_gpu_writes_a_patch_that_works_on_the_cpu(patch, where):
    """bf16 forwards (autocast; the rows' changes stay float32) and a model on CUDA write a float32
    patch of the same rows as the float32 CPU run, which applies to a float32 CPU model."""
    from engram.device import cpu_has_bf16

    if where == "bf16" and not cpu_has_bf16():
        pytest.skip("this CPU has no bfloat16 arithmetic")
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    m = _model()
    settings = dataclasses.replace(STEPS, precision="bf16" if where == "bf16" else "float32")
    res = memorize(m.to("cuda") if where == "cuda" else m, hs.tokenizer(), FACTS, settings)
    p = res.patch
    assert p.row_format == "float32" and res.losses[-1] < res.losses[0]
    assert {k: v.rows.tolist() for k, v in p.layers.items()} == {
        k: v.rows.tolist() for k, v in patch.layers.items()
    }
    cpu = _model()
    apply_patch(cpu, p)
    remove_patch(cpu, p)


def test_no_row_of_an_ngram_that_reaches_before_the_start_is_chosen(model):
    """A subject at the prompt's start: its first n-grams read pads (any text starting with it reads
    them): they are never chosen; the n-grams wholly inside the prompt are."""
    from engram.memory.choose import fact_rows
    from engram.memory.memorize import encode_facts

    hasher = EngramLayers.of(model).hasher
    (fact,) = encode_facts(hs.tokenizer(), [Fact("Zorvath the land is called", " light", subject="Zorvath")])
    rows = np.asarray(hasher.hash(np.asarray(fact.ids)))  # (T, layers, heads)
    orders = 2 + np.arange(rows.shape[2]) // hasher.config.n_heads
    reaching = {int(rows[t, 0, h]) for t in range(2) for h, n in enumerate(orders) if t - n + 1 < 0}
    inside = {
        int(rows[t, 0, h]) for t in range(rows.shape[0] - 1) for h, n in enumerate(orders) if t - n + 1 >= 0
    }
    chosen = set(fact_rows(hasher, fact, "both")[1].tolist())
    assert chosen and chosen <= inside and not (chosen & (reaching - inside))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_patch_fits_the_same_model_in_bf16_or_fp16(patch, dtype):
    """The reader is compared with a tolerance and the replaced rows by their bfloat16 rounding: the
    model a patch was written on, loaded in bfloat16 or float16, takes it (rows cast to its dtype)."""
    m = _model().to(dtype)
    before = _tables(m)
    apply_patch(m, patch)
    lid, lr = next(iter(patch.layers.items()))
    assert torch.equal(_tables(m)[lid][lr.rows], lr.values.to(dtype))
    remove_patch(m, patch)
    assert all(torch.equal(before[k], v) for k, v in _tables(m).items())


@pytest.mark.parametrize("lr", [0.0, -1.0, float("inf"), float("nan")])
def test_memorize_settings_refuse_an_lr_that_is_not_finite_and_positive(lr):
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        MemorizeSettings(lr=lr)
