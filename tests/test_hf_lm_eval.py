"""engram.hf.harness: Engram models through lm-evaluation-harness, on two local tasks shipped in
tests/data/lm_eval_tasks (multiple choice and log-likelihood over genesis.jsonl; no download).

Every per-sample log-likelihood lm-eval reports is the Engram model's own (summed log-softmax of the
continuation, computed here), not its backbone's; batch sizes 1 and 4 agree; a saved folder evaluates
the same through `--model engram`, lm-eval's own `--model hf` with trust_remote_code, and the command
line `engram-lm-eval` (lm-eval 0.4.13 reads no plugin entry points); plain models are refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import hf_setup as S
from engram.hf import add_engram

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lm_eval.api.registry import Registry  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from engram.hf.harness import MODEL_NAME, TARGET, EngramLM, register  # noqa: E402

TASKS_DIR = Path(__file__).parent / "data" / "lm_eval_tasks"
TASKS = ["engram_genesis_mc", "engram_genesis_ll"]
ATOL = 1e-5  # summed float32 log-probabilities of about -30 to -100, another batch shape
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(autouse=True, scope="module")
def _offline():
    """Nothing here reaches the network: the HF libraries offline, an internet connection refused."""
    connect = socket.socket.connect

    def refuse(sock: socket.socket, address: object) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"tests/test_hf_lm_eval.py: a connection to {address} was attempted")
        connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        yield


def _docs() -> list[dict]:
    lines = (TASKS_DIR / "genesis.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _hf_tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=S.tokenizer(), eos_token="<eos>", pad_token="<eos>"
    )


@torch.no_grad()
def _loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context), split into tokens the way lm-eval does: the whole text encoded,
    the context's length of it the context."""
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tok(context, add_special_tokens=False)["input_ids"])
    logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].float(), dim=-1)  # (T-1, V)
    return logp[torch.arange(n - 1, len(whole) - 1), torch.tensor(whole[n:])].sum().item()


def _expected(model) -> dict[str, list[list[float]]]:
    """Per task, per document: the log-likelihood of each request (each choice; the right answer)."""
    tok, docs = _hf_tokenizer(), _docs()
    return {
        "engram_genesis_mc": [
            [_loglikelihood(model, tok, d["question"], " " + c) for c in d["choices"]] for d in docs
        ],
        "engram_genesis_ll": [
            [_loglikelihood(model, tok, d["question"], " " + d["choices"][d["label"]])] for d in docs
        ],
    }


def _per_sample(samples: dict[str, list[dict]]) -> dict[str, list[list[float]]]:
    return {
        task: [[float(r[0]) for r in s["filtered_resps"]] for s in sorted(rows, key=lambda s: s["doc_id"])]
        for task, rows in samples.items()
    }


