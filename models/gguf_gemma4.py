"""llama.cpp's ``gemma4`` GGUF architecture -> rung's Gemma 4 text decoder.

What llama.cpp's converter does to a Gemma 4 checkpoint, and how rung undoes it:

- metadata: head dims per layer type (``key_length`` full, ``key_length_swa`` sliding),
  a per-layer ``sliding_window_pattern`` (True = sliding), KV heads and FFN widths as
  per-layer arrays when they differ between layers (full layers with their own KV heads;
  double-wide MLPs in KV-shared layers), one RoPE base per layer type
  (``rope.freq_base`` full, ``rope.freq_base_swa`` sliding), ``shared_kv_layers``;
- proportional RoPE of full layers becomes a ``rope_freqs`` tensor: frequency divisors of
  1 for the rotated pairs and 1e30 (frequency ~0) for the rest, so the fraction of 1s is
  the partial rotary factor;
- norms are stored as is (Gemma 4 scales by ``w``, not ``1 + w``), q/k rows unpermuted,
  the embedding cut to the tokenizer's size, the activation never stored (always tanh GELU);
- MoE: the router's ``scale`` and ``per_expert_scale`` become ``ffn_gate_inp.scale`` and
  ``ffn_down_exps.scale``; the fused expert gate/up tensor keeps HF's layout (gate first).

A file whose metadata says something rung's Gemma 4 cannot express is refused with the key.
"""

from __future__ import annotations

import re

import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"     # HF layer_types

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
ROPE_FREQS = "rope_freqs.weight"      # consumed by the config (proportional RoPE)

# Tensors of Gemma 4 variants rung's text decoder does not run, by what they belong to.
_UNSUPPORTED_TENSORS = {
    "per_layer_token_embd": "per-layer input embeddings (embedding_length_per_layer_input)",
    "per_layer_model_proj": "per-layer input embeddings (embedding_length_per_layer_input)",
    "per_layer_proj_norm": "per-layer input embeddings (embedding_length_per_layer_input)",
    "inp_gate": "per-layer input embeddings (embedding_length_per_layer_input)",
    "proj": "per-layer input embeddings (embedding_length_per_layer_input)",
    "post_norm": "per-layer input embeddings (embedding_length_per_layer_input)",
    "ffn_gate_exps": "separate expert gate/up tensors (rung reads the fused ffn_gate_up_exps)",
    "ffn_up_exps": "separate expert gate/up tensors (rung reads the fused ffn_gate_up_exps)",
}

# gemma4.* metadata keys rung reads; any other one may change the math, so it is refused.
KNOWN_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.key_length_swa",
    "attention.value_length_swa", "attention.sliding_window",
    "attention.sliding_window_pattern", "attention.shared_kv_layers",
    "embedding_length_per_layer_input", "rope.freq_base", "rope.freq_base_swa",
    "rope.dimension_count", "rope.dimension_count_swa", "final_logit_softcapping",
    "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_gating_func",
})
_GATING_SOFTMAX = 1           # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
_UNROTATED = 1e29             # rope_freqs divisors at or above this freeze a pair (1e30)


