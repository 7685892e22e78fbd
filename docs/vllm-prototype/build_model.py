"""Build a tiny random Llama + Engram (V4.1 variant, hc=1), save it for vLLM, return HF model."""
import json, os, torch
from transformers import LlamaConfig, LlamaForCausalLM
from engram.config import EngramConfig
from engram.addressing.compression import TokenizerCompression
from engram.hf import add_engram

VOCAB = 1000

def engram_config():
    return EngramConfig(name="vllm-proto", layer_ids=(1,), max_ngram_size=3, n_heads=2,
                        engram_vocab_size=(257, 263), vocab_size=VOCAB, compressed_vocab_size=VOCAB,
                        pad_token_id=0, tokenizer=None, head_dim=32, hidden_size=256, hc_mult=1)

def build(folder, seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    ec = engram_config()
    add_engram(hf, ec, compression=TokenizerCompression.identity(VOCAB), zero_init=False)
    with torch.no_grad():  # make Engram's effect large enough to flip greedy tokens
        for m in hf.engram.modules():
            if hasattr(m, "wkv"):
                m.wkv.weight.mul_(20.0)
    hf.config.architectures = ["EngramLlamaForCausalLM"]
    hf.config.engram = ec.to_dict()
    hf.save_pretrained(folder)
    # save_pretrained writes the class name into "architectures": point it at the plugin's class
    path = os.path.join(folder, "config.json")
    d = json.load(open(path)); d["architectures"] = ["EngramLlamaForCausalLM"]
    json.dump(d, open(path, "w"), indent=2)
    return hf

if __name__ == "__main__":
    import sys, safetensors.torch as st
    hf = build(sys.argv[1])
    keys = list(st.load_file(os.path.join(sys.argv[1], "model.safetensors")).keys())
    print([k for k in keys if "engram" in k])
    print(json.load(open(os.path.join(sys.argv[1], "config.json"))).get("engram") is not None)
    print({k: tuple(v.shape) for k, v in hf.engram.state_dict().items()})
