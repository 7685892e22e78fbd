"""engram.hf.auto: a folder engram-lm writes is an Engram model to transformers. `from_pretrained` after
`import engram`, and with `trust_remote_code=True` without it, returns the model with Engram, logits equal
to `load_engram`'s bit for bit; AutoConfig names the base and the settings; pipelines and generate use
Engram; save -> load round-trips exactly with each table written once; bad parts are refused through
`from_pretrained` too; the folder's code never runs after `import engram`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram, export_fp8, load_engram, remove_engram

transformers = pytest.importorskip("transformers")

TESTS = Path(__file__).parent


def _engram_model(base=None, layers=(1,)):
    model = add_engram(
        base if base is not None else S.llama(), S.engram_config(layers), tokenizer=S.tokenizer()
    )
    with torch.no_grad():  # a trained-looking part: Engram changes the logits
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.3)
    return model.eval()


def _tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    )


def _folder(tmp_path, model=None, name="m"):
    model = model if model is not None else _engram_model()
    d = tmp_path / name
    model.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return model, d


def test_from_pretrained_is_the_engram_model_bit_for_bit(tmp_path):
    model, d = _folder(tmp_path)
    x = S.batch(3, 11)
    with torch.no_grad():
        ref = model(x).logits
        backbone = transformers.LlamaForCausalLM.from_pretrained(d)(x).logits
        loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
        assert type(loaded).__name__ == "EngramLlamaForCausalLM"
        assert isinstance(loaded, transformers.LlamaForCausalLM) and not loaded.training
        assert torch.equal(loaded(x).logits, ref)
        assert not torch.allclose(backbone, ref, atol=1e-3)  # the backbone alone is another model
        via_part = load_engram(transformers.LlamaForCausalLM.from_pretrained(d), d)
        assert torch.equal(via_part(x).logits, loaded(x).logits)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_config_names_the_base_and_the_settings_and_tables_are_stored_once(tmp_path):
    from safetensors import safe_open

    model, d = _folder(tmp_path)
    cfg = transformers.AutoConfig.from_pretrained(d)
    assert cfg.model_type == "engram" and type(cfg).__name__ == "EngramLlamaConfig"
    assert cfg.base_model_type == "llama" and cfg.base_architectures == ["LlamaForCausalLM"]
    assert cfg.hidden_size == S.HIDDEN and cfg.engram["config"]["layer_ids"] == [1]
    assert cfg.engram["part"] == "engram" and cfg.engram["boundaries"] is None
    raw = json.loads((d / "config.json").read_text())
    assert raw["architectures"] == ["EngramLlamaForCausalLM"]
    assert raw["auto_map"]["AutoModelForCausalLM"] == "modeling_engram.EngramForCausalLM"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "engram" in k]  # noqa: SIM118  # the table is in engram/ alone
    table = model.engram.module(1).table.weight
    on_disk = sum(p.stat().st_size for p in d.rglob("*.safetensors"))
    backbone = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("engram.")
    )
    assert on_disk < backbone + 1.5 * table.numel() * table.element_size()


def test_round_trip_save_load_save(tmp_path):
    model, d = _folder(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    loaded.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    x = S.batch(2, 9)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)
    for k, v in model.engram.state_dict().items():
        assert torch.equal(again.engram.state_dict()[k], v), k


def test_fp8_part_loads_and_saves_in_its_own_format(tmp_path):
    from engram.model.table import QuantTable

    model, d = _folder(tmp_path)
    export_fp8(model, d)  # the part in FP8 (memory-mapped when loaded)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert (
        isinstance(loaded.engram.module(1).table, QuantTable)
        or "Mmap" in type(loaded.engram.module(1).table).__name__
    )
    loaded.save_pretrained(tmp_path / "again")
    cfg = json.loads((tmp_path / "again" / "engram" / "config.json").read_text())
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    x = S.batch(2, 9)
    with torch.no_grad():
        assert torch.equal(plain(x).logits, loaded(x).logits)
    assert cfg["engram_layer_ids"] == [1]


def test_pipeline_and_generate_use_engram(tmp_path):
    model, d = _folder(tmp_path)
    tok = _tokenizer()
    ids = torch.tensor(S.encode("And God said, Let there be")[:1])
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), ref)
    backbone = transformers.LlamaForCausalLM.from_pretrained(d)
    assert not torch.equal(backbone.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), ref)
    pipe = transformers.pipeline("text-generation", model=str(d))
    assert type(pipe.model).__name__ == "EngramLlamaForCausalLM"
    out = pipe("And God said, Let there be", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert out == tok.decode(ref[0], skip_special_tokens=True)


def test_from_config_builds_engram_from_the_folders_part(tmp_path):
    _, d = _folder(tmp_path)
    cfg = transformers.AutoConfig.from_pretrained(d)
    fresh = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(fresh).__name__ == "EngramLlamaForCausalLM" and hasattr(fresh, "engram")
    assert fresh.engram.config.layer_ids == (1,)
    cfg._name_or_path = ""  # no folder to read the compression map from, no tokenizer named
    with pytest.raises(ValueError, match="needs the tokenizer's compression map"):
        transformers.AutoModelForCausalLM.from_config(cfg)


def test_remove_engram_gives_the_base_classes_back(tmp_path):
    model = _engram_model()
    remove_engram(model)
    assert type(model) is transformers.LlamaForCausalLM and type(model.config) is transformers.LlamaConfig
    assert model.config.model_type == "llama" and not hasattr(model.config, "engram")
    model.save_pretrained(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["model_type"] == "llama"


def _family(name):
    tf, v, h = transformers, S.vocab(), S.HIDDEN
    small = dict(vocab_size=v, hidden_size=h, num_hidden_layers=2, num_attention_heads=4)
    kv = dict(small, intermediate_size=64, num_key_value_heads=2)
    return {
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**kv)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, **kv)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **kv)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=8, **kv)),
        "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(intermediate_size=64, **small)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(intermediate_size=64, **small)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(ffn_dim=64, word_embed_proj_dim=h, **small)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=v, n_embd=h, n_layer=2, n_head=4)),
    }[name]()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma", "phi", "gpt_neox", "opt", "gpt2"])
def test_other_families_round_trip(tmp_path, family):
    torch.manual_seed(0)
    base = _family(family).eval()
    name = type(base).__name__
    model = _engram_model(base)
    _, d = _folder(tmp_path, model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert type(loaded).__name__ == f"Engram{name}"
    x = S.batch(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


# ------------------------------------------------------------------------------- refusals
def test_damaged_part_is_refused_through_from_pretrained_naming_the_file(tmp_path):
    _, d = _folder(tmp_path)
    shard = next((d / "engram").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x5A  # a table byte
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors"):
        transformers.AutoModelForCausalLM.from_pretrained(d)


def test_part_for_another_hidden_size_or_tokenizer_is_refused(tmp_path):
    _, d = _folder(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["hidden_size"] = 64
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"hidden size 32, but the model in .* has hidden size 64"):
        transformers.AutoModelForCausalLM.from_pretrained(d)
    _, d2 = _folder(tmp_path, name="m2")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())  # as hf_setup's, trained on other text: the same size, other ids
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    other.train_from_iterator([t.upper()[::-1] for t in S.TEXT], trainer=trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=other, eos_token="<eos>").save_pretrained(d2)
    with pytest.raises(ValueError, match=r"compression.* does not fit the tokenizer"):
        transformers.AutoModelForCausalLM.from_pretrained(d2)


def test_settings_that_disagree_with_the_part_are_refused(tmp_path):
    _, d = _folder(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["engram"]["config"]["n_heads"] = 3
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="Engram settings disagree with its part"):
        transformers.AutoModelForCausalLM.from_pretrained(d)


def test_a_folder_without_its_part_is_refused(tmp_path):
    import shutil

    _, d = _folder(tmp_path)
    shutil.rmtree(d / "engram")
    with pytest.raises(FileNotFoundError, match="without an Engram part"):
        transformers.AutoModelForCausalLM.from_pretrained(d)


# ------------------------------------------------------------------------ trust_remote_code
def _run(code: str, *, block_engram: bool = False) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter that never imports engram itself (`block_engram`: as if engram-lm were
    not installed)."""
    prefix = "import sys; sys.modules['engram'] = None\n" if block_engram else ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": os.environ.get("HF_MODULES_CACHE", "")}
    env = {k: v for k, v in env.items() if v}
    return subprocess.run(
        [sys.executable, "-c", prefix + code], capture_output=True, text=True, env=env, timeout=300
    )


