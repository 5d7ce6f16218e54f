"""Phi-3: the Llama layout with q/k/v in one checkpoint tensor (``qkv_proj``) and gate/up in
another (``gate_up_proj``), partial rotary, and a sliding window over every layer when the
config sets one.

The fused tensors load as they are: rung's Llama layout already runs q/k/v and gate/up as
one matmul each, under the same names, so nothing is split at load (and HF's gate/up order,
gate first, is rung's).
"""

from __future__ import annotations

from rung.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf_permuted_qk = False
    # llama.cpp keeps both fused tensors; its "ffn_up" is Phi-3's whole gate_up
    gguf_layer_tensors = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    @staticmethod
    def sliding_window(cfg: dict) -> int | None:
        # NOTE: HF Phi-3 passes config.sliding_window to every layer's attention
        return cfg.get("sliding_window") or None
