"""Building blocks shared by rung's model definitions."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in fp32, scale by ``weight + weight_offset``."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0,
                 cast_before_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_offset = weight_offset
        self.cast_before_scale = cast_before_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight + self.weight_offset if self.weight_offset else self.weight
        if self.cast_before_scale:   # Llama / Qwen: scale in the input dtype
            return weight * xf.to(dtype)
        return (xf * weight.float()).to(dtype)   # Gemma: scale in fp32


class MergedLinear(nn.Linear):
    """One matmul for several HF projections (q/k/v, gate/up); shards load by index."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        assert loaded.shape[0] == size, (
            f"shard {shard} has {loaded.shape[0]} rows, expected {size}")
        param.data[start:start + size].copy_(loaded)


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """inv_freq [rotary_dim // 2] fp32, HF's default and llama3 rope types."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                               / rotary_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")


def proportional_inv_freq(head_dim: int, base: float, partial_rotary_factor: float,
                          factor: float = 1.0) -> torch.Tensor:
    """inv_freq [head_dim // 2] fp32 of HF's "proportional" RoPE (Gemma 4 full layers).

    The first ``int(partial_rotary_factor * head_dim // 2)`` frequencies follow the default
    schedule with exponents over the WHOLE head_dim; the rest are 0 (cos 1, sin 0).
    NOTE: use it with rotary_dim == head_dim: dim i still pairs with i + head_dim // 2,
    unlike partial RoPE over a prefix of the head.
    """
    rope_angles = int(partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)                                   # [rope_angles]
    zeros = torch.zeros(head_dim // 2 - rope_angles, dtype=torch.float32)
    return torch.cat((inv_freq, zeros)) / factor


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary over the first ``rotary_dim`` dims, cos/sin cached per position."""

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.shape[0]
        freqs = torch.outer(torch.arange(max_position).float(), inv_freq)  # [max_pos, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)                            # [max_pos, rd]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dim]; gathered once per forward."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by ``cos_sin`` of its positions."""
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rd == x.shape[-1] else torch.cat((out, rest), dim=-1)


def init_random_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights with unit-scale activations (presets, load_format=dummy)."""
    gen = torch.Generator().manual_seed(seed)
    # NOTE: models that scale embeddings up (Gemma: by sqrt(hidden)) set `embed_init_std`
    # so scaled embeddings keep unit scale; others draw embeddings with std 1.
    embed_std = getattr(model, "embed_init_std", 1.0)
    for name, param in sorted(model.named_parameters()):
        if param.dim() == 1:
            # norms stay at their identity value; biases at 0
            continue
        fan_in = param.shape[-1]        # [out, in], or [experts, out, in]
        std = embed_std if "embed" in name else fan_in ** -0.5
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
        param.data.copy_(values.to(param.dtype))
