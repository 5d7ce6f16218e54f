"""Gemma 4 text decoder: sliding and full layers with their own head dims, q/k/v norms,
per-layer-type RoPE, KV sharing across layers, final logit softcapping, and the MoE block
(a routed-experts branch beside every layer's dense MLP, `enable_moe_block`).

Config facts follow HF transformers' `Gemma4TextConfig` / `Gemma4ForCausalLM`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rung.kernels.attention import Attention
from rung.models.gemma4_rope import FULL, SLIDING, rope_inv_freqs
from rung.models.layers import (
    ACTIVATIONS,
    STACKED_PARAMS,
    GatedMLP,
    MergedLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    ScaledSoftcappedLM,
)
from rung.models.moe import RoutedExperts, dense_routing, ep_all_gather, ep_reduce_scatter
from rung.models.weights import WeightStream, check_all_loaded, load_named_weights

# HF Gemma4TextConfig defaults for the fields config.json may omit.
_TEXT_DEFAULTS: dict = {
    "model_type": "gemma4_text", "vocab_size": 262_144, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 30, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
    "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
    "sliding_window": 512, "final_logit_softcapping": None, "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "enable_moe_block": False,
    "use_double_wide_mlp": False, "num_experts": None, "top_k_experts": None,
    "moe_intermediate_size": None,
}
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                        "rope_theta": 1_000_000.0}}
_DEFAULT_GLOBAL_HEAD_DIM = 512
_SLIDING_PATTERN = 6          # HF default: 5 sliding layers, then 1 full
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")   # per_layer_config keys rung handles
# Multimodal folders: language model under this prefix; towers and their embedders skipped.
_LM_PREFIX = "model.language_model."
_MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                        "model.embed_audio.")


# --- config ------------------------------------------------------------------------------
def text_config(cfg: dict) -> dict:
    """The text decoder's config with HF's defaults filled in.

    `gemma4` (multimodal) folders keep it under ``text_config``; the top level decides
    weight tying and may carry the special token ids.
    """
    if cfg.get("model_type") == "gemma4":
        text = dict(cfg.get("text_config") or {})
        text["model_type"] = "gemma4_text"
        text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if cfg.get(key) is not None:
                text[key] = cfg[key]
    else:
        text = dict(cfg)
    text = {**_TEXT_DEFAULTS, **text}
    text["layer_types"] = _layer_types(text)
    text["rope_parameters"] = text.get("rope_parameters") or _DEFAULT_ROPE
    return text


def _layer_types(cfg: dict) -> list[str]:
    num_layers = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or
                 [SLIDING if (i + 1) % _SLIDING_PATTERN else FULL for i in range(num_layers)])
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad:
        raise ValueError(f"layer_types={bad} unsupported; rung supports {SLIDING}, {FULL}")
    types[-1] = FULL          # NOTE: HF forces the last layer to full attention
    return types


def check_supported(cfg: dict) -> None:
    """ValueError naming the field for what HF's Gemma 4 does that rung does not."""
    unsupported = {
        "hidden_size_per_layer_input": bool(cfg["hidden_size_per_layer_input"]),
        "use_bidirectional_attention": cfg["use_bidirectional_attention"] == "all",
        "hidden_activation": cfg["hidden_activation"] not in ACTIVATIONS,
    }
    for field, bad in unsupported.items():
        if bad:
            raise ValueError(f"Gemma 4 config {field}={cfg[field]!r} is not supported by rung "
                             "(text decoder: no per-layer input embeddings, causal "
                             f"attention, activations {sorted(ACTIVATIONS)})")
    if cfg["enable_moe_block"]:
        _check_moe(cfg)
    shared = cfg["num_kv_shared_layers"]
    if not 0 <= shared < cfg["num_hidden_layers"]:
        raise ValueError(f"num_kv_shared_layers={shared} must be in [0, num_hidden_layers="
                         f"{cfg['num_hidden_layers']}): shared layers need a layer to read from")


def _check_moe(cfg: dict) -> None:
    num_experts, top_k = cfg["num_experts"], cfg["top_k_experts"]
    size = cfg["moe_intermediate_size"]
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"Gemma 4 enable_moe_block needs num_experts >= 1, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"Gemma 4 top_k_experts={top_k!r} must be in [1, num_experts="
                         f"{num_experts}]")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"Gemma 4 enable_moe_block needs moe_intermediate_size >= 1, "
                         f"got {size!r}")


@dataclasses.dataclass(frozen=True)
class Gemma4LayerSpec:
    """What one decoder layer looks like once HF's per-layer overrides are applied."""

    layer_type: str
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None
    kv_source: int | None     # layer whose KV cache this one reads; None: its own
    k_eq_v: bool              # values are the raw keys (full layers with attention_k_eq_v)
    intermediate_size: int