def test_trust_remote_code_loads_engram_without_importing_it(tmp_path):
    model, d = _folder(tmp_path)
    x = S.batch(2, 9)
    with torch.no_grad():
        torch.save(model(x).logits, tmp_path / "ref.pt")
    torch.save(x, tmp_path / "x.pt")
    code = f"""
import sys, torch, transformers
torch.set_num_threads({torch.get_num_threads()})  # the parent's: the same float sums
assert "engram" not in sys.modules
m = transformers.AutoModelForCausalLM.from_pretrained({str(d)!r}, trust_remote_code=True)
assert type(m).__name__ == "EngramLlamaForCausalLM", type(m)
x = torch.load({str(tmp_path / "x.pt")!r})
with torch.no_grad():
    assert torch.equal(m(x).logits, torch.load({str(tmp_path / "ref.pt")!r}))
print("ok")
"""
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_trust_remote_code_without_engram_lm_says_what_to_install(tmp_path):
    _, d = _folder(tmp_path)
    r = _run(
        f"import transformers\ntransformers.AutoModelForCausalLM.from_pretrained({str(d)!r}, trust_remote_code=True)",
        block_engram=True,
    )
    assert r.returncode != 0
    assert "install engram-lm to load it (pip install engram-lm)" in r.stderr


def test_after_import_engram_the_folders_code_never_runs(tmp_path):
    _, d = _folder(tmp_path)
    marker = tmp_path / "ran"
    (d / "modeling_engram.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
    assert hasattr(loaded, "engram") and not marker.exists()
    r = _run(
        f"import engram, transformers\ntransformers.AutoModelForCausalLM.from_pretrained({str(d)!r})\nprint('ok')"
    )
    assert r.returncode == 0 and not marker.exists(), r.stderr[-2000:]


def test_import_engram_does_not_import_transformers():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, engram; print('transformers' in sys.modules)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.stdout.strip() == "False", r.stderr


# ------------------------------------------------------------------------------ older folders
def _older_folder(tmp_path):
    """A folder as engram-lm wrote it before Engram models had their own type: the README's recipe
    (`save_pretrained` of the model with Engram, the tables in model.safetensors, then `save_engram`)."""
    from engram.hf import save_engram

    model = _engram_model()
    x = S.batch(2, 9)
    with torch.no_grad():
        ref = model(x).logits
    remove = remove_engram(model)  # the plain class: save_pretrained as transformers writes it
    d = tmp_path / "old"
    model.engram = remove  # in the state dict as the old recipe had it (the table in model.safetensors)
    transformers.LlamaForCausalLM.save_pretrained(model, d)
    del model.engram
    from engram.hf.attach import add_engram as attach_core

    attach_core(model, remove.config, compression=remove.compression, modules={1: remove.module(1)})
    save_engram(model, d)
    _tokenizer().save_pretrained(d)
    return d, x, ref


def test_older_folders_load_with_a_note_and_upgrade(tmp_path, capsys):
    from safetensors import safe_open

    from engram.cli import main
    from engram.hf.io import OlderFolderWarning

    d, x, ref = _older_folder(tmp_path)
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert any(k.startswith("engram.") for k in f.keys())  # noqa: SIM118
    assert not hasattr(transformers.AutoModelForCausalLM.from_pretrained(d), "engram")  # why it must upgrade
    with pytest.warns(OlderFolderWarning, match=r"engram hf-upgrade .*old"):
        loaded = load_engram(transformers.AutoModelForCausalLM.from_pretrained(d), d)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref)
    assert main(["hf-upgrade", str(d)]) == 0
    out = capsys.readouterr().out
    assert "now EngramLlamaForCausalLM" in out and "second copy removed from model.safetensors" in out
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("engram.") for k in f.keys())  # noqa: SIM118
    upgraded = transformers.AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        assert torch.equal(upgraded(x).logits, ref)
    assert main(["hf-upgrade", str(d)]) == 0 and "nothing to do" in capsys.readouterr().out


