"""Decode attention on CPU inside compiled graphs: the op ``rung::paged_decode_attention``.

A CPU graph traces attention as plain torch ops (``paged_attention_fusable``): inductor
fuses them, but its fused softmax reads every block of the batch's cut block table and
recomputes the scores in each pass, which costs a decode step more than its small matmuls
(docs/performance.md, "Decode attention in CPU graphs"). For decode (one query token per
request) a compiled graph calls this op instead: an opaque call whose C++ kernel
(``csrc/cpu_attention.cpp``, built into the library ``gguf_cpu.load_kernel`` compiles)
reads each request's visible keys in place, block by block, once. Its result is the
reference's (``torch_backend.paged_attention_ref``) within fp32 rounding, and a token's
bits never depend on the batch around it or on the thread count.
"""

from __future__ import annotations

import torch

from rung.core.attention_metadata import CommonAttentionMetadata
from rung.kernels.backend import AttentionLayerSpec

_LIBRARY = torch.library.Library("rung", "FRAGMENT")
_LIBRARY.define("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
                "Tensor seq_lens, float scale, int sliding_window, float softcap) -> Tensor")
_LIBRARY.impl("paged_decode_attention",
              lambda query, kv_cache, block_table, seq_lens, scale, sliding_window, softcap:
              query.new_empty(query.shape, dtype=torch.float32), "Meta")


def serves(query: torch.Tensor, kv_cache: torch.Tensor, meta: CommonAttentionMetadata) -> bool:
    """Whether the op serves this traced attention: a decode batch (one query token per
    block-table row) on CPU, float32 KV, with the kernel library loaded."""
    from rung.kernels.gguf_cpu import kernel_loaded

    return (query.device.type == "cpu" and kv_cache.dtype == torch.float32
            and meta.desc.uniform_query_len == 1
            and meta.block_table.shape[0] == query.shape[0] and kernel_loaded())


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           meta: CommonAttentionMetadata,
                           layer: AttentionLayerSpec) -> torch.Tensor:
    """query [T, num_heads, head_dim] (token t: block-table row t) -> [T, num_heads,
    head_dim] fp32; pad rows (seq_len 0) give 0."""
    return torch.ops.rung.paged_decode_attention.default(
        query.float(), kv_cache, meta.block_table, meta.seq_lens, float(layer.scale),
        int(layer.sliding_window or 0), float(layer.logit_softcap or 0.0))
