"""PEFT and TRL with an Engram model: the Trainer's and TRL's default optimizer refused before the first
step in one line naming build_optimizer (never torch's sparse-norm error); a LoRA that would train with
Engram silently frozen refused, saying how; build_optimizer training Engram beside an adapter; the
adapter folder with Engram's tensors loaded by AutoPeftModelForCausalLM (and transformers' own adapter
loading) with the trained model's logits."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram, build_optimizer, save_engram, set_engram_trainable

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _model():
    return add_engram(S.llama(), S.engram_config(), tokenizer=S.tokenizer())


def _tok():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    )


def _sft(tmp_path, model, **kw):
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_length=32,
        disable_tqdm=True,
        bf16=False,  # TRL's default on a machine that has it: the model's forward would stay under autocast
    )
    ds = datasets.Dataset.from_list([{"text": t} for t in S.TEXT])
    return trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=_tok(), **kw)


def _lora(**kw):
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **kw)


def test_sft_trainer_default_optimizer_is_refused_before_the_first_step(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _sft(tmp_path, model)
    with pytest.raises(
        ValueError, match=r"sparse row gradient that no optimizer takes.*build_optimizer\(model\)"
    ) as e:
        trainer.train()
    assert "\n" not in str(e.value) and trainer.state.global_step == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing stepped


def test_trainer_default_optimizer_is_refused_too(tmp_path):
    model = _model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "t"), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    data = [{"input_ids": x, "labels": x} for x in S.batch(4, 12)]
    with pytest.raises(ValueError, match="Trainer's default optimizer"):
        transformers.Trainer(model=model, args=args, train_dataset=data).train()


def test_sft_trainer_with_build_optimizer_trains_engram(tmp_path):
    model = _model()
    table = model.engram.module(1).table.weight
    before = table.detach().clone()
    _sft(tmp_path, model, optimizers=(build_optimizer(model), None)).train()
    changed = (table.detach() != before).any(-1)
    assert 0 < int(changed.sum()) < table.shape[0]  # the rows the batches touched, and only those


def test_sft_trainer_with_peft_config_refuses_a_silently_frozen_engram(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match=r"peft froze Engram's table and wkv.*build_optimizer\(peft_model\)"):
        _sft(tmp_path, model, peft_config=_lora()).train()
    frozen = _model()
    set_engram_trainable(frozen, False)  # meant: the adapter alone trains
    before = {k: v.clone() for k, v in frozen.engram.state_dict().items()}
    trainer = _sft(tmp_path, frozen, peft_config=_lora())
    trainer.train()
    after = trainer.model.base_model.model.engram.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_engram_trains_beside_an_adapter_and_loads_with_it(tmp_path):
    model = _model()
    pm = peft.get_peft_model(model, _lora())
    att = pm.base_model.model.engram
    before = {k: v.clone() for k, v in att.state_dict().items()}
    _sft(tmp_path, pm, optimizers=(build_optimizer(pm, lr=1e-2, table_lr=1e-1), None)).train()
    assert not torch.equal(before["layers.1.wkv.weight"], att.state_dict()["layers.1.wkv.weight"])
    assert not torch.equal(before["layers.1.table.weight"], att.state_dict()["layers.1.table.weight"])
    base = tmp_path / "base"
    _model().save_pretrained(base)  # the base folder the adapter names: Engram as it was before training
    _tok().save_pretrained(base)
    pm.peft_config["default"].base_model_name_or_path = str(base)
    adapter = tmp_path / "adapter"
    pm.save_pretrained(adapter)
    assert save_engram(pm, adapter) == adapter / "adapter_model.safetensors"
    x = S.batch(2, 9)
    pm.eval()
    with torch.no_grad():
        ref = pm(input_ids=x).logits
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(adapter)
        assert type(loaded.base_model.model).__name__ == "EngramLlamaForCausalLM"
        assert torch.equal(loaded(input_ids=x).logits, ref)
        native = transformers.AutoModelForCausalLM.from_pretrained(adapter)  # transformers' adapter loading
        assert torch.equal(native(input_ids=x).logits, ref)


def test_save_engram_on_a_peft_model_needs_the_adapter_saved_first(tmp_path):
    pm = peft.get_peft_model(_model(), _lora())
    with pytest.raises(FileNotFoundError, match=r"save the adapter first \(peft_model.save_pretrained"):
        save_engram(pm, tmp_path)


def test_an_own_sparse_optimizer_is_allowed_when_said():
    model = _model()
    with torch.no_grad():
        model.engram.module(1).wkv.weight.normal_(std=0.3)  # the value half too: the table gets a gradient
    table = model.engram.module(1).table.weight
    opt = torch.optim.SparseAdam([table], lr=1e-2)
    x = S.batch(2, 9)
    with pytest.raises(ValueError, match="allow_sparse_gradients = True"):
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)
    model.engram.allow_sparse_gradients = True
    before = table.detach().clone()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert not torch.equal(before, table.detach())


def test_family_classes_copy_and_resolve_by_name():
    """deepcopy keeps the family class; `engram.hf.auto.EngramLlamaForCausalLM` resolves by name (peft's
    auto mapping imports the module and takes the class by its name)."""
    from engram.hf import auto

    model = _model()
    x = S.batch(2, 9)
    with torch.no_grad():
        other = copy.deepcopy(model)
        assert type(other) is type(model) and torch.equal(
            other(input_ids=x).logits, model(input_ids=x).logits
        )
    assert auto.EngramLlamaForCausalLM is type(model) and auto.EngramLlamaConfig is type(model.config)
    with pytest.raises(AttributeError):
        auto.EngramNoSuchModel  # noqa: B018
