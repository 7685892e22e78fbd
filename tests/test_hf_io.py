"""engram.hf.save_engram / load_engram / export_fp8: the Engram part alone, in the V4.1 format,
round-tripped exactly; FP8 exports served memory-mapped (and by engram.systems) give the logits of
the model with its tables quantised; bad loads refused with nothing attached."""

from __future__ import annotations

import json

import pytest
import torch

import hf_setup as S
from engram.checkpoint.mmap_table import MmapFP8Table
from engram.hf import add_engram, export_fp8, load_engram, save_engram
from engram.model.table import FP8Table, TrainableTable

transformers = pytest.importorskip("transformers")


def _trained(layers=(0, 2)):
    model = add_engram(S.llama(), S.engram_config(layers), compression=S.compression())
    with torch.no_grad():
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.3)
            m.q_weight.uniform_(0.5, 1.5)
    return model


def test_save_and_load_round_trip(tmp_path):
    model = _trained()
    x = S.batch(2, 9)
    ref = model(x).logits
    save_engram(model, tmp_path / "e")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    for key in (
        "engram_layer_ids",
        "engram_vocab_size",
        "engram_num_embeddings",
        "engram_max_ngram_size",
        "engram_n_heads",
        "engram_head_dim",
        "engram_pad_token_id",
        "engram_compressed_vocab_size",
    ):
        assert key in cfg
    assert cfg["engram_layer_ids"] == [0, 2]
    fresh = S.llama()  # same seed: the same backbone
    assert load_engram(fresh, tmp_path / "e") is fresh
    assert isinstance(fresh.engram.module(0).table, TrainableTable)
    assert torch.equal(fresh(x).logits, ref)
    for k, v in model.engram.state_dict().items():
        assert torch.equal(fresh.engram.state_dict()[k], v), k


def test_fp8_export_served_from_a_memory_mapped_table(tmp_path):
    model = _trained()
    x = S.batch(2, 9)
    export_fp8(model, tmp_path / "fp8")
    served = load_engram(S.llama(), tmp_path / "fp8", mmap=True)
    assert isinstance(served.engram.module(0).table, MmapFP8Table)
    with torch.no_grad():  # the attached model with its tables quantised
        for m in model.engram.layers.values():
            m.table = FP8Table.from_float(m.table.weight)
        ref = model(x).logits
        assert torch.equal(served(x).logits, ref)
        from engram.systems.prefetch import offload_engram

        offload_engram(served, "ssd")  # the systems tier reads the same file
        torch.testing.assert_close(served(x).logits, ref, rtol=0, atol=0)


def test_load_refuses_another_hidden_size_and_attaches_nothing(tmp_path):
    save_engram(_trained(), tmp_path / "e")
    other = S.llama(hidden=64)
    with pytest.raises(ValueError, match="hidden size 32, but LlamaForCausalLM has hidden size 64"):
        load_engram(other, tmp_path / "e")
    assert not hasattr(other, "engram") and not other._forward_pre_hooks
    small = S.llama(layers=2)
    with pytest.raises(ValueError, match=r"layers \[0, 2\].*2 decoder layers"):
        load_engram(small, tmp_path / "e")
    assert not hasattr(small, "engram")


def test_load_refuses_another_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    save_engram(_trained(), tmp_path / "e")
    other = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    model = S.llama()
    with pytest.raises(ValueError, match="another tokenizer"):
        load_engram(model, tmp_path / "e", tokenizer=other)
    assert not hasattr(model, "engram")
    load_engram(model, tmp_path / "e", tokenizer=S.tokenizer())  # the right one is accepted


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_load_refuses_attachment_options_that_are_not_a_file(tmp_path, kind):
    import os

    model = add_engram(S.llama(), S.engram_config((0, 2)), compression=S.compression(), boundaries="eos")
    save_engram(model, tmp_path / "e")
    opts = tmp_path / "e" / "engram_hf.json"
    opts.unlink()
    if kind == "fifo":
        os.mkfifo(opts)  # opening it would block for good
        what = "named pipe"
    else:
        opts.mkdir()
        what = "folder"
    fresh = S.llama()
    with pytest.raises(
        ValueError, match=rf"'engram_hf.json': a {what}.*boundaries, eos_token_id.*save the part again"
    ):
        load_engram(fresh, tmp_path / "e")
    assert not hasattr(fresh, "engram")


