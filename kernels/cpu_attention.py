"""Decode attention on CPU inside compiled graphs: the op ``rung::paged_decode_attention``.

A CPU graph traces attention as plain torch ops (``paged_attention_fusable``): inductor
fuses them, but its fused softmax reads every block of the batch's cut block table and
recomputes the scores in each pass (on Gemma 3 270M, more than half the time of its
layers' matmuls; docs/performance.md, "Decode attention in CPU graphs"). For decode (one
query token per request) a compiled graph calls this op instead: an opaque call whose C
kernel (``csrc/cpu_attention.c``, behind ``csrc/gguf_op.cpp``'s wrapper in the library
``gguf_cpu.load_kernel`` builds, where the op's schema is defined too) reads each
request's visible keys in place, block by block, once. Its result is the reference's
(``torch_backend.paged_attention_ref``) within fp32 rounding, and a token's bits never
depend on the batch around it or on the thread count.
"""

from __future__ import annotations

import torch

from rung.core.attention_metadata import CommonAttentionMetadata
from rung.kernels.backend import AttentionLayerSpec
from rung.kernels.gguf_cpu import kernel_loaded
from rung.kernels.torch_backend import is_decode_batch


def serves(query: torch.Tensor, kv_cache: torch.Tensor, meta: CommonAttentionMetadata) -> bool:
    """Whether the op serves this traced attention: a decode batch (one query token per
    block-table row) on CPU, float32 KV, with the kernel library loaded."""
    return (query.device.type == "cpu" and kv_cache.dtype == torch.float32
            and is_decode_batch(meta, query.shape[0]) and kernel_loaded())


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           meta: CommonAttentionMetadata,
                           layer: AttentionLayerSpec) -> torch.Tensor:
    """query [T, num_heads, head_dim] (token t: block-table row t) -> [T, num_heads,
    head_dim] fp32; pad rows (seq_len 0) give 0."""
    return torch.ops.rung.paged_decode_attention.default(
        query.float(), kv_cache, meta.block_table, meta.seq_lens, float(layer.scale),
        int(layer.sliding_window or 0), float(layer.logit_softcap or 0.0))
