"""Tests for the `engram` command line (engram.cli): layout, compress, hash, collisions.

Every command is run in-process through `engram.cli.main(argv)` and its output is checked for
content (numbers from SPEC §3 and the golden vectors, or recomputed by `tests/reference.py`), not
only for exit codes. Commands that build the DeepSeek-V4 compression map cost about a second each,
so their outputs are produced once per module where several tests read them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reference as ref
from engram import EngramConfig, TokenizerCompression
from engram.checkpoint.hf_config import to_hf_dict
from engram.cli import main

GOLDEN_TEXT = "Only Alexander the Great could tame the horse Bucephalus."
V41_LAYER1_ROWS = 384_006_168
V41_LAYER14_ROWS = 384_016_682
V41_TOTAL_ROWS = 768_022_850

ENGLISH = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil
and a small brass key. For thirty years he had lit the lamp, trimmed the wick, and polished the
great lens until it shone like a second moon above the harbour. Ships from distant ports knew
the rhythm of its beam: two long flashes, a pause, and one short flash, repeated until dawn.

In the village below, the fishermen mended their nets on the stone quay while their children
chased gulls along the water's edge. The baker opened his shop before sunrise, and the smell of
warm bread drifted up the narrow streets toward the church on the hill. On market days the square
filled with carts of apples, onions, cheese and wool, and traders argued cheerfully about prices
that had not changed in a generation.

When the winter storms arrived, the sea rose against the cliffs and the wind tore slates from the
roofs. The keeper wrote in his log by candlelight: the barometer falling, the swell from the north
west, a schooner sighted at four o'clock running for shelter. He never missed an entry. Years later,
historians would read those pages and marvel at how carefully he had recorded the weather, the
ships, the births and deaths in the village, and the slow change of the coastline itself.

Science, too, advanced in small and patient steps. A chemist measured the boiling point of water
at different altitudes; an astronomer counted sunspots for eleven years and noticed a cycle; a
botanist pressed thousands of leaves between the pages of heavy books. None of them knew which of
their observations would matter. They simply wrote down what they saw, checked it twice, and
trusted that someone, someday, would find a pattern in the numbers.

The same is true of language. Every sentence we speak repeats fragments of sentences we have heard
before: the same pairs of words, the same short phrases, the same idioms and names. A model that
remembers these fragments cheaply can spend its deeper layers on reasoning instead of recall.
"""


