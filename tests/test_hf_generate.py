"""generate() with the KV cache (Engram rows hashed step by step by a HashStream per cache) gives
exactly the tokens of decoding without the cache, where every step re-runs the whole sequence:
greedy, sampling with a fixed seed, left-padded batches, beam search and assisted generation."""

from __future__ import annotations

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram

transformers = pytest.importorskip("transformers")

NEW = 8


def _model(seed=0, layers=3, engram_layers=(0, 2)):
    model = S.llama(layers=layers, seed=seed)
    add_engram(model, S.engram_config(engram_layers), compression=S.compression())
    with torch.no_grad():  # a trained-looking Engram: it must matter for the tokens
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.5)
            m.table.weight.normal_(std=1.0)
    return model


def _left_padded():
    a, b = S.batch(1, 6, seed=3)[0], S.batch(1, 3, seed=4)[0]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 3:], mask[1, 3:] = b, 1
    return ids, mask


def _reference(model, ids, mask, new, pick):
    """Decoding without a cache: the whole sequence re-run at every step."""
    ids, mask = ids.clone(), mask.clone()
    with torch.no_grad():
        for _ in range(new):
            logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
            nxt = pick(logits)
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


def _gen(model, ids, mask, **kw):
    kw = {"max_new_tokens": NEW, "min_new_tokens": NEW, "pad_token_id": 0, **kw}
    return model.generate(ids, attention_mask=mask, **kw)


def test_greedy_matches_no_cache_and_engram_matters():
    model = _model()
    ids = S.batch(2, 5, seed=1)
    mask = torch.ones_like(ids)
    got = _gen(model, ids, mask, do_sample=False)
    assert torch.equal(got, _reference(model, ids, mask, NEW, lambda lg: lg.argmax(-1)))
    plain = S.llama(layers=3, seed=0)
    assert not torch.equal(_gen(plain, ids, mask, do_sample=False), got)  # Engram changes the tokens


def test_greedy_left_padded_batch():
    model = _model()
    ids, mask = _left_padded()
    got = _gen(model, ids, mask, do_sample=False)
    assert torch.equal(got, _reference(model, ids, mask, NEW, lambda lg: lg.argmax(-1)))
    # the padded row decodes as it would alone
    alone = _gen(model, ids[1:, 3:], mask[1:, 3:], do_sample=False)
    assert torch.equal(got[1, 6:], alone[0, 3:])


def test_sampling_with_a_fixed_seed():
    model = _model()
    ids, mask = _left_padded()
    torch.manual_seed(7)
    got = _gen(model, ids, mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    torch.manual_seed(7)
    ref = _reference(model, ids, mask, NEW, lambda lg: torch.multinomial(lg.softmax(-1), 1)[:, 0])
    assert torch.equal(got, ref)


def _beam_reference(model, ids, mask, beams, new):
    """Beam search without a cache: every step scores the whole candidate sequences."""
    b = ids.shape[0]
    seqs = ids.repeat_interleave(beams, 0)
    masks = mask.repeat_interleave(beams, 0)
    scores = torch.zeros(b, beams)
    scores[:, 1:] = -1e9
    with torch.no_grad():
        for _ in range(new):
            logp = model(seqs, attention_mask=masks, use_cache=False).logits[:, -1].float().log_softmax(-1)
            cand = (scores.reshape(-1, 1) + logp).reshape(b, -1)  # (b, beams*vocab)
            top, idx = cand.topk(beams, dim=-1)
            src = idx // logp.shape[-1] + torch.arange(b)[:, None] * beams
            tok = idx % logp.shape[-1]
            seqs = torch.cat([seqs[src.reshape(-1)], tok.reshape(-1, 1)], 1)
            masks = torch.cat([masks[src.reshape(-1)], torch.ones(b * beams, 1, dtype=masks.dtype)], 1)
            scores = top
    return seqs.reshape(b, beams, -1)[:, 0]


def test_beam_search_reorders_the_hash_state():
    model = _model()
    ids, mask = _left_padded()
    got = _gen(model, ids, mask, do_sample=False, num_beams=3, length_penalty=0.0, early_stopping=False)
    ref = _beam_reference(model, ids, mask, 3, NEW)
    assert torch.equal(got, ref)


def test_assisted_generation_rolls_rejected_drafts_back(monkeypatch):
    from engram.addressing.stream import HashStream

    calls = []
    draft, commit = HashStream.draft, HashStream.commit
    monkeypatch.setattr(
        HashStream,
        "draft",
        lambda self, ids, *a, **k: calls.append(("draft", ids.shape[1])) or draft(self, ids, *a, **k),
    )
    monkeypatch.setattr(
        HashStream,
        "commit",
        lambda self, n, *a, **k: calls.append(("commit", int(n))) or commit(self, n, *a, **k),
    )
    model = _model(seed=0)
    assistant = _model(seed=1, layers=2, engram_layers=(1,))  # another model: many drafts are rejected
    ids = S.batch(1, 5, seed=5)
    mask = torch.ones_like(ids)
    got = _gen(model, ids, mask, do_sample=False, assistant_model=assistant)
    ref = _reference(model, ids, mask, NEW, lambda lg: lg.argmax(-1))
    assert torch.equal(got, ref)
    drafted = [n for kind, n in calls if kind == "draft"]
    kept = [n for kind, n in calls if kind == "commit"]
    assert drafted and max(drafted) > 1  # candidates were hashed as drafts
    assert any(k < d for k, d in zip(kept, drafted, strict=False))  # and some were rolled back


def test_chunked_prefill_and_a_cache_from_a_plain_call():
    """A cache the model made itself (model(ids, use_cache=True)) continues with exact rows, in
    one-token steps and in chunks (drafted, committed by the next call)."""
    model = _model()
    ids = S.batch(1, 12, seed=6)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        parts = [out.logits]
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for lo, hi in ((5, 6), (6, 9), (9, 12)):
            out = model(ids[:, lo:hi], cache=cache, use_cache=True)
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def test_a_foreign_cache_is_refused():
    model = _model()
    plain = S.llama(layers=3)
    ids = S.batch(1, 6)
    with torch.no_grad():
        out = plain(ids, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        with pytest.raises(ValueError, match="Engram did not hash"):
            model(ids[:, :1], cache=cache)
