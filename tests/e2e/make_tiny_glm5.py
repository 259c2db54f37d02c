# SPDX-License-Identifier: Apache-2.0
"""Write a tiny DSA model directory: GLM-5 architecture (GlmMoeDsaForCausalLM,
the default) or DeepSeek-V3.2 (DeepseekV32ForCausalLM, ``--arch dsv32``).

config.json + an offline WordLevel tokenizer (spec 8.4). Weights are not
written here: the e2e driver loads vLLM's dummy weights and re-initialises
them with tests/e2e/seeded_init.py (norms 1, matrices seeded N(0, std); both
arms get identical bytes; the dummy weights alone are degenerate, targets
T1); `vllm serve` gets the same through the hisparse_seeded load format
(tests/e2e/seeded_weights). MLA and indexer dims are GLM-5's
(kv_lora_rank 512 + rope 64 = 576, index head dim 128): the FlashMLA sparse
kernels hard-code them.

DeepSeek-V3.2's shapes scaled down the same way (issue 17 item 4): its
attention (q_lora, qk_nope 128, v_head 128, 64 indexer heads), its router
(grouped sigmoid top-k with a score correction), its YaRN RoPE (scaled to
max_position_embeddings), and index_topk 2048 as in its config family.

usage: python3 make_tiny_glm5.py OUTDIR [--arch glm5|dsv32] [--topk N]
           [--heads 64] [--layers 4] [--index-topk-freq 1] [--mtp 0]

``--mtp N`` sets num_nextn_predict_layers: N MTP layers after the target's
(docs/mtp.md 4; the gate's MTP model is ``--layers 3 --mtp 1``, whose
HiSparse layout is flat: 4 pairs, the MTP layer alone in the last).
Adapted from the team's shared device recipe (shared/device/make_tiny_glm5.py).
"""
import argparse, json, os

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--arch", choices=("glm5", "dsv32"), default="glm5")
ap.add_argument("--topk", type=int, default=None,
                help="index_topk (default 256 for glm5, 2048 for dsv32)")
ap.add_argument("--heads", type=int, default=64)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--vocab", type=int, default=8192)
ap.add_argument("--max-pos", type=int, default=16384)
ap.add_argument("--index-topk-freq", type=int, default=1,
                help="IndexShare: >1 makes some layers reuse the previous top-k")
ap.add_argument("--mtp", type=int, default=0,
                help="num_nextn_predict_layers (MTP drafter layers)")
a = ap.parse_args()
if a.topk is None:
    a.topk = 2048 if a.arch == "dsv32" else 256
os.makedirs(a.out, exist_ok=True)

cfg = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "bfloat16",
    "vocab_size": a.vocab,
    "hidden_size": a.hidden,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": a.layers,
    "first_k_dense_replace": 1,
    "num_attention_heads": a.heads,
    "num_key_value_heads": a.heads,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "head_dim": 64,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": a.max_pos,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rope_interleave": True,
    "index_topk": a.topk,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "indexer_rope_interleave": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
    "num_nextn_predict_layers": a.mtp,
}
if a.index_topk_freq > 1:
    cfg["index_topk_freq"] = a.index_topk_freq
if a.arch == "dsv32":
    # deepseek-ai/DeepSeek-V3.2-Exp's config.json, scaled: 61 -> a.layers
    # layers, hidden 7168 -> a.hidden, 128 -> a.heads heads, q_lora 1536 ->
    # 768, 256 -> 16 routed experts in 8 -> 4 groups (4 -> 2 per token's
    # groups, 8 -> 4 experts per token); the MLA and indexer dims it shares
    # with GLM-5 (kv_lora 512, rope 64, index_head_dim 128) are kept.
    for key in ("indexer_rope_interleave", "rope_interleave", "head_dim"):
        cfg.pop(key)
    cfg.update({
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "q_lora_rank": 768,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "index_n_heads": 64,
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": a.max_pos / 4096,
                         "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    })
    cfg.pop("rope_parameters")
json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)

from tokenizers import Tokenizer, models, pre_tokenizers, decoders

vocab = {"<unk>": 0, "<eos>": 1}
for i in range(2, a.vocab):
    vocab[f"w{i}"] = i
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
tok.save(os.path.join(a.out, "tokenizer.json"))
json.dump(
    {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<eos>",
        "bos_token": "<unk>",
        "pad_token": "<eos>",
        "model_max_length": a.max_pos,
    },
    open(os.path.join(a.out, "tokenizer_config.json"), "w"),
)
print("wrote", a.out, json.dumps({k: cfg.get(k) for k in (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "index_topk",
    "index_topk_freq", "n_routed_experts", "num_nextn_predict_layers")}))
