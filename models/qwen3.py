"""Qwen3: the Llama layout with per-head q/k RMSNorm and no q/k/v biases."""

from __future__ import annotations

from rung.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    gguf_permuted_qk = False
