"""engram.checkpoint.tokenizer_fit: which compression map a checkpoint's config.json is checked
against (an engram.hf part's own map, the identity for raw-id variants, else DeepSeek-V4's), the check
`engram run-layer` and `engram convert` share. The DeepSeek-V4 case is tests/test_run_layer.py's."""

from __future__ import annotations

import pytest

from engram.checkpoint.tokenizer_fit import check_tokenizer_fit
from engram.config import EngramConfig


def test_an_hf_part_is_checked_against_its_own_map(tmp_path):
    """An engram.hf part hashes another tokenizer's ids: its compression.safetensors decides, so
    `engram convert` keeps converting it (DeepSeek-V4's map would refuse every such part)."""
    S = pytest.importorskip("hf_setup")
    from engram.checkpoint.convert import convert_table
    from engram.checkpoint.v41 import read_checkpoint_config
    from engram.hf import add_engram, save_engram

    model = add_engram(S.llama(), S.engram_config((1,)), compression=S.compression())
    save_engram(model, tmp_path / "part")
    config = read_checkpoint_config(tmp_path / "part")
    assert check_tokenizer_fit(tmp_path / "part", config).fingerprint == S.compression().fingerprint
    convert_table(tmp_path / "part", tmp_path / "fp8", to="fp8")
    edited = config.replace(compressed_vocab_size=config.compressed_vocab_size - 1)
    with pytest.raises(
        ValueError,
        match=rf"{tmp_path / 'part' / 'config.json'} does not fit the checkpoint's compression.safetensors: "
        rf"the compression map has {config.compressed_vocab_size} compressed ids",
    ):
        check_tokenizer_fit(tmp_path / "part", edited)


def test_raw_id_variants_fit_the_identity(tmp_path):
    qwen = EngramConfig.preset("qwen4-exp-tiny")
    assert check_tokenizer_fit(tmp_path, qwen).size == qwen.vocab_size  # no DeepSeek-V4 map built