def test_load_refuses_a_part_whose_seed_was_edited(tmp_path):
    from engram.addressing.layout import Layout, layout_fingerprint

    model = _trained()
    save_engram(model, tmp_path / "e")
    path = tmp_path / "e" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["engram_seed"] += 1
    path.write_text(json.dumps(cfg))
    want = layout_fingerprint(Layout(model.engram.config))
    fresh = S.llama()
    with pytest.raises(ValueError, match=rf"saved for the layout with fingerprint {want}, but config"):
        load_engram(fresh, tmp_path / "e")
    assert not hasattr(fresh, "engram")


def test_save_pretrained_folder_keeps_hf_files_and_loads_both(tmp_path):
    """`model.save_pretrained(d)` of a model with Engram writes HF's files without the tables and the part in
    d/engram; `save_engram(model, d)` after it rewrites the part alone (no file of HF's changes: it once
    overwrote config.json, and removed HF's shards and index); `from_pretrained(d)` gives the model's logits,
    and so does `load_engram` of the part on the plain backbone."""
    import hashlib

    model = _trained()
    x = S.batch(2, 9)
    ref = model(x).logits
    d = tmp_path / "hf"
    model.save_pretrained(d, max_shard_size="40KB")  # several shards and an index, as large models have
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.is_file()}
    assert "model.safetensors.index.json" in before and len([n for n in before if n.startswith("model-")]) > 1
    part = save_engram(model, d)
    assert part == d / "engram" and (part / "config.json").is_file()
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.is_file()}
    assert after == before
    assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(d)(x).logits, ref)
    loaded = load_engram(transformers.LlamaForCausalLM.from_pretrained(d), d)
    assert torch.equal(loaded(x).logits, ref)
    with pytest.raises(
        ValueError, match=r"has Engram attached already: from_pretrained .* drop the load_engram"
    ):
        load_engram(transformers.AutoModelForCausalLM.from_pretrained(d), d)
    # an HF folder without a part: the error says how to make one
    bare = tmp_path / "bare"
    S.llama().save_pretrained(bare)
    with pytest.raises(FileNotFoundError, match="without an Engram part"):
        load_engram(S.llama(), bare)


def test_a_checkpoint_is_never_saved_over_another_models_config(tmp_path):
    from engram.checkpoint.v41 import save_checkpoint

    model = _trained()
    S.llama().save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    att = model.engram
    with pytest.raises(ValueError, match=r"not an Engram checkpoint's config\.json"):
        save_checkpoint(tmp_path, att.config, {int(k): m for k, m in att.layers.items()})
    assert (tmp_path / "config.json").read_text() == config


@pytest.mark.parametrize("content", ['{"note": "no model_type, no engram keys"}', "[1, 2]", "not json"])
def test_save_engram_beside_any_foreign_config(tmp_path, content):
    """A config.json that is not an Engram part's, whatever it holds: save_engram writes the part into
    engram/ beside it (the checkpoint writer would refuse to overwrite it) and leaves it as it was."""
    (tmp_path / "config.json").write_text(content)
    part = save_engram(_trained(), tmp_path)
    assert part == tmp_path / "engram" and (part / "config.json").is_file()
    assert (tmp_path / "config.json").read_text() == content


