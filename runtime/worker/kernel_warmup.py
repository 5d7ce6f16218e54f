"""Warm-up of JIT-compiled attention kernels: every variant a serving run can launch is
compiled before the first request, and the engine counts any compiled after.

Triton picks its query tile (BLOCK_Q) from max_query_len, one variant per power of two up
to 64. Graph capture only launches the shapes of the graphs it captures; eager and
piecewise steps (prefill chunks) launch the rest. So warm-up runs the model once per
query-length bucket on an all-pad batch: the kernels launch with the real layers'
tensors and constants, and write nothing (slot -1, zero-length rows).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import forward_context
from rung.core.graph_mode import CUDAGraphMode
from rung.kernels.triton.variants import KERNEL_VARIANTS

logger = logging.getLogger(__name__)

# NOTE: kept in step with kernels/triton/paged_attention.WARMUP_QUERY_LENS, which this
# module does not import: triton may be missing, and then nothing here runs.
_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64)


def sweep_attention_shapes(runner: Any) -> int:
    """Run one all-pad forward per query-length bucket; returns the variants compiled."""
    if runner.backend.name != "TRITON":
        return 0
    before = KERNEL_VARIANTS.count()
    max_num_tokens = runner.input_batch.max_num_tokens
    with torch.inference_mode():
        # NOTE: a bucket is reachable when some max_query_len <= max_num_tokens rounds up
        # to it (24 tokens reach 32); the batch holds at most max_num_tokens tokens.
        for query_len in (q for q in _QUERY_LENS if q // 2 < max_num_tokens):
            _all_pad_forward(runner, min(query_len, max_num_tokens), query_len)
    compiled = KERNEL_VARIANTS.count() - before
    logger.info("attention kernel warm-up: %d Triton variants compiled", compiled)
    return compiled


def _all_pad_forward(runner: Any, num_tokens_padded: int, query_len: int) -> None:
    """One pad row and ``num_tokens_padded`` pad tokens; metadata says ``query_len``."""
    desc = BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, 0, 1, 0, num_tokens_padded)
    ids, positions, ctx = runner.dummy_batch(desc)
    metadata = {name: dataclasses.replace(m, max_query_len=query_len)
                for name, m in ctx.attn_metadata.items()}
    with forward_context(dataclasses.replace(ctx, attn_metadata=metadata)):
        runner.model(ids, positions)
