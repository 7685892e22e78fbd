import collections, json, os, random, sys, tempfile, time
import torch
sys.path.insert(0, os.path.dirname(__file__))
from build_model import build

N = int(os.environ.get("N", "40"))

def hf_greedy(hf, p, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(p):].tolist()

if __name__ == "__main__":
    folder = tempfile.mkdtemp(prefix="engram_llama_")
    log = os.environ["ENGRAM_PROTO_LOG"]
    open(log, "w").close()
    hf = build(folder)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(80)]  # > 2 blocks of 32, for prefix caching
    batch1 = [shared + [rng.randrange(3, 1000) for _ in range(L)] for L in (7, 20, 33, 45)]
    batch2 = [shared + [rng.randrange(3, 1000) for _ in range(L)] for L in (5, 12)]
    t = time.time()
    ref1 = [hf_greedy(hf, p, N) for p in batch1]
    ref2 = [hf_greedy(hf, p, N) for p in batch2]
    # the same model without Engram: to show Engram changes the tokens (so equality is meaningful)
    att = hf.engram
    from engram.hf import remove_engram
    remove_engram(hf)
    plain = [hf_greedy(hf, p, N) for p in batch1]
    print("HF_S", round(time.time() - t, 1), "engram_changes_tokens", plain != ref1, flush=True)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.time()
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              enforce_eager=os.environ.get("EAGER","1")=="1", block_size=32, seed=0, max_num_seqs=4,
              max_num_batched_tokens=int(os.environ.get("MNBT", "48")),
              enable_prefix_caching=True,
              num_gpu_blocks_override=int(os.environ.get("BLOCKS", "12")))
    print("STARTUP_S", round(time.time() - t0, 1), flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, detokenize=False)
    o1 = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch1], sp)
    o2 = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch2], sp)
    got1 = [list(o.outputs[0].token_ids) for o in o1]
    got2 = [list(o.outputs[0].token_ids) for o in o2]
    print("cached tokens batch2:", [o.num_cached_tokens for o in o2])
    for r, g in zip(ref1 + ref2, got1 + got2):
        if r != g:
            print("MISMATCH\n HF  ", r, "\n VLLM", g)
    print("EQUAL", got1 == ref1 and got2 == ref2)
    kinds = collections.Counter()
    from_slots = 0; resumed = 0
    for line in open(log):
        d = json.loads(line); kinds[d["kind"]] += 1
        if d["kind"] == "step":
            from_slots += d["from_slots"]
            resumed += sum(1 for s, L in d["chunk_starts"] if s > 0)
    print("LOG", dict(kinds), "lookback_ids_read_from_slots", from_slots, "chunks_starting_past_0", resumed)