# ------------------------------------------------------------------- the part's dtype (issue 26 item 13)
def test_float64_model_loads_its_part_in_float64(tmp_path):
    """A float64 model's part loads in float64 (it loaded as float32: logits ~5e-8 off); `dtype=` picks
    another one."""
    model = add_engram(
        S.llama().double(), S.engram_config((0, 2)), compression=S.compression(), dtype=torch.float64
    )
    with torch.no_grad():
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.3)
            m.table.weight.normal_(std=1.0)
    x = S.batch(2, 9)
    ref = model(x).logits
    save_engram(model, tmp_path / "e")
    fresh = load_engram(S.llama().double(), tmp_path / "e")
    for m in fresh.engram.layers.values():
        assert {t.dtype for t in m.state_dict().values()} == {torch.float64}
    torch.testing.assert_close(fresh(x).logits, ref, rtol=0, atol=1e-12)
    as32 = load_engram(S.llama().double(), tmp_path / "e", dtype=torch.float32)
    assert as32.engram.module(0).wkv.weight.dtype == torch.float32
    with pytest.raises(TypeError, match=r"dtype=torch.int64: give torch.float32"):
        load_engram(S.llama().double(), tmp_path / "e", dtype=torch.int64)
    # add_engram on a float64 model makes float64 modules too, so the round trip is exact by default
    assert (
        add_engram(S.llama().double(), S.engram_config(), compression=S.compression())
        .engram.module(1)
        .wkv.weight.dtype
        == torch.float64
    )


