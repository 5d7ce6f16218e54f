"""Gemma 4's rotary tables: one per layer type (sliding, full), as HF builds them."""

from __future__ import annotations

import torch

from rung.models.layers import proportional_inv_freq, rope_inv_freq

SLIDING, FULL = "sliding_attention", "full_attention"


def rope_inv_freqs(cfg: dict, specs: list) -> dict[str, torch.Tensor]:
    """layer type -> inv_freq [head_dim // 2] fp32 (HF: one rotary table per layer type).
    ``specs``: a Gemma4LayerSpec per layer (its layer_type and head_dim are read)."""
    params = cfg["rope_parameters"]
    out = {}
    for layer_type in dict.fromkeys(s.layer_type for s in specs):
        dims = {s.head_dim for s in specs if s.layer_type == layer_type}
        if len(dims) != 1:
            raise ValueError(f"{layer_type} layers have head dims {sorted(dims)}; HF needs one")
        nested = bool({SLIDING, FULL} & set(params))     # HF nests by type; flat: all types
        p = params.get(layer_type) if nested else params
        out[layer_type] = _inv_freq(dims.pop(), p, layer_type)
    return out


def _inv_freq(head_dim: int, p: dict | None, layer_type: str) -> torch.Tensor:
    if not p:
        raise ValueError(f"rope_parameters[{layer_type!r}] is missing")
    rope_type, theta = p.get("rope_type", "default"), float(p["rope_theta"])
    if rope_type == "default":          # NOTE: HF's Gemma 4 default ignores partial_rotary
        return rope_inv_freq(head_dim, theta, None)
    if rope_type == "proportional":
        return proportional_inv_freq(head_dim, theta, p.get("partial_rotary_factor", 1.0),
                                     p.get("factor", 1.0))
    raise ValueError(f"rope_parameters[{layer_type!r}] rope_type={rope_type!r} unsupported; "
                     "rung supports default, proportional")