def hf_name(name: str) -> str:
    """GGUF tensor name -> HF name in rung's Gemma 4 (ValueError for anything else)."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    rest = match.group(2) if match else name
    if match and rest in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[rest]}"
    what = _UNSUPPORTED_TENSORS.get(rest.rsplit(".", 1)[0])
    if what:
        raise ValueError(f"GGUF tensor {name!r} belongs to {what}, which rung's Gemma 4 text "
                         "decoder does not support")
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in rung's Gemma 4 model")


def text_config(model) -> dict:
    """The HF-style Gemma 4 text config of a ``gemma4`` GGUFModel (see the module doc)."""
    _check_keys(model)
    _check_no_per_layer_inputs(model)
    num_layers = int(model.required("block_count"))
    layer_types = _layer_types(model, num_layers)
    num_shared = int(model.arch_field("attention.shared_kv_layers", 0))
    head_dims = _head_dims(model)
    num_kv_heads, per_layer_config = _kv_heads(model, layer_types, head_dims)
    intermediate, double_wide = _ffn_widths(model, num_layers, num_shared)
    names = {t.name for t in model.reader.tensors}
    return {
        "model_type": "gemma4_text",
        "vocab_size": model.tensor_rows("token_embd.weight"),   # cut to the tokenizer's size
        "hidden_size": int(model.required("embedding_length")),
        "intermediate_size": intermediate,
        "use_double_wide_mlp": double_wide,
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(model.required("attention.head_count")),
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dims[SLIDING],
        "global_head_dim": head_dims[FULL],
        "per_layer_config": per_layer_config,
        "layer_types": layer_types,
        "sliding_window": int(model.required("attention.sliding_window")),
        "num_kv_shared_layers": num_shared,
        "attention_k_eq_v": _keys_are_values(model, layer_types, num_shared, names),
        "rms_norm_eps": float(model.required("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(model.arch_field("context_length", 131_072)),
        "rope_parameters": _rope_parameters(model, head_dims, names),
        "final_logit_softcapping": model.arch_field("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "tie_word_embeddings": "output.weight" not in names,
        **model.special_token_ids(),
        **_moe(model, num_layers, names),
    }


def _check_keys(model) -> None:
    prefix = f"{model.arch}."
    unknown = sorted(k for k in model.reader.fields
                     if k.startswith(prefix) and k[len(prefix):] not in KNOWN_KEYS)
    if unknown:
        raise ValueError(f"GGUF file {model.path!r} has metadata {unknown[0]!r} that rung's "
                         "Gemma 4 loader does not know; it may change the model, so rung "
                         "refuses to guess")


def _check_no_per_layer_inputs(model) -> None:
    size = int(model.arch_field("embedding_length_per_layer_input", 0))
    if size:
        raise ValueError(f"GGUF file {model.path!r} has {model.arch}.embedding_length_per_layer_"
                         f"input={size}: per-layer input embeddings (Gemma 4 E2B/E4B) are not "
                         "supported by rung's Gemma 4 text decoder")


def _kv_heads(model, layer_types: list[str], head_dims: dict[str, int]) -> tuple[int, dict]:
    """(num_key_value_heads, per_layer_config): the sliding layers' KV head count, and each
    layer whose head dim or KV head count differs from the sliding layers' (full layers)."""
    num_heads = model.required("attention.head_count")
    kv_heads = _per_layer(model, "attention.head_count_kv", len(layer_types), num_heads)
    base_kv = kv_heads[layer_types.index(SLIDING)] if SLIDING in layer_types else kv_heads[0]
    per_layer_config = {}
    for i, layer_type in enumerate(layer_types):
        override = {}
        if head_dims[layer_type] != head_dims[SLIDING]:
            override["head_dim"] = head_dims[layer_type]
        if kv_heads[i] != base_kv:
            override["num_key_value_heads"] = kv_heads[i]
        if override:
            per_layer_config[str(i)] = override
    return base_kv, per_layer_config


def _per_layer(model, key: str, num_layers: int, default=None) -> list[int]:
    """A scalar or per-layer array metadata value -> one int per layer."""
    value = model.arch_field(key, default)
    if value is None:
        value = model.required(key)           # raises, naming the key
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * num_layers
    if len(values) != num_layers:
        raise ValueError(f"GGUF file {model.path!r}: {model.arch}.{key} has {len(values)} "
                         f"entries, block_count={num_layers}")
    return values


def _layer_types(model, num_layers: int) -> list[str]:
    key = "attention.sliding_window_pattern"
    pattern = model.required(key)
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(f"GGUF file {model.path!r}: {model.arch}.{key}={pattern!r} must list "
                         f"one bool per layer (block_count={num_layers})")
    types = [SLIDING if p else FULL for p in pattern]
    if types[-1] != FULL:
        raise ValueError(f"GGUF file {model.path!r}: {model.arch}.{key} makes the last layer "
                         "sliding; Gemma 4's last layer is full attention")
    return types


def _head_dims(model) -> dict[str, int]:
    """{layer type: head_dim}; keys and values must share it (as llama.cpp requires)."""
    dims = {FULL: int(model.required("attention.key_length")),
            SLIDING: int(model.required("attention.key_length_swa"))}
    for key, want in (("attention.value_length", dims[FULL]),
                      ("attention.value_length_swa", dims[SLIDING])):
        got = model.arch_field(key, want)
        if int(got) != want:
            raise ValueError(f"GGUF file {model.path!r}: {model.arch}.{key}={got} differs from "
                             f"the key length {want}; Gemma 4 keys and values share a head dim")
    return dims