def _assert_equal_lls(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for task in want:
        torch.testing.assert_close(torch.tensor(got[task]), torch.tensor(want[task]), rtol=0, atol=ATOL)


def _assert_not_lls(got: dict, other: dict) -> None:
    for task in other:
        gap = (torch.tensor(got[task]) - torch.tensor(other[task])).abs()
        assert gap.min() > 100 * ATOL, f"{task}: a log-likelihood within {gap.min():.3g} of the backbone's"


def _evaluate(model, model_args: str | None = None, batch_size: int | None = None) -> dict:
    """simple_evaluate on the two local tasks (lm-eval's built-in tasks not indexed), per-sample values
    logged; `model` an LM object or a registered name with its `model_args`."""
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        batch_size=batch_size,
        device="cpu",
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def engram_model():
    model = add_engram(S.llama(), S.engram_config((1,)), compression=S.compression())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as if trained: wkv's value half starts at zero, giving the backbone's logits
        for m in model.engram.layers.values():
            m.wkv.weight.normal_(std=0.3, generator=g)
    return model


@pytest.fixture(scope="module")
def expected(engram_model):
    return _expected(engram_model), _expected(S.llama())  # S.llama(): the same seed, the backbone


@pytest.fixture(scope="module")
def in_memory(engram_model):
    """lm-eval's results for the model object, at batch sizes 1 and 4."""
    return {
        b: _evaluate(EngramLM(pretrained=engram_model, tokenizer=_hf_tokenizer(), batch_size=b, device="cpu"))
        for b in (1, 4)
    }


@pytest.fixture(scope="module")
def folder(engram_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("engram-folder")
    engram_model.save_pretrained(d)
    _hf_tokenizer().save_pretrained(d)
    return d


def test_scores_are_the_engram_models_not_the_backbones(in_memory, expected):
    engram, backbone = expected
    for b in (1, 4):
        got = _per_sample(in_memory[b]["samples"])
        _assert_equal_lls(got, engram)
        _assert_not_lls(got, backbone)


def test_batch_sizes_1_and_4_give_equal_scores(in_memory):
    one, four = in_memory[1], in_memory[4]
    _assert_equal_lls(_per_sample(four["samples"]), _per_sample(one["samples"]))
    for task in TASKS:
        for metric in ("acc,none", "acc_norm,none", "perplexity,none"):
            if metric in one["results"][task]:
                assert four["results"][task][metric] == pytest.approx(one["results"][task][metric], rel=1e-5)


def test_a_model_without_engram_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no Engram attached: .*`hf` model"):
        EngramLM(pretrained=S.llama(), tokenizer=_hf_tokenizer(), device="cpu")
    plain = S.save_folder(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"holds a 'llama' model with no Engram .*`--model hf`"):
        EngramLM(pretrained=str(plain), device="cpu")


def test_the_entry_point_names_engram_lm():
    """lm-eval after 0.4.13 registers each `lm_eval.models` entry point as a lazy placeholder and
    loads it when the name is asked for: done here on a registry of our own."""
    eps = [ep for ep in metadata.entry_points(group="lm_eval.models") if ep.name == MODEL_NAME]
    assert eps, "the installed engram-lm has no lm_eval.models entry point: reinstall it (pip install -e .)"
    (ep,) = eps
    assert ep.value == TARGET
    registry = Registry("model")
    registry.register(ep.name, target=ep)
    assert registry.get(MODEL_NAME) is EngramLM


def test_register_puts_engram_beside_the_built_in_models():
    from lm_eval.api.registry import get_model

    register()
    register()  # twice: the name is there already, left alone
    assert get_model(MODEL_NAME) is EngramLM
    assert get_model("hf").__name__ == "HFLM"


@pytest.mark.parametrize(
    "model, model_args",
    [("engram", "pretrained={folder}"), ("hf", "pretrained={folder},trust_remote_code=True")],
    ids=["engram", "hf-trust-remote-code"],
)
def test_a_saved_folder_evaluates_as_the_model(folder, expected, model, model_args):
    """`--model engram`, and lm-eval's own `--model hf` (config.json's auto_map; in this process, where
    engram is imported, transformers takes our registered classes instead of the folder's code)."""
    register()
    got = _per_sample(_evaluate(model, model_args.format(folder=folder), batch_size=4)["samples"])
    _assert_equal_lls(got, expected[0])
    _assert_not_lls(got, expected[1])


@pytest.mark.slow  # a subprocess indexing lm-eval's tasks, ~17 s
def test_engram_lm_eval_command_line(folder, expected, tmp_path):
    """`engram-lm-eval --model engram` (lm-eval 0.4.13's command line, engram registered first) in a
    fresh python, offline, at batch size 4: its --log_samples output holds the Engram model's values."""
    argv = [
        sys.executable,
        "-m",
        "engram.cli.harness",
        "--model",
        "engram",
        "--model_args",
        f"pretrained={folder}",
    ]
    argv += ["--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR), "--device", "cpu"]
    argv += ["--batch_size", "4", "--log_samples", "--output_path", str(tmp_path)]
    run = subprocess.run(argv, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = {}
    for task in TASKS:
        (path,) = tmp_path.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    got = _per_sample(samples)
    _assert_equal_lls(got, expected[0])
    _assert_not_lls(got, expected[1])


def test_importing_engram_hf_does_not_import_lm_eval():
    code = "import sys, engram, engram.hf; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
