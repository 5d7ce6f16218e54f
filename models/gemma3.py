"""Gemma 3 text decoder (HF ``gemma3_text`` / ``Gemma3ForCausalLM``; GGUF ``gemma3``):
sliding-window and full-attention layers (5 : 1 by default) with one rope base per layer
kind, q/k RMSNorm, Gemma's ``(1 + w)`` norms before and after attention and MLP, embeddings
scaled by sqrt(hidden), final logit soft-capping where the config sets it.

Sliding and full layers hold their KV in separate cache groups (their specs differ in the
window), so a sliding group frees the blocks that fall out of the window. Config facts
follow HF transformers' ``Gemma3TextConfig``; the GGUF mapping follows llama.cpp's converter.
"""

from __future__ import annotations

import torch
from torch import nn

from rung.kernels.attention import Attention
from rung.models.gemma4_rope import FULL, SLIDING
from rung.models.layers import (
    STACKED_PARAMS,
    GatedMLP,
    MergedLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    ScaledSoftcappedLM,
    rope_inv_freq,
)
from rung.models.weights import WeightStream, check_all_loaded, load_named_weights

# HF Gemma3TextConfig defaults for the fields config.json may omit.
_DEFAULTS: dict = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
    "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
_SLIDING_PATTERN = 6          # HF default: every 6th layer is full, the others slide
_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
NORM_OFFSET = 1.0             # Gemma scales by 1 + w


def text_config(cfg: dict) -> dict:
    """``cfg`` with HF's defaults filled in, ``layer_types`` spelled out and
    ``rope_parameters`` nested by layer kind (HF v4 configs give ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` for the full layers instead)."""
    out = {**_DEFAULTS, **cfg, "model_type": "gemma3_text"}
    num_layers = out["num_hidden_layers"]
    pattern = int(cfg.get("sliding_window_pattern") or _SLIDING_PATTERN)
    types = list(cfg.get("layer_types") or [
        SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)])
    if len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types={types} must list {num_layers} entries of "
                         f"{SLIDING!r} / {FULL!r}")
    out["layer_types"] = types
    params = cfg.get("rope_parameters") or {}
    if not {SLIDING, FULL} <= set(params):
        full = {"rope_type": "default",
                "rope_theta": cfg.get("rope_theta") or _THETA[FULL], **(cfg.get("rope_scaling")
                                                                        or {})}
        sliding = {"rope_type": "default",
                   "rope_theta": cfg.get("rope_local_base_freq") or _THETA[SLIDING]}
        params = {SLIDING: sliding, FULL: full}
    out["rope_parameters"] = params
    return out


def check_supported(cfg: dict) -> None:
    if cfg["use_bidirectional_attention"]:
        raise ValueError("use_bidirectional_attention=True (EmbeddingGemma) is unsupported; "
                         "rung runs Gemma 3 as a causal decoder")


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: dict, layer_type: str, layer_name: str) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(cfg["attention_bias"])
        self.qkv_proj = MergedLinear(hidden, [q_size, kv_size, kv_size], bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, NORM_OFFSET, cast_before_scale=False)
        self.k_norm = RMSNorm(self.head_dim, eps, NORM_OFFSET, cast_before_scale=False)
        self.attn = Attention(layer_name, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
                              sliding_window=cfg["sliding_window"] if layer_type == SLIDING
                              else None)
        # NOTE: no attention soft-cap: HF's Gemma 3 keeps attn_logit_softcapping in its
        # config (Gemma 2's) but never applies it, and rung follows the model HF runs

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        rotary, cos, sin = rope
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.shard_sizes, dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = rotary.rotate(q, cos, sin), rotary.rotate(k, cos, sin)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, index: int) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.layer_type = cfg["layer_types"][index]
        self.self_attn = Gemma3Attention(cfg, self.layer_type,
                                         f"model.layers.{index}.self_attn.attn")
        self.mlp = GatedMLP(hidden, cfg["intermediate_size"], cfg["hidden_activation"])
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(hidden, eps, NORM_OFFSET, cast_before_scale=False))

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        # NOTE: follows model.to(dtype), so bf16 models scale by bf16(sqrt(hidden)) as HF does
        self.register_buffer("embed_scale", torch.tensor(cfg["hidden_size"] ** 0.5),
                             persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], NORM_OFFSET,
                            cast_before_scale=False)


class Gemma3ForCausalLM(ScaledSoftcappedLM):
    text_config = staticmethod(text_config)
    # GGUF (llama.cpp): layer tensor names that differ from Llama's; norm weights are stored
    # as 1 + w (llama.cpp scales by w), so loading takes NORM_OFFSET off again
    gguf_permuted_qk = False
    gguf_layer_tensors = {"post_attention_norm": "post_attention_layernorm",
                          "ffn_norm": "pre_feedforward_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"}
    gguf_norm_offset = NORM_OFFSET
    # NOTE: compute_logits calls the head as a module, so a quantized head may replace it
    # (a tied one shares the embedding's blocks: 262k x 640 in fp32 would be 640 MiB)
    quantizable_head = True

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        cfg = text_config(cfg)
        check_supported(cfg)
        self.config = cfg
        self.model = Gemma3Model(cfg)
        params = cfg["rope_parameters"]
        self.rotary = nn.ModuleDict({
            t: RotaryEmbedding(rope_inv_freq(cfg["head_dim"], float(params[t]["rope_theta"]),
                                             params[t]))
            for t in dict.fromkeys(cfg["layer_types"])})
        self.init_head(cfg)

    @staticmethod
    def gguf_config(gguf_model) -> dict:
        """The HF-style config of a ``gemma3`` GGUFModel. llama.cpp fixes what the file
        leaves out: 5 sliding layers to 1 full, sliding rope base 10000, attention scale
        1 / sqrt(head_dim) (query_pre_attn_scalar = head_dim)."""
        hidden = int(gguf_model.required("embedding_length"))
        head_dim = int(gguf_model.required("attention.key_length"))
        num_heads = int(gguf_model.required("attention.head_count"))
        scaling = gguf_model.arch_field("rope.scaling.type")
        full = {"rope_type": "default",
                "rope_theta": float(gguf_model.arch_field("rope.freq_base", _THETA[FULL]))}
        if scaling not in (None, "none"):
            full.update(rope_type=scaling,
                        factor=float(gguf_model.required("rope.scaling.factor")))
        names = {t.name for t in gguf_model.reader.tensors}
        return text_config({
            "vocab_size": gguf_model.tensor_rows("token_embd.weight"),
            "hidden_size": hidden,
            "intermediate_size": int(gguf_model.required("feed_forward_length")),
            "num_hidden_layers": int(gguf_model.required("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(gguf_model.arch_field("attention.head_count_kv",
                                                             num_heads)),
            "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
            "sliding_window": int(gguf_model.required("attention.sliding_window")),
            "rms_norm_eps": float(gguf_model.required("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(gguf_model.arch_field("context_length", 131_072)),
            "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": _THETA[SLIDING]},
                                FULL: full},
            "final_logit_softcapping": gguf_model.arch_field("final_logit_softcapping"),
            "tie_word_embeddings": "output.weight" not in names,
            **gguf_model.special_token_ids(),
        })

    def load_weights(self, weights: WeightStream) -> None:
        loaded = load_named_weights(self, weights, STACKED_PARAMS)
        check_all_loaded(self, loaded, {"lm_head.weight": "model.embed_tokens.weight"}
                         if self.tied else {})