def _ffn_widths(model, num_layers: int, num_shared: int) -> tuple[int, bool]:
    """(intermediate_size, use_double_wide_mlp) from one width or a per-layer array."""
    widths = _per_layer(model, "feed_forward_length", num_layers)
    base, first_shared = widths[0], num_layers - num_shared
    if widths == [base] * num_layers:
        return base, False
    double = [base] * first_shared + [2 * base] * num_shared
    if widths != double:
        raise ValueError(f"GGUF file {model.path!r}: {model.arch}.feed_forward_length={widths} "
                         "is neither one width nor double width in the KV-shared layers "
                         "(use_double_wide_mlp)")
    return base, True


def _keys_are_values(model, layer_types: list[str], num_shared: int, names: set[str]) -> bool:
    """Full layers without attn_v use their keys as values (HF ``attention_k_eq_v``)."""
    owners = [i for i, t in enumerate(layer_types[:len(layer_types) - num_shared]) if t == FULL]
    missing = [i for i in owners if f"blk.{i}.attn_v.weight" not in names]
    if missing and missing != owners:
        raise ValueError(f"GGUF file {model.path!r}: full layers {missing} lack attn_v but "
                         f"others have it; rung reads keys as values in all full layers or none")
    sliding = [i for i, t in enumerate(layer_types[:len(layer_types) - num_shared])
               if t == SLIDING and f"blk.{i}.attn_v.weight" not in names]
    if sliding:
        raise ValueError(f"GGUF file {model.path!r}: sliding layers {sliding} lack attn_v")
    return bool(missing)


def _rope_parameters(model, head_dims: dict[str, int], names: set[str]) -> dict:
    for key, layer_type in (("rope.dimension_count", FULL),
                            ("rope.dimension_count_swa", SLIDING)):
        rotated = int(model.arch_field(key, head_dims[layer_type]))
        if rotated != head_dims[layer_type]:
            raise ValueError(f"GGUF file {model.path!r}: {model.arch}.{key}={rotated} rotates "
                             f"part of the {head_dims[layer_type]}-dim {layer_type} heads; "
                             "rung's Gemma 4 rotates whole heads (partial rotation of full "
                             "layers comes from rope_freqs)")
    theta = float(model.arch_field("rope.freq_base", 1_000_000.0))
    theta_swa = float(model.arch_field("rope.freq_base_swa", theta))
    full = {"rope_type": "default", "rope_theta": theta}
    if ROPE_FREQS in names:
        full = {"rope_type": "proportional", "rope_theta": theta,
                "partial_rotary_factor": _partial_rotary_factor(model, head_dims[FULL])}
    return {SLIDING: {"rope_type": "default", "rope_theta": theta_swa}, FULL: full}


def _partial_rotary_factor(model, head_dim: int) -> float:
    """rope_freqs [head_dim // 2]: 1 for each rotated pair, then 1e30 -> 2 * rotated / head_dim."""
    divisors = model.tensor_array(ROPE_FREQS).reshape(-1)
    rotated = int(np.sum(divisors < _UNROTATED))
    want = np.concatenate([np.ones(rotated), np.full(head_dim // 2 - rotated, 1e30)])
    if divisors.shape != want.shape or not np.allclose(divisors, want, rtol=1e-6):
        raise ValueError(f"GGUF file {model.path!r}: rope_freqs {divisors.tolist()[:8]}... "
                         f"is not the proportional-RoPE form rung maps (1 for the first pairs, "
                         f"1e30 for the rest, {head_dim // 2} entries)")
    return 2 * rotated / head_dim


def _moe(model, num_layers: int, names: set[str]) -> dict:
    """The MoE keys of rung's config: every layer routed, or none."""
    routed = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not routed:
        return {"enable_moe_block": False}
    if len(routed) != num_layers:
        raise ValueError(f"GGUF file {model.path!r} routes experts in layers {routed} only; "
                         "rung's Gemma 4 has the MoE block in every layer or none")
    gating = model.arch_field("expert_gating_func", _GATING_SOFTMAX)
    if int(gating) != _GATING_SOFTMAX:
        raise ValueError(f"GGUF file {model.path!r}: {model.arch}.expert_gating_func={gating}; "
                         "Gemma 4 routes with softmax (1)")
    return {"enable_moe_block": True,
            "num_experts": int(model.required("expert_count")),
            "top_k_experts": int(model.required("expert_used_count")),
            "moe_intermediate_size": int(model.required("expert_feed_forward_length"))}
