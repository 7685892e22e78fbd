"""Document boundaries for packed sequences: windows restart after EOS (boundaries='eos') or where
position_ids == 0 (boundaries='position_ids'); by default (V4.1) they run across documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_setup as S
from engram.hf import EngramCollator, add_engram, load_engram, save_engram

transformers = pytest.importorskip("transformers")

EOS = 0


def _model(**kw):
    model = add_engram(S.llama(), S.engram_config(), compression=S.compression(), **kw)
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.5)
    seen = []
    model.engram.module(1).register_forward_hook(lambda m, args, out: seen.append(args[1]) and None)
    return model, seen


def _packed():
    a, b = S.batch(1, 5, seed=11)[0], S.batch(1, 6, seed=12)[0]
    ids = torch.cat([a, torch.tensor([EOS]), b])[None]  # doc a, EOS, doc b
    pos = torch.cat([torch.arange(6), torch.arange(6)])[None]
    return ids, pos, b


def _fresh_rows(model, b):
    return model.engram.hasher.hash(b[None].numpy())[0, :, 0]


def test_default_windows_cross_documents():
    model, seen = _model()
    ids, pos, b = _packed()
    model(ids, position_ids=pos)
    assert not np.array_equal(seen[-1][0, 6:].numpy(), _fresh_rows(model, b))


@pytest.mark.parametrize("mode", ["eos", "position_ids"])
def test_windows_restart_at_document_boundaries(mode):
    model, seen = _model(boundaries=mode)
    ids, pos, b = _packed()
    model(ids, position_ids=pos)
    np.testing.assert_array_equal(seen[-1][0, 6:].numpy(), _fresh_rows(model, b))
    # the collator gives the same rows
    feats = [{"input_ids": ids[0].tolist(), "position_ids": pos[0].tolist()}]
    batch = EngramCollator(model, pad_token_id=0)(feats)
    np.testing.assert_array_equal(batch["engram_rows"][0, :, 0].numpy(), seen[-1][0].numpy())


def test_position_ids_mode_needs_them():
    model, _ = _model(boundaries="position_ids")
    with pytest.raises(ValueError, match="needs position_ids"):
        model(S.batch(1, 5))
    with pytest.raises(ValueError, match="every feature needs position_ids"):
        EngramCollator(model, pad_token_id=0)([{"input_ids": [3, 4, 5]}])


def test_generate_with_eos_restarts_matches_no_cache():
    model, _ = _model(boundaries="eos")
    ids, _, _ = _packed()
    mask = torch.ones_like(ids)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1)
    ref = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = model(ref, use_cache=False).logits[:, -1].argmax(-1)
            ref = torch.cat([ref, nxt[:, None]], 1)
    assert torch.equal(got, ref)


def test_boundary_option_saved_with_the_part(tmp_path):
    model, _ = _model(boundaries="eos")
    save_engram(model, tmp_path / "e")
    loaded = load_engram(S.llama(), tmp_path / "e")
    assert loaded.engram.rows.boundaries == "eos" and loaded.engram.config.restart_after_id == EOS
    ids, _, _ = _packed()
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_cached_calls_with_position_id_restarts_match_one_pass():
    """Prefill, one-token steps and a chunk holding a restart (position 0) through the KV cache give
    the logits of one pass over the whole packed sequence."""
    model, _ = _model(boundaries="position_ids")
    ids, pos, _ = _packed()
    ids = torch.cat([ids, S.batch(1, 4, seed=13)], 1)
    pos = torch.cat([pos, torch.tensor([[6, 0, 1, 2]])], 1)  # a third document starts inside a chunk
    with torch.no_grad():
        full = model(ids, position_ids=pos).logits
        out = model(ids[:, :8], position_ids=pos[:, :8], use_cache=True)
        parts, cache = [out.logits], out.cache
        for lo, hi in ((8, 9), (9, 10), (10, 13), (13, 14), (14, 16)):
            out = model(ids[:, lo:hi], position_ids=pos[:, lo:hi], cache=cache, use_cache=True)
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