# ------------------------------------------------------- the folder's own tokenizer (issue 26 item 17)
def _same_size_other_tokenizer():
    """S.tokenizer() with two ids swapped: another tokenizer of the same size (another fingerprint)."""
    from tokenizers import Tokenizer

    d = json.loads(S.tokenizer().to_str())
    vocab = d["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    other = Tokenizer.from_str(json.dumps(d))
    assert other.get_vocab_size() == S.tokenizer().get_vocab_size()
    return other


@pytest.fixture
def hf_folder(tmp_path):
    model = _trained()
    d = tmp_path / "hf"
    model.save_pretrained(d)
    save_engram(model, d)
    return d


def test_load_checks_the_folders_own_tokenizer(hf_folder):
    import warnings

    from engram.hf.io import TokenizerNotCheckedWarning

    _same_size_other_tokenizer().save(str(hf_folder / "tokenizer.json"))
    fresh = S.llama()
    with pytest.raises(
        ValueError, match=r"compression.safetensors does not fit the tokenizer .*tokenizer.json"
    ):
        load_engram(fresh, hf_folder)  # no tokenizer given: the folder's is the model's
    assert not hasattr(fresh, "engram")
    S.tokenizer().save(str(hf_folder / "tokenizer.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked: nothing to warn of
        load_engram(S.llama(), hf_folder)
    (hf_folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer.json tokenizers can read"):
        load_engram(S.llama(), hf_folder)
    (hf_folder / "tokenizer.json").unlink()
    with pytest.warns(TokenizerNotCheckedWarning, match=r"not checked against a tokenizer.*tokenizer=\.\.\."):
        load_engram(S.llama(), hf_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_engram(S.llama(), hf_folder, tokenizer=S.tokenizer())  # a given tokenizer is checked


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_load_refuses_a_tokenizer_json_that_is_not_a_file(hf_folder, mkfifo, kind):
    path = hf_folder / "tokenizer.json"
    if kind == "fifo":
        mkfifo(path)
    else:
        path.mkdir()
    fresh = S.llama()
    what = "a named pipe" if kind == "fifo" else "a folder"
    with pytest.raises(ValueError, match=rf"tokenizer.json is {what}.*, not a tokenizer.json"):
        load_engram(fresh, hf_folder)
    assert not hasattr(fresh, "engram")


def test_load_refuses_part_files_that_are_not_what_they_should_be(hf_folder, mkfifo, tmp_path):
    import shutil

    comp = hf_folder / "engram" / "compression.safetensors"
    comp.unlink()
    mkfifo(comp)  # was reported "missing"
    with pytest.raises(ValueError, match=r"'compression.safetensors': a named pipe .*save the part again"):
        load_engram(S.llama(), hf_folder)
    comp.unlink()
    with pytest.raises(FileNotFoundError, match=r"'compression.safetensors', which does not exist"):
        load_engram(S.llama(), hf_folder)
    shutil.rmtree(hf_folder / "engram")
    (hf_folder / "engram").write_text("not a folder")  # was reported "missing"
    with pytest.raises(ValueError, match=r"engram is a file, not the folder of an Engram part"):
        load_engram(S.llama(), hf_folder)


def test_a_config_json_that_is_a_fifo_does_not_hang(tmp_path, mkfifo):
    """An HF folder whose config.json is a FIFO: the part is found in engram/ without reading it."""
    save_engram(_trained(), tmp_path / "engram")
    mkfifo(tmp_path / "config.json")
    assert hasattr(load_engram(S.llama(), tmp_path), "engram")


def test_load_refuses_a_part_for_a_larger_vocabulary(tmp_path):
    save_engram(_trained(), tmp_path / "e")
    small = S.llama()
    small.resize_token_embeddings(S.vocab() - 10)
    with pytest.raises(
        ValueError, match=rf"vocabulary of {S.vocab()}, but LlamaForCausalLM has {S.vocab() - 10}"
    ):
        load_engram(small, tmp_path / "e")
    assert not hasattr(small, "engram")


def test_nothing_is_read_through_a_link_out_of_the_folder(hf_folder, tmp_path):
    """A symlinked table file was refused ("a checkpoint reads only files inside its folder"), but a
    symlinked engram/ folder and tokenizer.json pointing outside were read: one rule for every file a
    folder reader opens. A link that stays inside the folder is followed."""
    import shutil

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    S.tokenizer().save(str(outside / "tokenizer.json"))
    (hf_folder / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    fresh = S.llama()
    refusal = r"a symlink to .*elsewhere.*, outside the checkpoint folder .*a checkpoint reads only files inside its folder"
    with pytest.raises(ValueError, match=rf"'tokenizer.json', {refusal}"):
        load_engram(fresh, hf_folder)
    assert not hasattr(fresh, "engram")
    (hf_folder / "tokenizer.json").unlink()
    S.tokenizer().save(str(hf_folder / "tok-real.json"))
    (hf_folder / "tokenizer.json").symlink_to("tok-real.json")  # inside: read
    assert hasattr(load_engram(S.llama(), hf_folder), "engram")
    shutil.move(hf_folder / "engram", outside / "engram")
    (hf_folder / "engram").symlink_to(outside / "engram")
    with pytest.raises(ValueError, match=rf"holds its Engram part 'engram', {refusal}"):
        load_engram(fresh, hf_folder)
    assert not hasattr(fresh, "engram")
    (hf_folder / "engram").unlink()
    shutil.move(outside / "engram", hf_folder / "engram-real")
    (hf_folder / "engram").symlink_to("engram-real")  # inside: read
    assert hasattr(load_engram(S.llama(), hf_folder), "engram")
    shutil.move(hf_folder / "config.json", outside / "config.json")
    (hf_folder / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(ValueError, match=rf"'config.json', {refusal}"):
        load_engram(fresh, hf_folder)


# ------------------------------------------------------------ the part proves its bytes (issue 37 item 2)
def _flip(path, tensor: str, at: int = 0, bit: int = 0x20) -> tuple[float, float]:
    """Flip one bit of byte `at` of `tensor` in safetensors file `path`; (value before, value after) of
    the element holding it."""
    from engram.checkpoint.files import open_tensors, read_header

    n, header = read_header(path)
    t = open_tensors(path).tensor(tensor)
    k = at // t.element_size()
    before = float(t.reshape(-1)[k].float())
    offset = 8 + n + header[tensor]["data_offsets"][0] + at
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))
    return before, float(open_tensors(path).tensor(tensor).reshape(-1)[k].float())


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("tensor", ["layers.0.engram.embed.weight", "layers.2.engram.wkv.weight"])
def test_a_flipped_byte_is_refused_by_its_crc32(tmp_path, fp8, tensor):
    """A flipped byte turned a table value into 413.9 or a wkv weight into 22925.3, and load_engram took
    both (only NaN was refused): every tensor's CRC32, recorded under a seal at save, is checked at load,
    naming the file and the tensor; nothing is attached."""
    from engram.checkpoint.v41.format import CRC32_KEY, SEAL_KEY

    part = (export_fp8 if fp8 else save_engram)(_trained(), tmp_path / "p")
    shard = part / "model-00001-of-00001.safetensors"
    from engram.checkpoint.files import open_tensors

    meta = open_tensors(shard).metadata
    assert CRC32_KEY in meta and SEAL_KEY in meta
    before, after = _flip(
        shard, tensor, at=3 if "wkv" in tensor else 0, bit=0x40 if "wkv" in tensor else 0x08
    )
    assert before != after and after == after  # another value, not NaN: the NaN scan lets it pass
    fresh = S.llama()
    with pytest.raises(ValueError, match=rf"{shard}: tensor '{tensor}': its bytes do not match the CRC32 its file "
                       r"recorded when it was written \(now [0-9a-f]{8}, recorded [0-9a-f]{8}\).*re-copy it, or save the part again"):  # fmt: skip
        load_engram(fresh, tmp_path / "p", mmap=fp8)
    assert not hasattr(fresh, "engram")


def test_an_edited_header_is_refused_by_its_seal(tmp_path):
    """The CRC32s and fingerprints sit in the file's metadata under a seal: one edited (here a CRC32
    made to match a damaged table) is refused."""
    import json as _json

    from engram.checkpoint.files import open_tensors, read_header
    from engram.checkpoint.v41.format import CRC32_KEY
    from engram.storage.integrity import tensor_crc32

    part = save_engram(_trained(), tmp_path / "p")
    shard = part / "model-00001-of-00001.safetensors"
    _flip(shard, "layers.0.engram.embed.weight")
    n, header = read_header(shard)
    crcs = _json.loads(header["__metadata__"][CRC32_KEY])
    crcs["layers.0.engram.embed.weight"] = (
        f"{tensor_crc32(open_tensors(shard).tensor('layers.0.engram.embed.weight')):08x}"
    )
    header["__metadata__"][CRC32_KEY] = _json.dumps(crcs, separators=(",", ":"))
    raw = _json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    data = bytearray(shard.read_bytes())
    data[8 : 8 + n] = raw + b" " * (n - len(raw))
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"its metadata does not match its seal \(engram_seal\).*re-copy it"):
        load_engram(S.llama(), tmp_path / "p")


def test_tables_over_the_scan_limit_are_checked_with_verify(tmp_path, monkeypatch):
    """A table larger than the scan limit is not read at start-up (a note says so); verify=True checks
    it, through the file's mapping a block at a time (a table larger than memory too)."""
    from engram.storage import integrity

    part = export_fp8(_trained(), tmp_path / "p")
    _flip(part / "model-00001-of-00001.safetensors", "layers.0.engram.embed.weight", at=100, bit=0x01)
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 1024)
    with pytest.warns(
        integrity.UnscannedTableWarning, match=r"not scanned for NaN / Inf nor checked against its CRC32s"
    ):
        load_engram(S.llama(), tmp_path / "p")  # not checked: loads
    with pytest.raises(ValueError, match=r"'layers.0.engram.embed.weight': its bytes do not match the CRC32"):
        load_engram(S.llama(), tmp_path / "p", verify=True)


def test_a_part_saved_before_crc32s_loads_with_a_note(tmp_path):
    """A part of ours that records no CRC32s (saved before they were added): loaded, its bytes unchecked,
    and a note says so and how to add them."""
    from engram.checkpoint.files import load_tensors, open_tensors, save_tensors
    from engram.checkpoint.v41.format import BASE_MODEL_KEY, CRC32_KEY, SEAL_KEY
    from engram.storage.integrity import UnscannedTableWarning

    part = save_engram(_trained(), tmp_path / "p")
    shard = part / "model-00001-of-00001.safetensors"
    # as written before seals: no CRC32s, no seal, nor the base model record that came with them
    drop = (CRC32_KEY, SEAL_KEY, BASE_MODEL_KEY, "format")
    meta = {k: v for k, v in open_tensors(shard).metadata.items() if k not in drop}
    tensors = {k: v.clone() for k, v in load_tensors(shard).items()}
    save_tensors(shard, tensors, meta)
    with pytest.warns(
        UnscannedTableWarning,
        match=r"records no CRC32s \(saved before parts carried them\).*save the part again",
    ):
        assert hasattr(load_engram(S.llama(), tmp_path / "p"), "engram")