# ---------------------------------------------------------------------------- helpers
def run_cli(*argv: str) -> tuple[int, str, str]:
    """Run `engram argv...` in-process: (exit code, stdout, stderr).

    A SystemExit is turned into the exit status the interpreter would give (a string code is
    printed to stderr and gives 1), so argparse errors and `raise SystemExit("error: ...")` are
    seen as a shell would see them.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
    return code, out.getvalue(), err.getvalue()


def run_json(*argv: str) -> dict:
    code, out, err = run_cli(*argv, "--json")
    assert code == 0, err
    return json.loads(out)


def ints_in(line: str) -> list[int]:
    """Every integer in a line of human output, thousands separators removed."""
    return [int(s.replace(",", "")) for s in re.findall(r"\d[\d,]*", line)]


def reference_layout(config: EngramConfig) -> dict[int, dict]:
    """Primes, offsets, row counts and multipliers of every layer, from tests/reference.py."""
    primes = ref.primes(config.layer_ids, config.engram_vocab_size, config.n_heads)
    out = {}
    for lid in config.layer_ids:
        flat = [p for order in primes[lid] for p in order]
        out[lid] = {
            "primes": primes[lid],
            "offsets": [sum(flat[:i]) for i in range(len(flat))],
            "num_embeddings": sum(flat),
            "multipliers": ref.multipliers(
                lid, config.max_ngram_size, config.compressed_vocab_size, config.seed
            ),
        }
    return out


@pytest.fixture
def cached_map(monkeypatch, ds_compression):
    """Serve the DeepSeek-V4 map from the session fixture instead of rebuilding it (~1 s a command).

    For tests about something other than building the map; the golden `hash`, `compress` and
    `collisions` tests run without it, through the real path.
    """
    monkeypatch.setattr(TokenizerCompression, "from_tokenizer", classmethod(lambda cls, tok: ds_compression))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "english.txt"
    path.write_text(ENGLISH, encoding="utf-8")
    assert 2_000 < len(ENGLISH) < 10_000
    return path


@pytest.fixture(scope="module")
def v41_config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(to_hf_dict(EngramConfig.preset("deepseek-v4.1"))))
    return path


# ---------------------------------------------------------------------------- layout
@pytest.fixture(scope="module")
def v41_layout() -> dict:
    return run_json("layout", "--preset", "deepseek-v4.1")


def test_layout_v41_layers_and_primes(v41_layout):
    d = v41_layout
    assert d["preset"] == "deepseek-v4.1"
    assert d["variant"] == "deepseek-v4.1"
    assert (d["max_ngram_size"], d["n_heads"], d["head_dim"], d["rows_per_token"]) == (4, 8, 256, 24)
    assert d["compressed_vocab_size"] == 99092
    assert d["pad_token_id"] == 2
    assert [layer["layer_id"] for layer in d["layers"]] == [1, 14]
    l1, l14 = d["layers"]
    for layer in (l1, l14):
        assert len(layer["primes"]) == 3
        assert all(len(order) == 8 for order in layer["primes"])
    flat1 = [p for order in l1["primes"] for p in order]
    flat14 = [p for order in l14["primes"] for p in order]
    assert (min(flat1), max(flat1)) == (16_000_057, 16_000_463)
    assert (min(flat14), max(flat14)) == (16_000_477, 16_000_889)
    assert l1["num_embeddings"] == sum(flat1) == V41_LAYER1_ROWS
    assert l14["num_embeddings"] == sum(flat14) == V41_LAYER14_ROWS
    assert len(set(flat1) | set(flat14)) == 48  # one global `seen` set: no prime used twice
    assert flat1 == sorted(flat1) and flat14 == sorted(flat14)
    assert all(ref.is_prime(p) for p in flat1[:3] + flat14[-3:])


def test_layout_v41_sizes(v41_layout):
    d = v41_layout
    assert d["total_rows"] == V41_TOTAL_ROWS
    assert d["total_params"] == V41_TOTAL_ROWS * 256 == 196_613_849_600
    assert [layer["params"] for layer in d["layers"]] == [V41_LAYER1_ROWS * 256, V41_LAYER14_ROWS * 256]
    b = d["bytes"]
    assert b["fp8_ue8m0_row"] == 256 + 8  # 256 fp8 values + one ue8m0 byte per 32 values
    assert b["fp8_ue8m0_total"] == V41_TOTAL_ROWS * 264
    assert b["bf16_total"] == V41_TOTAL_ROWS * 256 * 2
    assert b["fp32_total"] == V41_TOTAL_ROWS * 256 * 4
    assert b["fp8_ue8m0_per_token_per_layer"] == 24 * 264
    assert b["fp8_ue8m0_per_token"] == 2 * 24 * 264


def test_layout_v41_offsets_are_exclusive_prefix_sums(v41_layout):
    for layer in v41_layout["layers"]:
        flat = [p for order in layer["primes"] for p in order]
        expected = [0]
        for p in flat[:-1]:
            expected.append(expected[-1] + p)
        assert layer["offsets"] == expected
        assert layer["offsets"][-1] + flat[-1] == layer["num_embeddings"]


def test_layout_v41_multipliers_match_golden(v41_layout, vectors):
    for layer in v41_layout["layers"]:
        assert layer["multipliers"] == vectors["multipliers"][str(layer["layer_id"])]
        assert all(m % 2 == 1 for m in layer["multipliers"])


@pytest.mark.parametrize("preset", ["deepseek-v4.1", "demo-v1", "tiny"])
def test_layout_json_matches_reference(preset):
    config = EngramConfig.preset(preset)
    d = run_json("layout", "--preset", preset)
    expected = reference_layout(config)
    assert d["preset"] == preset
    assert [layer["layer_id"] for layer in d["layers"]] == list(config.layer_ids)
    for layer in d["layers"]:
        e = expected[layer["layer_id"]]
        assert layer["primes"] == e["primes"]
        assert layer["offsets"] == e["offsets"]
        assert layer["num_embeddings"] == e["num_embeddings"]
        assert layer["multipliers"] == e["multipliers"]
        assert layer["params"] == e["num_embeddings"] * config.head_dim
    total = sum(e["num_embeddings"] for e in expected.values())
    assert d["total_rows"] == total
    assert d["total_params"] == total * config.head_dim


def test_layout_demo_v1_and_tiny_content():
    demo = run_json("layout", "--preset", "demo-v1")
    assert demo["variant"] == "demo-v1"
    assert [layer["layer_id"] for layer in demo["layers"]] == [1, 15]
    assert demo["max_ngram_size"] == 3 and demo["head_dim"] == 64
    for layer in demo["layers"]:
        assert len(layer["primes"]) == 2 and all(len(o) == 8 for o in layer["primes"])
        assert min(min(o) for o in layer["primes"]) > 129280 * 5
    tiny = run_json("layout", "--preset", "tiny")
    assert [layer["layer_id"] for layer in tiny["layers"]] == [1]
    assert tiny["layers"][0]["primes"] == [[4099, 4111, 4127, 4129], [4133, 4139, 4153, 4157]]
    assert tiny["total_rows"] == 33048
    # head_dim 32: one ue8m0 scale per row
    assert tiny["bytes"]["fp8_ue8m0_row"] == 33


def test_layout_human_output():
    code, out, err = run_cli("layout", "--preset", "deepseek-v4.1")
    assert code == 0, err
    assert "196.6B" in out
    assert "384,006,168" in out
    assert "384,016,682" in out
    assert "768,022,850" in out
    assert "16000057" in out and "16000889" in out
    assert "layer 1:" in out and "layer 14:" in out
    for name in ("demo-v1", "tiny"):
        code, out, err = run_cli("layout", "--preset", name)
        assert code == 0, err
        assert name in out
        assert "total:" in out


def test_layout_config_file_matches_preset(v41_config_file, v41_layout):
    d = run_json("layout", "--config", str(v41_config_file))
    assert d["preset"] == "config.json"
    assert {k: v for k, v in d.items() if k != "preset"} == {
        k: v for k, v in v41_layout.items() if k != "preset"
    }


def test_layout_config_file_off_by_one_num_embeddings_is_refused(tmp_path):
    hf = to_hf_dict(EngramConfig.preset("deepseek-v4.1"))
    assert hf["engram_num_embeddings"][-1] == V41_LAYER14_ROWS
    hf["engram_num_embeddings"] = V41_LAYER14_ROWS + 1  # the scalar form, read too
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    code, out, err = run_cli("layout", "--config", str(path), "--json")
    assert code == 2
    assert out == ""
    assert str(V41_LAYER14_ROWS + 1) in err
    assert str(V41_LAYER14_ROWS) in err.replace(str(V41_LAYER14_ROWS + 1), "")


def test_layout_config_file_errors(tmp_path):
    code, _, err = run_cli("layout", "--config", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"vocab_size": 129280}))
    code, _, err = run_cli("layout", "--config", str(bad))
    assert code == 2 and "engram_layer_ids" in err
    code, _, err = run_cli("layout", "--preset", "no-such-preset")
    assert code == 2 and "no-such-preset" in err


# ---------------------------------------------------------------------------- compress
@pytest.fixture(scope="module")
def compress_run(tmp_path_factory) -> tuple[dict, Path]:
    path = tmp_path_factory.mktemp("map") / "deepseek-v4.safetensors"
    d = run_json("compress", "--tokenizer", "deepseek-v4", "--top", "7", "--save", str(path))
    return d, path


def test_compress_json_summary(compress_run):
    d, path = compress_run
    assert d["vocab_size"] == 129280
    assert d["compressed_vocab_size"] == 99092
    assert d["merged_away"] == 129280 - 99092
    assert d["reduction"] == pytest.approx(1 - 99092 / 129280)
    assert re.fullmatch(r"[0-9a-f]{64}", d["fingerprint"])
    assert d["saved"] == str(path)


def test_compress_top_groups_sorted(compress_run):
    d, path = compress_run
    groups = d["top_groups"]
    assert len(groups) == 7
    counts = [g["count"] for g in groups]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > counts[-1] > 1
    lookup = TokenizerCompression.load(path).lookup
    bincount = np.bincount(lookup)
    assert counts == sorted(bincount.tolist(), reverse=True)[:7]
    for g in groups:
        assert bincount[g["compressed_id"]] == g["count"]
        assert g["ids"] == np.flatnonzero(lookup == g["compressed_id"])[:12].tolist()
        assert len(g["members"]) == len(g["ids"])
    # the whitespace group is the largest one: tabs, newlines and runs of spaces all normalise to " "
    assert groups[0]["key"] == " "
    assert {"\n", " ", "\t"} <= set(groups[0]["members"])


def test_compress_save_round_trip(compress_run, vectors):
    d, path = compress_run
    loaded = TokenizerCompression.load(path, tokenizer="deepseek-v4")
    assert loaded.size == 99092
    assert loaded.vocab_size == 129280
    assert loaded.fingerprint == d["fingerprint"]
    lut = loaded.lookup
    assert lut.dtype == np.int64
    assert hashlib.sha256(lut.astype("<i8").tobytes()).hexdigest() == vectors["compression_lookup_sha256"]
    assert int(lut[vectors["pad_id"]]) == vectors["compressed_pad_id"]
    for case in vectors["cases"]:
        assert lut[case["token_ids"]].tolist() == case["compressed_ids"]


def test_compress_human_output():
    code, out, err = run_cli("compress", "--top", "3")
    assert code == 0, err
    assert "129,280 ids -> 99,092 compressed ids" in out
    assert "largest groups (of 3)" in out
    group_lines = [line for line in out.splitlines() if " ids  key " in line]
    assert len(group_lines) == 3


# ---------------------------------------------------------------------------- hash
@pytest.fixture(scope="module")
def hash_text_json() -> dict:
    return run_json("hash", "--preset", "deepseek-v4.1", "--text", GOLDEN_TEXT)


def test_hash_text_matches_golden(hash_text_json, vectors):
    case = vectors["cases"][0]
    assert case["text"] == GOLDEN_TEXT
    d = hash_text_json
    assert d["preset"] == "deepseek-v4.1"
    assert d["token_ids"] == case["token_ids"]
    assert d["compressed_ids"] == case["compressed_ids"]
    assert "".join(d["tokens"]) == GOLDEN_TEXT
    assert set(d["rows"]) == {"1", "14"}
    assert d["rows"]["1"] == case["rows"]["1"]
    assert d["rows"]["14"] == case["rows"]["14"]
    assert d["columns"][:2] == ["2-gram/head0", "2-gram/head1"]
    assert d["columns"][-1] == "4-gram/head7"
    assert len(d["columns"]) == 24


def test_hash_ids_equal_text(hash_text_json, vectors, cached_map):
    case = vectors["cases"][0]
    d = run_json("hash", "--ids", ", ".join(map(str, case["token_ids"])))  # commas accepted too
    assert d["token_ids"] == case["token_ids"]
    assert d["rows"] == hash_text_json["rows"]


def test_hash_human_output(vectors, cached_map):
    case = vectors["cases"][0]
    code, out, err = run_cli("hash", "--text", GOLDEN_TEXT)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("13 tokens, deepseek-v4.1")
    for lid in ("1", "14"):
        start = lines.index(next(line for line in lines if line.startswith(f"layer {lid} ")))
        body = lines[start + 2 : start + 2 + 13]
        assert [int(line.split()[0]) for line in body] == list(range(13))
        for t, line in enumerate(body):
            # head 0 of each order: columns 0, 8 and 16 of the golden rows
            golden = case["rows"][lid][t]
            assert ints_in(line)[-3:] == [golden[0], golden[8], golden[16]]
    assert "'<pad>|Only" not in out  # the gram column shows pads as <pad>, pieces unquoted
    assert "<pad>|<pad>|<pad>|Only" in out
    assert "table of 384,006,168 rows" in out
    assert "table of 384,016,682 rows" in out


def test_hash_human_all_heads(vectors, cached_map):
    case = vectors["cases"][0]
    code, out, err = run_cli("hash", "--ids", " ".join(map(str, case["token_ids"])), "--all-heads")
    assert code == 0, err
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("layer 14 ")))
    body = lines[start + 2 : start + 2 + 13]
    for t, line in enumerate(body):
        assert ints_in(line)[-24:] == case["rows"]["14"][t]


def test_hash_tiny_preset_matches_reference(vectors, cached_map):
    case = vectors["cases"][1]
    config = EngramConfig.preset("tiny")
    d = run_json("hash", "--preset", "tiny", "--ids", " ".join(map(str, case["token_ids"])))
    layout = reference_layout(config)[1]
    expected = ref.hash_sequence(
        case["compressed_ids"], None, vectors["compressed_pad_id"], layout["primes"], layout["multipliers"], 3
    )
    assert d["preset"] == "tiny"
    assert list(d["rows"]) == ["1"]
    assert d["rows"]["1"] == expected
    assert len(d["columns"]) == 8


def test_hash_out_of_range_id_is_refused(cached_map):
    code, out, err = run_cli("hash", "--ids", "22898 129280 16")
    assert code == 2
    assert out == ""
    assert "129280" in err
    assert "position (1,)" in err


def test_hash_empty_ids_says_empty(cached_map):
    code, _, err = run_cli("hash", "--ids", "")
    assert code == 2
    assert "empty" in err


def test_hash_input_errors(tmp_path):
    code, _, err = run_cli("hash")  # --text or --ids is required
    assert code == 2 and "--text" in err
    code, _, err = run_cli("hash", "--text", "a", "--ids", "1")
    assert code == 2 and "not allowed" in err
    # a config.json names no tokenizer: a clear error, before any work
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_hf_dict(EngramConfig.preset("tiny"))))
    code, _, err = run_cli("hash", "--config", str(path), "--ids", "1 2")
    assert code != 0 and "--tokenizer" in err


# ---------------------------------------------------------------------------- collisions
def check_order_reports(d: dict, config: EngramConfig) -> None:
    """Consistency of `collisions --json` against the config and against itself."""
    orders = d["orders"]
    assert [(r["layer_id"], r["order"]) for r in orders] == [
        (lid, n) for lid in config.layer_ids for n in config.orders
    ]
    layout = reference_layout(config)
    for r in orders:
        assert r["positions"] == d["tokens"]
        assert 0 < r["distinct_mixes"] <= r["distinct_ngrams"] <= r["positions"]
        assert r["ngrams_sharing_a_mix"] == r["distinct_ngrams"] - r["distinct_mixes"]
        primes = layout[r["layer_id"]]["primes"][r["order"] - 2]
        assert [h["prime"] for h in r["heads"]] == primes
        for h in r["heads"]:
            assert 0 < h["rows_used"] <= min(r["distinct_mixes"], h["prime"])
            assert 0 <= h["rows_shared"] <= h["rows_used"]
            assert 2 * h["rows_shared"] <= h["mixes_in_shared_rows"] <= r["distinct_mixes"]
            # every mix is in exactly one row: the unshared rows hold one mix each
            assert h["rows_used"] - h["rows_shared"] + h["mixes_in_shared_rows"] == r["distinct_mixes"]
        assert r["pairs_sharing_one_head"] >= sum(h["rows_shared"] for h in r["heads"])
        assert 0 <= r["pairs_sharing_two_heads"] <= r["pairs_sharing_one_head"]
        assert r["crt_ok"] == (r["max_heads_shared"] <= 2)
    # the n-grams of one order are the same in every layer; longer n-grams are at least as distinct
    for lid in config.layer_ids:
        per_layer = [r for r in orders if r["layer_id"] == lid]
        assert [r["distinct_ngrams"] for r in per_layer] == [
            r["distinct_ngrams"] for r in orders if r["layer_id"] == config.layer_ids[0]
        ]
        ngrams = [r["distinct_ngrams"] for r in per_layer]
        assert ngrams == sorted(ngrams)
    assert d["crt_ok"] == all(r["crt_ok"] for r in orders)


@pytest.fixture(scope="module")
def tokenized_text(ds_tokenizer) -> list[int]:
    return ds_tokenizer.encode(ENGLISH, add_special_tokens=False).ids


def test_collisions_v41(text_file, tokenized_text):
    d = run_json("collisions", "--preset", "deepseek-v4.1", "--text-file", str(text_file))
    assert d["source"] == str(text_file)
    assert d["tokens"] == len(tokenized_text)
    assert d["crt_ok"] is True
    check_order_reports(d, EngramConfig.preset("deepseek-v4.1"))
    ids = tokenized_text
    for r in d["orders"]:
        assert r["crt_ok"] is True
        assert r["crt_guaranteed"] is True
        assert r["max_heads_shared"] <= 2
        # distinct compressed n-grams can only be fewer than distinct raw-id n-grams
        n = r["order"]
        padded = [-1] * (n - 1) + ids
        raw = {tuple(padded[t : t + n]) for t in range(len(ids))}
        assert r["distinct_ngrams"] <= len(raw)
    # 2-grams of English prose repeat ("of the", ", and"): fewer distinct than positions
    assert d["orders"][0]["distinct_ngrams"] < d["tokens"]


def test_collisions_tiny_and_max_chars(text_file, ds_tokenizer, cached_map):
    d = run_json("collisions", "--preset", "tiny", "--text-file", str(text_file), "--max-chars", "1500")
    assert d["tokens"] == len(ds_tokenizer.encode(ENGLISH[:1500], add_special_tokens=False).ids)
    check_order_reports(d, EngramConfig.preset("tiny"))
    for r in d["orders"]:
        assert r["crt_guaranteed"] is False  # 4099 * 4111 * 4127 < 2**63
    # a few hundred mixes in ~4100 rows: some rows are shared in some head
    assert sum(r["pairs_sharing_one_head"] for r in d["orders"]) > 0


def test_collisions_two_files_concatenated(text_file, tmp_path, ds_tokenizer, cached_map):
    other = tmp_path / "second.txt"
    other.write_text("Bucephalus was the horse of Alexander.", encoding="utf-8")
    d = run_json("collisions", "--preset", "tiny", "--text-file", str(other), "--text-file", str(text_file))
    assert d["source"] == f"{other}, {text_file}"
    text = other.read_text() + "\n" + ENGLISH
    assert d["tokens"] == len(ds_tokenizer.encode(text, add_special_tokens=False).ids)


def test_collisions_human_output(text_file, cached_map):
    code, out, err = run_cli("collisions", "--text-file", str(text_file))
    assert code == 0, err
    assert "distinct n-grams" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+(1|14)\s+[234]\s", line)]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(lid, n) for lid in (1, 14) for n in (2, 3, 4)]
    assert out.count("ok (guaranteed)") == 6
    assert "VIOLATED" not in out


@pytest.fixture(scope="module")
def small_prime_config_file(tmp_path_factory) -> Path:
    # primes 11..37: any two of a few hundred mixes share 3+ heads somewhere (CRT not guaranteed)
    config = EngramConfig.preset("tiny").replace(engram_vocab_size=(11, 11))
    path = tmp_path_factory.mktemp("cfg") / "small.json"
    path.write_text(json.dumps(to_hf_dict(config)))
    return path


def test_collisions_strict_exits_1_on_violation(text_file, small_prime_config_file, cached_map):
    args = ("collisions", "--config", str(small_prime_config_file), "--tokenizer", "deepseek-v4")
    code, out, err = run_cli(*args, "--text-file", str(text_file), "--strict", "--json")
    assert code == 1, err
    d = json.loads(out)
    assert d["crt_ok"] is False
    assert any(r["max_heads_shared"] >= 3 and r["crt_ok"] is False for r in d["orders"])
    assert all(r["crt_guaranteed"] is False for r in d["orders"])
    assert [h["prime"] for h in d["orders"][0]["heads"]] == [11, 13, 17, 19]
    # without --strict the violation is reported but the exit status is 0
    code, out, err = run_cli(*args, "--text-file", str(text_file))
    assert code == 0, err
    assert "VIOLATED" in out
    assert "not guaranteed" in out


def test_collisions_empty_text_file_is_a_clear_error(tmp_path, cached_map):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    code, out, err = run_cli("collisions", "--preset", "tiny", "--text-file", str(empty))
    assert code != 0
    assert out == ""
    assert "empty.txt" in err
    assert "no tokens" in err


def test_collisions_missing_text_file(tmp_path, cached_map):
    code, _, err = run_cli("collisions", "--preset", "tiny", "--text-file", str(tmp_path / "nope.txt"))
    assert code == 2
    assert "nope.txt" in err


# ---------------------------------------------------------------------------- console script
def test_console_script_help():
    exe = shutil.which("engram")
    cmd = [exe, "--help"] if exe else [sys.executable, "-m", "engram", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    for name in ("layout", "compress", "hash", "collisions"):
        assert name in proc.stdout
    assert proc.stdout.startswith("usage: engram")
