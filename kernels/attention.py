"""The attention layer models use, and the custom op that compiled graphs split at."""

from __future__ import annotations

import torch
from torch import nn

from rung.core.forward_context import get_forward_context
from rung.core.kv_cache_spec import KVCacheSpec
from rung.kernels import cpu_attention
from rung.kernels.backend import AttentionBackend, AttentionImpl, AttentionLayerSpec
from rung.kernels.torch_backend import paged_attention_fusable, write_kv

ATTENTION_OP = "rung::unified_attention"


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               output: torch.Tensor, layer_name: str) -> None:
    ctx = get_forward_context()
    layer: Attention = ctx.layers[layer_name]
    layer.impl.forward(query, key, value, layer.kv_cache, ctx.attn_metadata[layer_name], output)


@torch.library.custom_op(ATTENTION_OP, mutates_args=("output",))
def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      output: torch.Tensor, layer_name: str) -> None:
    _attention(query, key, value, output, layer_name)


@unified_attention.register_fake
def _(query, key, value, output, layer_name) -> None:
    return None


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, through the bound backend.

    ``kv_sharing_target``: name of the layer whose KV this layer reads (and never writes),
    as MTP drafters do with their target's cache.
    """

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: int | None = None,
                 logit_softcap: float | None = None,
                 kv_sharing_target: str | None = None) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.kv_sharing_target = kv_sharing_target
        self.spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                                       logit_softcap, writes_kv=kv_sharing_target is None)
        self.impl: AttentionImpl | None = None
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, kvh, hd]

    def kv_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(block_size, self.spec.num_kv_heads, self.spec.head_dim, dtype,
                           self.spec.sliding_window)

    def bind(self, backend: type[AttentionBackend], kv_cache: torch.Tensor) -> None:
        self.impl = backend.impl_cls(self.spec)
        self.kv_cache = kv_cache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [T, num_heads * head_dim], key/value [T, num_kv_heads * head_dim]."""
        s = self.spec
        num_tokens = query.shape[0]
        q = query.view(num_tokens, s.num_heads, s.head_dim)
        k = key.view(num_tokens, s.num_kv_heads, s.head_dim)
        v = value.view(num_tokens, s.num_kv_heads, s.head_dim)
        # NOTE: output is allocated before the op, so under PIECEWISE graphs it lives in
        # the preceding piece's static memory and the next piece reads a stable address.
        if torch.compiler.is_compiling() and get_forward_context().inline_attention:
            return self._inline_forward(q, k, v).view(num_tokens, s.num_heads * s.head_dim)
        output = torch.empty_like(q)
        if torch.compiler.is_compiling():
            # the op is what rung's compile backend splits the graph at
            torch.ops.rung.unified_attention(q, k, v, output, self.layer_name)
        else:
            _attention(q, k, v, output, self.layer_name)     # eager: skip op dispatch
        return output.view(num_tokens, s.num_heads * s.head_dim)

    def _inline_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """KV write and attention as plain torch ops, traced into a compiled graph; a CPU
        decode batch's attention is one opaque op (kernels/cpu_attention.py)."""
        meta = get_forward_context().attn_metadata[self.layer_name].common
        if self.spec.writes_kv:
            write_kv(self.kv_cache, k, v, meta.slot_mapping)
        if cpu_attention.serves(q, self.kv_cache, meta):     # CPU decode: one opaque op
            return cpu_attention.paged_decode_attention(q, self.kv_cache, meta,
                                                        self.spec).to(q.dtype)
        return paged_attention_fusable(q, self.kv_cache, meta, self.spec).to(q.dtype)
