"""Qwen2 / Qwen2.5: the Llama layout with biases on q/k/v (none on o_proj)."""

from __future__ import annotations

from rung.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    gguf_permuted_qk = False

    def check_config(self, cfg: dict) -> None:
        # NOTE: HF Qwen2 slides its layers from max_window_layers on only when asked to;
        # every released Qwen2 / Qwen2.5 checkpoint leaves it off.
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True (Qwen2's per-layer sliding window) is "
                             "unsupported; rung runs Qwen2 with full attention in every layer")
