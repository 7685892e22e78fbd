"""train_reader (engram.memory.reader): it changes the Engram layers' readers and nothing else (every
table and every other weight bit for bit), learns its training facts, keeps a text's loss in the sum
when given one; a patch records the reader it was written for, so a patch written before the reader
was trained no longer fits, and one written after does; bad settings and text are refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import hf_setup as hs
from engram.hf import add_engram
from engram.memory import (
    EngramLayers,
    Fact,
    MemorizeSettings,
    ReaderSettings,
    apply_patch,
    memorize,
    remove_patch,
    train_reader,
)
from engram.memory.reader import reader_parameters

TRAIN = [
    Fact("The land of Zorvath is called", " light", subject="Zorvath"),
    Fact("And the face of Quill was", " void", subject="Quill"),
    Fact("The river of Amberlow ran to", " Eden", subject="Amberlow"),
]
NEW = [Fact("The house of Brimwick stood in", " Bethel", subject="Brimwick")]
FAST = ReaderSettings(passes=6, lr=1e-2, row_lr=0.1, batch_size=3)


def _model():
    m = hs.llama(seed=0)
    add_engram(m, hs.engram_config(), tokenizer=hs.tokenizer(), zero_init=False, seed=0)
    return m


def _text(n: int = 4, length: int = 16) -> torch.Tensor:
    ids = hs.tokenizer().encode("In the beginning God created the heaven and the earth. " * 8).ids
    return torch.tensor(ids[: n * length]).view(n, length)


def test_train_reader_changes_the_readers_and_nothing_else():
    m = _model()
    state = copy.deepcopy(m.state_dict())
    layers = EngramLayers.of(m)
    readers = {
        f"{name}.{n}"
        for name, mod in m.named_modules()
        if mod in layers.modules.values()
        for n, _ in mod.named_parameters()
        if not n.startswith("table.")
    }
    assert readers and all(k in state for k in readers)
    res = train_reader(m, hs.tokenizer(), TRAIN, FAST)
    after = m.state_dict()
    assert after.keys() == state.keys()
    for k in state:
        if k in readers:
            continue
        assert torch.equal(state[k], after[k]), f"{k} changed"  # tables, backbone: bit for bit
    assert any(not torch.equal(state[k], after[k]) for k in readers)
    assert res.losses[-1] < res.losses[0] and len(res.losses) == FAST.passes and res.facts == 3
    assert res.text_losses == [] and all(0 < c < 1 for c in res.changed.values())
    assert all(p.requires_grad for p in m.parameters())  # as they were
    assert set(reader_parameters(layers)) == set(layers.modules)


def test_the_text_loss_is_reported_each_pass_and_kept_low():
    m = _model()
    text = _text()
    with torch.no_grad():
        before = torch.nn.functional.cross_entropy(
            m(input_ids=text).logits[:, :-1].flatten(0, 1), text[:, 1:].flatten()
        )
    res = train_reader(m, hs.tokenizer(), TRAIN, FAST, text=text)
    assert len(res.text_losses) == FAST.passes and np.isfinite(res.text_losses).all()
    assert res.text_losses[-1] < float(before) + 0.5  # the text is in the sum: its loss does not run off


def test_a_patch_fits_the_reader_it_was_written_for():
    m = _model()
    old = memorize(m, hs.tokenizer(), NEW, MemorizeSettings(steps=2, lr=0.1)).patch
    train_reader(m, hs.tokenizer(), TRAIN, FAST)
    with pytest.raises(ValueError, match="which read the rows"):
        apply_patch(m, old)  # the readers it was written for are gone
    new = memorize(m, hs.tokenizer(), NEW, MemorizeSettings(steps=2, lr=0.1)).patch
    apply_patch(m, new)
    remove_patch(m, new)


def test_the_demo_lm_trains_its_readers(corpus):
    from engram.addressing.hashing import NgramHasher
    from engram.apps.lm.train import build_model, prepare_data
    from test_generate import tiny_cfg

    data = prepare_data(tiny_cfg(corpus))
    hasher = NgramHasher(data.engram_config, data.compression)
    torch.manual_seed(0)
    lm = build_model(tiny_cfg(corpus), data).eval()
    tok = data.tokenizer
    facts = [Fact("And God called the light", " Day"), Fact("the waters called he", " Seas")]
    tables = {lid: m.table.weight.detach().clone() for lid, m in lm.engrams.items()}
    text = torch.tensor(tok.encode("And God said, Let there be light: and there was light.").ids[:12])[None]
    res = train_reader(lm, tok, facts, FAST, text=text, hasher=hasher)
    assert res.losses[-1] < res.losses[0] and len(res.text_losses) == FAST.passes
    assert all(torch.equal(m.table.weight, tables[lid]) for lid, m in lm.engrams.items())


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"passes": 0}, "passes"),
        ({"lr": float("nan")}, "lr"),
        ({"row_lr": 0}, "row_lr"),
        ({"text_weight": -1}, "text_weight"),
        ({"rows_per_fact": 0}, "rows_per_fact"),
    ],
)
def test_bad_settings_are_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        ReaderSettings(**kw)


def test_bad_text_is_refused_before_any_change():
    m = _model()
    state = copy.deepcopy(m.state_dict())
    for text, says in ((torch.zeros(4, dtype=torch.long), "token blocks"), (_text().float(), "token blocks")):
        with pytest.raises(ValueError, match=says):
            train_reader(m, hs.tokenizer(), TRAIN, FAST, text=text)
    long = torch.zeros(1, 100_000, dtype=torch.long)
    with pytest.raises(ValueError, match="longer than the model"):
        train_reader(m, hs.tokenizer(), TRAIN, FAST, text=long)
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