def _per_layer_overrides(cfg: dict) -> dict[int, dict]:
    """HF `per_layer_config` as saved, else what HF derives from `global_head_dim`."""
    saved = cfg.get("per_layer_config")
    if saved is not None:
        overrides = {int(i): dict(o) for i, o in saved.items()}
        for i, o in overrides.items():
            extra = sorted(set(o) - set(_LAYER_OVERRIDES))
            if extra:
                raise ValueError(f"per_layer_config[{i}] overrides {extra}; rung supports "
                                 f"{list(_LAYER_OVERRIDES)}")
        return overrides
    full = {"head_dim": cfg.get("global_head_dim", _DEFAULT_GLOBAL_HEAD_DIM)}
    if cfg["attention_k_eq_v"] and cfg.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    return {i: full for i, t in enumerate(cfg["layer_types"]) if t == FULL}


def _kv_sources(cfg: dict) -> list[int | None]:
    """HF kv sharing: each of the last `num_kv_shared_layers` layers reads the KV of the
    last earlier non-shared layer of its type."""
    types = cfg["layer_types"]
    first_shared = len(types) - cfg["num_kv_shared_layers"]
    producers = {t: i for i, t in enumerate(types[:first_shared])}   # last of each type
    missing = sorted(set(types) - set(producers))
    if missing:
        raise ValueError(f"num_kv_shared_layers={cfg['num_kv_shared_layers']} leaves no "
                         f"non-shared layer of type {missing} to read KV from")
    return [None if i < first_shared else producers[t] for i, t in enumerate(types)]


def layer_specs(cfg: dict) -> list[Gemma4LayerSpec]:
    overrides = _per_layer_overrides(cfg)
    sources = _kv_sources(cfg)
    specs = []
    for i, layer_type in enumerate(cfg["layer_types"]):
        o = overrides.get(i, {})
        shared = sources[i] is not None
        wide = 2 if cfg["use_double_wide_mlp"] and shared else 1
        specs.append(Gemma4LayerSpec(
            layer_type, o.get("head_dim", cfg["head_dim"]),
            o.get("num_key_value_heads", cfg["num_key_value_heads"]),
            cfg["sliding_window"] if layer_type == SLIDING else None, sources[i],
            bool(cfg["attention_k_eq_v"]) and layer_type == FULL,
            cfg["intermediate_size"] * wide))
    return specs


# --- layers --------------------------------------------------------------------------------
def rms_norm_no_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's v_norm: RMSNorm in fp32 without a weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: dict, spec: Gemma4LayerSpec, layer_name: str) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], spec.num_kv_heads
        self.head_dim, self.eps = spec.head_dim, eps
        self.reads_shared_kv = spec.kv_source is not None
        self.k_eq_v = spec.k_eq_v
        q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = [q_size] if self.reads_shared_kv else (
            [q_size, self.kv_size] if self.k_eq_v else [q_size, self.kv_size, self.kv_size])
        bias = bool(cfg["attention_bias"])
        self.qkv_proj = MergedLinear(hidden, shards, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, cast_before_scale=False)
        self.k_norm = None if self.reads_shared_kv else RMSNorm(self.head_dim, eps,
                                                                cast_before_scale=False)
        target = (f"model.layers.{spec.kv_source}.self_attn.attn"
                  if self.reads_shared_kv else None)
        # NOTE: scale 1.0: q_norm / k_norm already set the logit scale (HF `scaling = 1.0`).
        self.attn = Attention(layer_name, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=1.0, sliding_window=spec.sliding_window,
                              kv_sharing_target=target)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        rotary, cos, sin = rope
        parts = self.qkv_proj(hidden).split(self.qkv_proj.shard_sizes, dim=-1)
        q = self.q_norm(parts[0].reshape(num_tokens, self.num_heads, self.head_dim))
        q = rotary.rotate(q, cos, sin).reshape(num_tokens, -1)
        if self.reads_shared_kv:
            # NOTE: the backend neither writes nor reads these: this layer's KV comes
            # from the source layer's cache.
            unused = hidden.new_empty(num_tokens, self.kv_size)     # [T, kvh * hd]
            return self.o_proj(self.attn(q, unused, unused))
        k = parts[1].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = k if self.k_eq_v else parts[2].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        k = rotary.rotate(self.k_norm(k), cos, sin)
        v = rms_norm_no_scale(v, self.eps)
        out = self.attn(q, k.reshape(num_tokens, -1), v.reshape(num_tokens, -1))
        return self.o_proj(out)


