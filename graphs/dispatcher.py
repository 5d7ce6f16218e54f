"""Dispatcher: (num_reqs, num_tokens, uniform_query_len) -> BatchExecutionDescriptor."""

from __future__ import annotations

import bisect
import logging

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode, GraphSupport

logger = logging.getLogger(__name__)


def downgrade(mode: CUDAGraphMode, support: GraphSupport, backend_name: str) -> CUDAGraphMode:
    """The closest policy an attention backend with ``support`` can run."""
    if support == GraphSupport.NEVER and mode.has_full():
        new = CUDAGraphMode.PIECEWISE if mode != CUDAGraphMode.FULL_DECODE_ONLY else (
            CUDAGraphMode.NONE)
    elif support == GraphSupport.UNIFORM_BATCH and mode == CUDAGraphMode.FULL:
        new = CUDAGraphMode.FULL_AND_PIECEWISE
    else:
        return mode
    logger.warning("attention backend %s supports graph capture only for %s; cudagraph_mode "
                   "%s downgraded to %s", backend_name, support.name, mode.name, new.name)
    return new


class Dispatcher:
    def __init__(self, mode: CUDAGraphMode, sizes: list[int], max_num_reqs: int,
                 decode_query_len: int = 1) -> None:
        self.mode = mode
        self.sizes = sizes
        self.max_num_reqs = max_num_reqs
        self.decode_query_len = decode_query_len   # 1, or 1 + k under spec decode

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def is_uniform_decode(self, uniform_query_len: int | None) -> bool:
        return uniform_query_len == self.decode_query_len

    def runtime_mode(self, uniform_query_len: int | None) -> CUDAGraphMode:
        if self.is_uniform_decode(uniform_query_len):
            return self.mode.decode_mode()
        return self.mode.mixed_mode()

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_query_len: int | None,
                 num_tokens_across_dp: tuple[int, ...] | None = None
                 ) -> BatchExecutionDescriptor:
        """``num_tokens_across_dp``: under data parallel, the size every rank agreed to run
        (a ladder size, or above the ladder: eager, padded to it)."""
        mode = self.runtime_mode(uniform_query_len)
        if num_tokens_across_dp is None:
            size = self.padded_size(num_tokens)
        else:
            size = max(num_tokens_across_dp)
            size = size if size in self.sizes else None
        if mode == CUDAGraphMode.NONE or size is None:
            # above the largest captured size: run eagerly, never crash
            return BatchExecutionDescriptor.eager(num_reqs, num_tokens, uniform_query_len,
                                                  num_tokens_across_dp)
        rows = (num_reqs if mode == CUDAGraphMode.PIECEWISE
                else self.full_graph_rows(size, uniform_query_len))
        return BatchExecutionDescriptor(mode, num_reqs, rows, num_tokens, size,
                                        uniform_query_len, num_tokens_across_dp)

    def full_graph_rows(self, size: int, uniform_query_len: int | None) -> int:
        """Request rows a FULL graph of ``size`` tokens is captured with."""
        if self.is_uniform_decode(uniform_query_len):
            return size // self.decode_query_len
        return min(size, self.max_num_reqs)

    def capture_descriptors(self) -> list[BatchExecutionDescriptor]:
        """Every graph to capture: PIECEWISE before FULL, largest size first.

        Capture batches hold no real request: every row is a pad.
        """
        out: dict[tuple, BatchExecutionDescriptor] = {}
        full_uniform = [u for u in (self.decode_query_len, None)
                        if self.runtime_mode(u) == CUDAGraphMode.FULL]
        if self.mode.mixed_mode() == CUDAGraphMode.PIECEWISE:
            for size in reversed(self.sizes):
                # NOTE: piecewise graphs depend on the token count only; one pad row
                # keeps the eager attention between pieces well-formed.
                desc = BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, 0, 1, 0, size)
                out[(desc.mode, size)] = desc
        for uniform in full_uniform:
            for size in reversed(self.sizes):
                # NOTE: a uniform graph's descriptor keeps its query length (0 requests x
                # uniform = 0 tokens holds), so its metadata is decode-shaped.
                desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 0,
                                                self.full_graph_rows(size, uniform), 0, size,
                                                uniform)
                out[self.full_graph_key(desc)] = desc
        return list(out.values())

    def full_graph_key(self, desc: BatchExecutionDescriptor) -> tuple[int, int, bool]:
        """(tokens, rows, uniform decode?): a uniform graph is captured with decode-shaped
        metadata (max_query_len 1 or 1 + k), so a mixed batch never replays it."""
        return (desc.num_tokens_padded, desc.num_reqs_padded,
                self.is_uniform_decode(desc.uniform_query_len))
