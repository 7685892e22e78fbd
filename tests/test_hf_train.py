"""engram.hf.build_optimizer: sparse table updates with the HF Trainer's default arguments (its
gradient-norm logging never meets a sparse gradient), a plain loop, gradient accumulation, a
frozen backbone, gradient checkpointing, and LoRA + Engram when peft is installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_setup as S
from engram.hf import EngramCollator, EngramOptimizer, add_engram, build_optimizer

transformers = pytest.importorskip("transformers")


def _model(layers=(1,)):
    return add_engram(S.llama(), S.engram_config(layers), compression=S.compression())


def _features(n=8, t=12):
    return [{"input_ids": S.batch(1, t, seed=100 + i)[0].tolist()} for i in range(n)]


def _loss(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("table_optimizer", ["adam", "adagrad", "sinkhorn"])
def test_plain_loop_updates_only_touched_rows_and_matches_separate_optimizers(table_optimizer):
    """EngramOptimizer gives the same weights as AdamW + the table optimizer stepped by hand."""
    from engram.model.optim import SparseRowAdagrad, SparseRowAdam
    from engram.model.sinkhorn import SparseSinkhorn

    cls = {"adam": SparseRowAdam, "adagrad": SparseRowAdagrad, "sinkhorn": SparseSinkhorn}[table_optimizer]
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    collate = EngramCollator(a, pad_token_id=0)
    batch = collate(_features(4))
    opt = build_optimizer(a, lr=1e-3, table_lr=1e-2, table_optimizer=table_optimizer)
    assert isinstance(opt.tables, cls)
    table_b = b.engram.module(1).table.weight
    dense_b = torch.optim.AdamW(
        [p for p in b.parameters() if p is not table_b], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0
    )
    sparse_b = cls([table_b], lr=1e-2)
    before = a.engram.module(1).table.weight.detach().clone()
    for _ in range(3):
        _loss(a, batch).backward()
        assert a.engram.module(1).table.weight.grad is None  # taken off .grad: held by the optimizer
        opt.step()
        opt.zero_grad()
        _loss(b, batch).backward()
        assert table_b.grad.is_sparse
        dense_b.step()
        sparse_b.step()
        dense_b.zero_grad()
        sparse_b.zero_grad()
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    after = a.engram.module(1).table.weight.detach()
    touched = np.unique(batch["engram_rows"][:, :, 0].numpy())
    changed = (after != before).any(-1).nonzero()[:, 0].numpy()
    assert set(changed) <= set(touched) and len(changed) > 0  # sparse: untouched rows never move


def test_gradient_accumulation_sums_sparse_grads():
    model = _model()
    batch = EngramCollator(model, pad_token_id=0)(_features(2))
    opt = build_optimizer(model)
    _loss(model, batch).backward()
    _loss(model, batch).backward()
    table = model.engram.module(1).table.weight
    g2 = opt.pending[table].coalesce().to_dense()
    opt.zero_grad()
    assert not opt.pending
    _loss(model, batch).backward()
    torch.testing.assert_close(g2, 2 * opt.pending[table].coalesce().to_dense())


def test_freeze_backbone_trains_only_engram():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, freeze_backbone=True, lr=1e-2)
    batch = EngramCollator(model, pad_token_id=0)(_features(2))
    for _ in range(2):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == n.startswith("engram."), n


def _trainer(model, tmp_path, collator, **args):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        **args,
    )
    opt = build_optimizer(model, lr=1e-3, table_lr=1e-2)
    return transformers.Trainer(
        model=model, args=targs, train_dataset=_features(8), data_collator=collator, optimizers=(opt, None)
    )


@pytest.mark.parametrize("precomputed", [True, False])
def test_hf_trainer_default_arguments(tmp_path, precomputed):
    """A real Trainer run with its defaults (max_grad_norm=1.0: the norm is taken every step)."""
    pytest.importorskip("accelerate")  # the Trainer needs it (transformers[torch])
    model = _model()
    table = model.engram.module(1).table.weight
    before = table.detach().clone()
    wkv = model.engram.module(1).wkv.weight.detach().clone()
    if precomputed:
        collator = EngramCollator(model, pad_token_id=0)
    else:
        collator = transformers.DataCollatorForLanguageModeling(
            _HFTok(), mlm=False
        )  # rows hashed inside forward
    trainer = _trainer(model, tmp_path, collator)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(np.isfinite(h["grad_norm"]) for h in logs)
    assert not torch.equal(table, before) and not torch.equal(model.engram.module(1).wkv.weight, wkv)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    assert isinstance(inner, EngramOptimizer)


class _HFTok:
    """Just what DataCollatorForLanguageModeling reads of a tokenizer: padding."""

    pad_token_id = 0
    pad_token = "<pad>"
    padding_side = "right"

    def pad(self, features, return_tensors="pt", pad_to_multiple_of=None, **kw):
        t = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), t, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask}


def test_gradient_checkpointing_gives_the_same_gradients():
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        for m in (a, b):
            m.engram.module(1).wkv.weight.normal_(std=0.1)
    b.load_state_dict(a.state_dict())
    a.train()
    b.train()
    for m in (a, b):  # the gradients are read here, with no optimizer to take them
        m.engram.allow_sparse_gradients = True
    b.activation_checkpointing_enable()  # transformers 5.24: gradient_checkpointing_enable, renamed
    assert all(layer.gradient_checkpointing for layer in b.model.layers)
    batch = EngramCollator(a, pad_token_id=0)(_features(2))
    _loss(a, batch).backward()
    _loss(b, batch).backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, n
            continue
        ga = p.grad.to_dense() if p.grad.is_sparse else p.grad
        gb = q.grad.to_dense() if q.grad.is_sparse else q.grad
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7, msg=n)


def test_lora_and_engram_train_together():
    peft = pytest.importorskip("peft")
    model = _model()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = build_optimizer(model, freeze_backbone=True, lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = EngramCollator(model, pad_token_id=0)(_features(2))
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any("lora_" in n for n in moved) and any(".engram." in n for n in moved)
    assert all("lora_" in n or ".engram." in n for n in moved)


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="table_optimizer='sgd'"):
        build_optimizer(model, table_optimizer="sgd")
    with pytest.raises(ValueError, match=r"build_optimizer: lr must be a finite number > 0.0, got 0"):
        build_optimizer(model, lr=0)
    with pytest.raises(ValueError, match="no Engram attached"):
        build_optimizer(S.llama())