class Gemma4Router(nn.Module):
    """HF's Gemma 4 router: unscaled RMSNorm, a learned scale, softmax over experts in fp32,
    top-k renormalised to sum 1, then a per-expert scale."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
        self.eps, self.top_k = cfg["rms_norm_eps"], cfg["top_k_experts"]
        self.root_size = hidden ** -0.5
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> top-k weights [T, K] fp32, expert ids [T, K] int64."""
        x = rms_norm_no_scale(hidden, self.eps) * self.scale * self.root_size
        probs = torch.softmax(self.proj(x), dim=-1, dtype=torch.float32)      # [T, E]
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


def routed_experts(router: Gemma4Router, experts: RoutedExperts, pre_norm: nn.Module,
                   residual: torch.Tensor) -> torch.Tensor:
    """The routed branch of a MoE layer: residual [T, H] (the layer input before the MLP)
    -> the experts' weighted sum [T, H].

    Under expert parallel the tokens of every data-parallel rank are gathered, this rank's
    experts run on all of them, and the partial sums go back to their ranks: every rank
    must run the same (DP-padded) token count.
    """
    tokens = residual                                                    # [T, H]
    if experts.ep_size > 1:
        tokens = ep_all_gather(residual, experts.ep_size)                # [ep_size * T, H]
    weights, index = router(tokens)
    routing = dense_routing(weights, index, experts.num_experts)         # [., num_experts]
    out = experts(pre_norm(tokens), routing)
    if experts.ep_size > 1:
        out = ep_reduce_scatter(out, experts.ep_size, experts.ep_rank)   # [T, H]
    return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, spec: Gemma4LayerSpec, index: int) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.layer_type = spec.layer_type
        self.self_attn = Gemma4Attention(cfg, spec, f"model.layers.{index}.self_attn.attn")
        self.mlp = GatedMLP(hidden, spec.intermediate_size, cfg["hidden_activation"])
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        self.enable_moe_block = bool(cfg["enable_moe_block"])
        if self.enable_moe_block:
            # NOTE: HF names: router and experts sit on the layer, not under a submodule.
            self.router = Gemma4Router(cfg)
            self.experts = RoutedExperts(cfg["num_experts"], hidden,
                                         cfg["moe_intermediate_size"],
                                         ACTIVATIONS[cfg["hidden_activation"]])
            norms += ["post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                      "post_feedforward_layernorm_2"]
        for name in norms:
            setattr(self, name, RMSNorm(hidden, eps, cast_before_scale=False))
        self.layer_scalar = nn.Parameter(torch.ones(1))   # HF buffer; scales the layer output

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.enable_moe_block:
            routed = routed_experts(self.router, self.experts, self.pre_feedforward_layernorm_2,
                                    hidden)
            mlp = (self.post_feedforward_layernorm_1(mlp)
                   + self.post_feedforward_layernorm_2(routed))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        return hidden * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, cfg: dict, specs: list[Gemma4LayerSpec]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        # NOTE: follows model.to(dtype), so bf16 models scale by bf16(sqrt(hidden)) as HF does.
        self.register_buffer("embed_scale", torch.tensor(cfg["hidden_size"] ** 0.5),
                             persistent=False)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, s, i) for i, s in enumerate(specs))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], cast_before_scale=False)


def check_gemma4_loaded(model: nn.Module, loaded: set[str], num_layers: int,
                        tied: bool) -> None:
    """Every parameter loaded, but the optional ones: ``layer_scalar`` (HF initialises a
    missing one to 1, as rung does) and a tied ``lm_head``."""
    optional = {f"model.layers.{i}.layer_scalar": "" for i in range(num_layers)}
    if tied:
        optional["lm_head.weight"] = "model.embed_tokens.weight"
    check_all_loaded(model, loaded, optional)


class Gemma4ForCausalLM(ScaledSoftcappedLM):
    text_config = staticmethod(text_config)

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        cfg = text_config(cfg)
        check_supported(cfg)
        self.config = cfg
        self.specs = layer_specs(cfg)
        self.model = Gemma4Model(cfg, self.specs)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(f)
                                     for t, f in rope_inv_freqs(cfg, self.specs).items()})
        self.init_head(cfg)

    def load_weights(self, weights: WeightStream) -> None:
        loaded = load_named_weights(self, weights, STACKED_PARAMS,
                                    rename={_LM_PREFIX: "model."},
                                    skip_prefixes=_MULTIMODAL_PREFIXES + self._unused_kv_weights())
        check_gemma4_loaded(self, loaded, len(self.specs), self.tied)

    def _unused_kv_weights(self) -> tuple[str, ...]:
        """K/V projections and norms of KV-shared layers, which HF ignores on load."""
        return tuple(f"model.layers.{i}.self_attn.{name}"
                     for i, s in enumerate(self.specs) if s.kv_source is not None
                     for name in ("k_proj", "v_proj", "k_norm", "v_norm"))