def test_upgrade_refuses_a_damaged_part_and_changes_nothing(tmp_path, capsys):
    from engram.cli import main

    d, _, _ = _older_folder(tmp_path)
    shard = next((d / "engram").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x5A
    shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in d.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["hf-upgrade", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "CRC32" in err, err
    assert {p: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
    bare = tmp_path / "bare"
    S.save_folder(bare)
    assert main(["hf-upgrade", str(bare)]) == 2 and "has no Engram part" in capsys.readouterr().err


def test_convert_of_a_model_folder_gives_a_model_folder(tmp_path, capsys):
    """`engram convert FOLDER DST --to fp8`: HF's files copied, the part converted; DST loads with
    from_pretrained as the model whose part export_fp8 wrote."""
    import shutil

    from engram.cli import main

    model, d = _folder(tmp_path)
    assert main(["convert", str(d), str(tmp_path / "fp8"), "--to", "fp8"]) == 0
    assert sorted(p.name for p in (tmp_path / "fp8").iterdir()) == sorted(p.name for p in d.iterdir())
    shutil.copytree(d, tmp_path / "exported")
    export_fp8(model, tmp_path / "exported")
    x = S.batch(2, 9)
    with torch.no_grad():
        converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")(x).logits
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")(x).logits
        assert torch.equal(converted, exported) and not torch.equal(converted, model(x).logits)
    (d / "subfolder").mkdir()
    capsys.readouterr()
    assert main(["convert", str(d), str(tmp_path / "other"), "--to", "fp8"]) == 2
    assert "holds folders besides its Engram part (subfolder)" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
