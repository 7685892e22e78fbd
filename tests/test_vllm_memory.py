"""Memory patches served by the vLLM plugin: `vllm_engram`'s `patches` (engram.vllm.options), written
into the tables where they load (engram.vllm.tables.build_tables), and `engram serve --patch`. The
patches here are made directly from chosen rows (the rows a prompt reads, given new random values: a
stand-in for `engram.memory.memorize`, in milliseconds). vLLM's greedy tokens with the patches equal
HF `generate()` with the same patches applied (`apply_patch`), and differ from the unpatched ones;
`memory` and `host` tables (and a float16 server's) hold the patched rows exactly; `mmap` /
`rowfile`, a patch for another model and bad options are refused in one line (one for another
layout, tokenizer or table shape where the options are checked, in the user's process; one for
another model's weights where the tables load: in vLLM, the worker). The end-to-end run needs vLLM (skipped without
it); the rest runs in the main environment too."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import vllm_setup
from engram.addressing.hashing import NgramHasher
from engram.checkpoint.v41 import load_engram_modules
from engram.cli import main
from engram.memory import EngramLayers, MemoryPatch, apply_patch, remove_patch, save_patch
from engram.memory.apply import layer_rows, reader_signature, table_row_format
from engram.memory.patch import LayerRows, rows_as_float, rows_in_format
from engram.model.table import FP8Table, TrainableTable
from engram.systems import TieredTable
from engram.vllm import registry
from engram.vllm.folder import read_part
from engram.vllm.options import ServeOptions, serve_options, serve_plan
from engram.vllm.server import PATCHES_ARG, plan_server
from engram.vllm.tables import build_tables, load_tables

SHAPE = dict(hidden_size=vllm_setup.HIDDEN, num_layers=2, vocab_size=vllm_setup.VOCAB)
N = 16  # tokens generated per request


def write_patch(layers: EngramLayers, prompts: list[list[int]], path, *, seed: int, scale: float = 4.0):
    """A patch of every row `prompts` read, each row's old value plus Gaussian noise of `scale` times the
    table's spread, in the table's row format; saved at `path`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, lid in enumerate(layers.hasher.config.layer_ids):
        hashed = [np.asarray(layers.hasher.hash(np.asarray(p, dtype=np.int64)))[:, i] for p in prompts]
        rows = torch.from_numpy(np.unique(np.concatenate([h.reshape(-1) for h in hashed])))
        table = layers.modules[lid].table
        fmt = table_row_format(table)
        old = layer_rows(table, rows, fmt)
        x = rows_as_float(old.values, old.scales, fmt)
        values, scales = rows_in_format(x + scale * x.std() * torch.randn(x.shape, generator=g), fmt)
        out[lid] = LayerRows(rows, values, scales, old.before)
    m = layers.modules
    patch = MemoryPatch(
        out,
        fmt,
        table.dim,
        {lid: m[lid].table.num_rows for lid in out},
        layers.layout,
        layers.tokenizer,
        {lid: reader_signature(m[lid]) for lid in out},
        name=path.stem,
    )
    save_patch(patch, path)
    return patch


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vllm_setup.VOCAB, n).tolist() for n in (9, 40, 23)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A float folder, two patches (the rows of the first prompt, of the second), HF's greedy tokens
    without and with them, and the patched Engram table HF holds."""
    tmp = tmp_path_factory.mktemp("mem")
    folder = vllm_setup.build_folder(tmp / "model", "llama")
    ref = vllm_setup.reference(folder)
    ps = prompts()
    plain = vllm_setup.greedy(ref, ps, N)
    patches = [
        write_patch(EngramLayers.of(ref), [p], tmp / f"p{i}.safetensors", seed=i)
        for i, p in enumerate(ps[:2])
    ]
    for p in patches:
        apply_patch(ref, p)
    want = vllm_setup.greedy(ref, ps, N)
    table = ref.engram.layers["1"].table.weight.detach().clone()
    for p in reversed(patches):
        remove_patch(ref, p)
    assert want[0] != plain[0] and want[1] != plain[1], "the patches do not change the greedy tokens"
    return folder, [str(tmp / f"p{i}.safetensors") for i in range(2)], ps, plain, want, table


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """An FP8 folder with row files, and a patch of FP8 rows made on its tables in memory (the loader
    engram.hf reads the part with)."""
    tmp = tmp_path_factory.mktemp("mem8")
    folder = vllm_setup.build_folder(tmp / "model", "llama", seed=2, fp8=True, row_files=True)
    part = read_part(folder, **SHAPE)
    _, modules = load_engram_modules(part.part, part.config, mmap=False, dtype=torch.float32)
    layers = EngramLayers(modules, NgramHasher(part.config, part.compression))
    patch = write_patch(layers, prompts(2)[:2], tmp / "fp8.safetensors", seed=7)
    assert patch.row_format == "fp8"
    before = modules[1].table.weight.clone()
    apply_patch(layers, patch)
    assert not torch.equal(modules[1].table.weight, before)
    return folder, str(tmp / "fp8.safetensors"), modules


# ------------------------------------------------------------------------------- the tables at load
def test_memory_tables_hold_what_hf_holds_with_the_same_patches(served):
    folder, paths, *_, table = served
    part = read_part(folder, **SHAPE)
    modules = load_tables(part, serve_options({"patches": paths}), torch.float32)
    got = modules[1].table
    assert isinstance(got, TrainableTable) and torch.equal(got.weight, table)
    unpatched = load_tables(part, ServeOptions(), torch.float32)[1].table.weight
    assert not torch.equal(unpatched, table)


def test_a_float16_server_takes_the_patches_a_float32_model_wrote(served):
    """A float16 server takes the patch a float32 model wrote (its reader and rows compared with a
    tolerance)."""
    folder, paths, *_, table = served
    part = read_part(folder, **SHAPE)
    got = load_tables(part, serve_options({"patches": paths}), torch.float16)[1]
    plain = load_tables(part, ServeOptions(), torch.float16)[1]
    assert torch.equal(got.table.weight, table)
    weights = {k: v for k, v in got.state_dict().items() if not k.startswith("table.")}
    assert weights and all(torch.equal(v, plain.state_dict()[k]) for k, v in weights.items())
    assert got.wkv.weight.dtype == torch.float16


def test_host_and_memory_tables_serve_the_patched_fp8_rows(fp8):
    folder, path, want = fp8
    part = read_part(folder, **SHAPE)
    rows = torch.arange(want[1].table.num_rows)[None, :, None]  # every row, through each table's gather
    h = torch.randn(1, 5, 1, vllm_setup.HIDDEN)
    r = torch.randint(0, want[1].table.num_rows, (1, 5, 4))
    for mode, kind in (("memory", FP8Table), ("host", TieredTable)):
        got = load_tables(part, serve_options({"tables": mode, "patches": [path]}), torch.float32)[1]
        assert isinstance(got.table, kind)
        assert torch.equal(got.table.gather(rows, torch.float32), want[1].table.gather(rows, torch.float32))
        with torch.no_grad():
            assert torch.equal(got(h, r, None), want[1](h, r, None))  # the layer's output


# ------------------------------------------------------------------------------------------ refusals
def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_tables_served_from_their_files_refuse_patches(fp8, monkeypatch):
    folder, path, _ = fp8
    part = read_part(folder, **SHAPE)
    for mode in ("mmap", "rowfile"):
        with pytest.raises(ValueError) as e:
            serve_plan(part, {"tables": mode, "patches": [path]})
        assert f"tables='{mode}' serves each table read-only from its file" in one_line(e)
        assert "serve them with tables 'memory' or 'host'" in str(e.value)
    # where vLLM resolves the architecture: in the user's process, before any worker
    monkeypatch.setattr(registry, "check_vllm_version", lambda version=None: None)
    with pytest.raises(ValueError, match=r"tables='mmap' serves each table read-only"):
        registry.engram_architectures(
            ["LlamaForCausalLM"], model_config(folder, tables="mmap", patches=[path])
        )


def test_a_patch_for_another_model_is_refused_naming_the_file(served, fp8, tmp_path):
    folder, paths, *_ = served
    other = vllm_setup.build_folder(tmp_path / "other", "llama", seed=5)  # same shapes, other weights
    foreign = tmp_path / "foreign.safetensors"
    write_patch(EngramLayers.of(vllm_setup.reference(other)), prompts()[:1], foreign, seed=3)
    part = read_part(folder, **SHAPE)
    with pytest.raises(ValueError) as e:
        build_tables(serve_plan(part, {"patches": [paths[0], str(foreign)]}), torch.float32)
    msg = one_line(e)
    assert f"{foreign} cannot be served with {folder}" in msg and "was made for another model" in msg
    with pytest.raises(ValueError) as e:  # FP8 rows for a float table
        load_tables(part, serve_options({"patches": [fp8[1]]}), torch.float32)
    assert "it holds fp8 rows, the part's tables hold float rows" in one_line(e)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"layout": "0" * 64}, "was made for another Engram layout"),
        ({"tokenizer": "0" * 64}, "was made for another tokenizer"),
        ("rows", "was made for a table of"),
    ],
)
def test_a_patch_for_another_table_is_refused_before_the_tables_load(
    served, tmp_path, monkeypatch, change, says
):
    """Layout, tokenizer and table shape are checked against the part where the options are (the
    user's process, in seconds): no table is read."""
    import dataclasses

    from engram.memory import load_patch

    folder, paths, *_ = served
    patch = load_patch(paths[0])
    if change == "rows":  # a table one row larger: the same ids fit it, the table is another
        change = {"table_rows": {k: v + 1 for k, v in patch.table_rows.items()}}
    foreign = tmp_path / "foreign.safetensors"
    save_patch(dataclasses.replace(patch, **change), foreign)
    part = read_part(folder, **SHAPE)
    monkeypatch.setattr(
        "engram.vllm.tables.load_engram_modules", lambda *a, **k: pytest.fail("the tables were read")
    )
    with pytest.raises(ValueError) as e:
        load_tables(part, serve_options({"patches": [paths[1], str(foreign)]}), torch.float32)
    msg = one_line(e)
    assert f"['patches']: {foreign} cannot be served with {folder}: the patch" in msg and says in msg
    serve_plan(part, {"patches": paths})  # the patches made for it pass


def test_patch_options_are_checked(served, tmp_path, monkeypatch):
    folder = served[0]
    for bad in ("a.safetensors", [1], [""], {"a": 1}):
        with pytest.raises(ValueError) as e:
            serve_options({"patches": bad})
        assert "['patches']=" in one_line(e) and "must be a list of memory patch files" in str(e.value)
    part = read_part(folder, **SHAPE)
    with pytest.raises(ValueError) as e:
        serve_plan(part, {"patches": [str(tmp_path / "nope.safetensors")]})
    assert "nope.safetensors: no such patch file" in one_line(e)
    (tmp_path / "junk.safetensors").write_bytes(b"not a patch")
    with pytest.raises(ValueError, match=r"junk.safetensors: not a readable safetensors file"):
        serve_plan(part, {"patches": [str(tmp_path / "junk.safetensors")]})
    monkeypatch.chdir(tmp_path)
    assert serve_options({"patches": ["x/../p.safetensors"]}).patches == (str(tmp_path / "p.safetensors"),)


def model_config(folder, **options):
    """What the registry reads of vLLM's ModelConfig (a stand-in, as in tests/test_vllm_plugin.py)."""
    from types import SimpleNamespace

    hf = SimpleNamespace(
        hidden_size=SHAPE["hidden_size"], num_hidden_layers=2, vocab_size=SHAPE["vocab_size"]
    )
    hf.vllm_engram = options
    return SimpleNamespace(
        model=str(folder),
        model_impl="auto",
        hf_text_config=hf,
        tokenizer=str(folder),
        enable_prompt_embeds=False,
    )


def test_the_registry_hands_the_workers_absolute_paths(served, monkeypatch, tmp_path):
    """The options a worker reads come from the config the user's process checked: relative patch paths
    are made absolute there (a worker may start in another directory); the user's dict is not changed."""
    import shutil

    folder, paths, *_ = served
    monkeypatch.setattr(registry, "check_vllm_version", lambda version=None: None)
    shutil.copy(paths[0], tmp_path / "mine.safetensors")
    monkeypatch.chdir(tmp_path)
    options = {"patches": ["mine.safetensors"]}
    cfg = model_config(folder, **options)
    assert registry.engram_architectures(["LlamaForCausalLM"], cfg) == ["EngramLlamaForCausalLM"]
    assert cfg.hf_text_config.vllm_engram == {"patches": [str(tmp_path / "mine.safetensors")]}
    assert options == {"patches": ["mine.safetensors"]}
    plan = registry.served_plan(cfg)
    assert plan.options.patches == (str(tmp_path / "mine.safetensors"),) and len(plan.patches) == 1


# ------------------------------------------------------------------------------------- engram serve
def test_engram_serve_passes_the_patches_as_absolute_paths(served, tmp_path, monkeypatch, capsys):
    import shutil

    folder, paths, *_ = served
    shutil.copy(paths[1], tmp_path / "b.safetensors")
    monkeypatch.chdir(tmp_path)
    plan = plan_server(folder, environ={}, available_gib=8.0, patches=[paths[0], "b.safetensors"])
    want = [paths[0], str(tmp_path / "b.safetensors")]
    i = plan.argv.index(PATCHES_ARG)
    assert json.loads(plan.argv[i + 1]) == want
    assert f"memory patches {want}" in "\n".join(plan.notes)
    assert (
        main(
            [
                "serve",
                "--dry-run",
                "--patch",
                paths[0],
                str(folder),
                "--hf-overrides.vllm_engram.tables",
                "memory",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"{PATCHES_ARG} '{json.dumps([paths[0]])}' --hf-overrides.vllm_engram.tables memory" in err
    for argv, says in (
        (["serve", "--patch", "nope.safetensors", str(folder)], "nope.safetensors: no such patch file"),
        (["serve", str(folder), "--patch", paths[0]], "--patch comes after FOLDER"),
        (
            ["serve", "--patch", paths[0], str(folder), "--hf-overrides", '{"vllm_engram": {}}'],
            "--patch with a whole --hf-overrides JSON after FOLDER",
        ),
    ):
        monkeypatch.setattr("engram.cli.serve.vllm_missing", lambda: None)
        assert main(argv) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # (above it, warnings: the test folder has no tokenizer.json)
        assert last.startswith("engram serve: error: ") and says in last and "Traceback" not in err, err


def test_vllm_reads_the_patches_engram_serve_gives_it(served):
    """vLLM's own argument parser turns the dotted argument into the `vllm_engram` options, merged with
    the user's dotted ones."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    folder, paths, *_ = served
    plan = plan_server(
        folder,
        environ={},
        available_gib=8.0,
        patches=paths,
        extra=["--hf-overrides.vllm_engram.tables", "host"],
    )
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(plan.argv[3:])
    assert args.hf_overrides == {"vllm_engram": {"patches": paths, "tables": "host"}}


# ----------------------------------------------------------------------------------------- in vLLM
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_greedy_with_patches_equals_hf_with_them(served, tmp_path):
    """Two patches served (memory tables), one given by a relative path: greedy tokens equal HF's with
    the same patches applied, on prompts whose rows they rewrite (HF's tokens change there) and one whose
    rows they barely touch; the workers got the paths absolute."""
    import shutil

    pytest.importorskip("vllm")
    from test_vllm_serve import serve

    folder, paths, ps, plain, want, _ = served
    shutil.copy(paths[1], tmp_path / "second.safetensors")  # the job runs in tmp_path
    requests = [{"prompt": p, "max_tokens": N, "arrive": i} for i, p in enumerate(ps)]
    opts = {"patches": [paths[0], "second.safetensors"]}
    got = serve(
        tmp_path,
        folder,
        requests,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        hf_overrides={"vllm_engram": opts},
    )
    assert got["runs"][0]["tokens"] == want
    assert want[:2] != plain[:2]
    assert got["engram"]["options"]["patches"] == [paths[0], str(tmp_path / "second.safetensors")]
