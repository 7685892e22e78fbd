"""One vLLM run of the plugin's tests, in a process of its own: `python tests/vllm_job.py job.json`.

job.json: {"folder", "llm": LLM kwargs, "requests": [{"prompt": [ids], "max_tokens", "arrive": step,
"seed": int or null, "temperature": float, "ignore_eos": bool (default true)}], "runs": 1 or more, "out": path}. Requests whose
"arrive" is 0 are submitted together; the others are added to the running engine after that many
engine steps (staggered arrivals); a request refused at input processing gets tokens None and its
error in "refused". Writes {"runs": [{"tokens": [[...] per request], "cached": [...], "refused": [...]}],
"metrics": {...}, "engram": engram_stats of the first worker (all of them under "ranks"), "startup_s",
"generate_s"}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_once(llm, requests):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    order = sorted(range(len(requests)), key=lambda i: requests[i].get("arrive", 0))
    done: dict[int, object] = {}
    refused: dict[int, str] = {}
    steps, k = 0, 0
    tag = f"{time.monotonic_ns()}"
    while len(done) + len(refused) < len(requests):
        while k < len(order) and requests[order[k]].get("arrive", 0) <= steps:
            i = order[k]
            r = requests[i]
            params = SamplingParams(
                temperature=float(r.get("temperature", 0.0)),
                max_tokens=int(r["max_tokens"]),
                ignore_eos=bool(r.get("ignore_eos", True)),
                detokenize=False,
                seed=r.get("seed"),
            )
            try:
                engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=r["prompt"]), params)
            except Exception as e:  # refused at input processing: that request alone
                refused[i] = f"{type(e).__name__}: {e}"
            k += 1
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.rsplit("-", 1)[1])] = out
        steps += 1
        if steps > 100_000:
            raise RuntimeError("the engine did not finish")
    outs = [done.get(i) for i in range(len(requests))]
    return {
        "tokens": [None if o is None else list(o.outputs[0].token_ids) for o in outs],
        "cached": [None if o is None else int(o.num_cached_tokens or 0) for o in outs],
        "refused": [refused.get(i) for i in range(len(requests))],
        "steps": steps,
    }


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    from vllm import LLM

    t0 = time.perf_counter()
    try:
        llm = LLM(model=job["folder"], **job["llm"])
    except Exception as e:  # a refusal: how long it took (vLLM's import excluded), then the error
        print(f"vllm_job: LLM() refused after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        raise SystemExit(f"{type(e).__name__}: {e}") from None
    startup = time.perf_counter() - t0
    t1 = time.perf_counter()
    runs = [run_once(llm, job["requests"]) for _ in range(int(job.get("runs", 1)))]
    gen = time.perf_counter() - t1
    metrics = {}
    try:
        for m in llm.get_metrics():
            names = ("preempt", "prefix_cache", "generation_tokens", "prompt_tokens", "spec_decode")
            if any(s in m.name for s in names):
                metrics[m.name] = getattr(m, "value", None)
    except Exception as e:  # metrics off (disable_log_stats): not needed by every job
        metrics["error"] = str(e)
    stats = None
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":
        from engram.vllm import engram_stats

        try:
            ranks = llm.apply_model(engram_stats)  # one per worker (TP rank)
            stats = dict(ranks[0], ranks=ranks)
        except TypeError as e:  # served without Engram
            stats = {"error": str(e)}
    out = {"runs": runs, "metrics": metrics, "engram": stats, "startup_s": startup, "generate_s": gen}
    with open(job["out"], "w") as f:
        json.dump(out, f)
    del llm


if __name__ == "__main__":
    main(sys.argv[1])
