"""The Llama-layout decoder every pre-norm family shares (Llama, Mistral, Qwen2/3, Phi-3).

A family subclasses ``LlamaForCausalLM`` in its own module and declares only what differs
(class attributes below: q/k norm, q/k/v biases, sliding window, GGUF tensor names); this
module builds, runs and loads them all.
"""

from __future__ import annotations

import torch
from torch import nn

from rung.kernels.attention import Attention
from rung.models.layers import (
    STACKED_PARAMS,
    DecoderParts,
    GatedMLP,
    MergedLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    decoder_layers,
    lm_head_logits,
    lm_head_row_splits,
    rope_inv_freq,
)
from rung.models.weights import WeightStream, check_all_loaded, load_named_weights

FULL_ATTENTION = "full_attention"      # every Llama layer: one rotary for all


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from HF v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`)."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") else None)
    return float(theta), scaling


def rotary_dim(cfg: dict, head_dim: int) -> int:
    """How many leading dims of a head rotate: HF's ``partial_rotary_factor`` (top level in
    v4 configs, inside ``rope_parameters`` in v5) of ``head_dim``; all of it by default."""
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return int(head_dim * float(factor))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, layer_name: str, qk_norm: bool, qkv_bias: bool | None = None,
                 sliding_window: int | None = None) -> None:
        """``qkv_bias``: whether q/k/v carry biases (None: the config's ``attention_bias``,
        which o_proj always follows); ``sliding_window``: every layer slides (Phi-3)."""
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = MergedLinear(hidden, [q_size, kv_size, kv_size],
                                     bias=bias if qkv_bias is None else qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        self.attn = Attention(layer_name, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, sliding_window=sliding_window)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary, cos, sin = rope
        q, k = rotary.rotate(q, cos, sin), rotary.rotate(k, cos, sin)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    layer_type = FULL_ATTENTION

    def __init__(self, cfg: dict, index: int, family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, f"model.layers.{index}.self_attn.attn",
                                        family.qk_norm, family.qkv_bias,
                                        family.sliding_window(cfg))
        self.mlp = GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], "silu")
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, family)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta, scaling = rope_settings(cfg)
        self.rotary_emb = RotaryEmbedding(rope_inv_freq(rotary_dim(cfg, head_dim), theta,
                                                        scaling),
                                          cfg["max_position_embeddings"])


class LlamaForCausalLM(nn.Module):
    # --- what a family declares (its module subclasses this class) ---
    qk_norm = False                 # per-head RMSNorm on q and k before rope (Qwen3)
    qkv_bias: bool | None = None    # q/k/v biases; None: the config's attention_bias
    # GGUF: llama.cpp permuted q/k rows at conversion (its Llama rope pairs dims
    # interleaved; families on its neox rope keep HF's rows); layer tensor names
    # (after "blk.N.") that differ from Llama's
    gguf_permuted_qk = True
    gguf_layer_tensors: dict[str, str] = {}

    @staticmethod
    def sliding_window(cfg: dict) -> int | None:
        """The window every layer slides over; None: full attention."""
        return None

    # NOTE: a small tied head (SmolLM2: 49152 x 576) is worth a W^T copy on CPU; see
    # lm_head_logits
    transposed_tied_head = True
    # NOTE: compute_logits goes through lm_head_logits, so a quantized head may replace it
    quantizable_head = True

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.check_config(cfg)
        self.model = LlamaModel(cfg, type(self))
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def check_config(self, cfg: dict) -> None:
        """A ValueError for config settings the family's HF model has and rung does not."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens_padded] -> hidden [num_tokens_padded, hidden]."""
        hidden = self.model.embed_tokens(input_ids)                   # [T, hidden]
        return decoder_layers(self.model.layers, self.model.norm,
                              {FULL_ATTENTION: self.model.rotary_emb}, hidden, positions)

    def decoder_parts(self) -> DecoderParts:
        """``forward`` in pieces (see DecoderParts)."""
        return DecoderParts(self.model.embed_tokens, self.model.layers,
                            {FULL_ATTENTION: self.model.rotary_emb}, self.model.norm,
                            self.compute_logits, self.lm_head,
                            lm_head_row_splits(self.lm_head, self.model.norm.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_reqs, hidden] -> logits [num_reqs, vocab] fp32."""
        return lm_head_logits(self.lm_head, hidden)

    def load_weights(self, weights: WeightStream) -> None:
        loaded = load_named_weights(self, weights, STACKED_PARAMS)
        check_all_loaded(self, loaded, {"lm_head.weight": "model.embed_tokens.weight"}
                         if self.tied else {})
