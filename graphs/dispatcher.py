"""Dispatcher: (num_reqs, num_tokens, uniform_query_len) -> BatchExecutionDescriptor.

Graphs are keyed by their capture descriptor (``graph_key``): every row a pad, the padded
sizes, and the query length of a uniform decode graph. ``dispatch`` is a table lookup: it
returns a graph mode only for a key that is live (captured and checked); any other batch
runs eagerly.
"""

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
        self.live: set[BatchExecutionDescriptor] = set()   # graph keys a batch may replay
        # the dispatch table: (uniform decode?, padded size) -> the live graph key batches
        # of that slot replay (the policy's runtime mode for the slot); a missing slot is eager
        self._table: dict[tuple[bool, int], BatchExecutionDescriptor] = {}
        # NOTE: descriptors of uniform batches (every decode step) are checked once, when
        # first handed out, then handed out again: at most one per (num_reqs, query len)
        # within the ladder (times the DP sizes seen); cleared whenever the table changes
        self._handed: dict[tuple, BatchExecutionDescriptor] = {}
        # (uniform decode?, padded size) of the last batch that ran eagerly for want of a
        # graph the mode has for its slot (not live yet): GraphBuilder builds that one next
        self.missed: tuple[bool, int] | None = None

    def go_live(self, key: BatchExecutionDescriptor) -> None:
        """Batches of ``key``'s size replay its graph from the next dispatch on."""
        if key not in self.capture_descriptors():
            raise ValueError(f"{key} is not a graph key of this dispatcher")
        self.live.add(key)
        size = key.num_tokens_padded
        for uniform in (True, False):
            query_len = self.decode_query_len if uniform else None
            mode = self.runtime_mode(query_len)
            if mode != CUDAGraphMode.NONE and self._key(mode, size, query_len) == key:
                self._table[(uniform, size)] = key
        self._handed.clear()

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
        """The descriptor of the live graph the batch's slot holds, else eager (above the
        largest size, or not live yet: never a crash). ``num_tokens_across_dp``: under data
        parallel, the size every rank agreed to run (a ladder size, or eager padded to it)."""
        handed = self._handed.get((num_reqs, num_tokens, uniform_query_len,
                                  num_tokens_across_dp))
        if handed is not None:
            return handed
        if num_tokens_across_dp is None:
            i = bisect.bisect_left(self.sizes, num_tokens)
            size = self.sizes[i] if i < len(self.sizes) else None
        else:
            size = max(num_tokens_across_dp)
        uniform = uniform_query_len == self.decode_query_len
        key = self._table.get((uniform, size))
        if key is None:
            if size is not None and self.runtime_mode(uniform_query_len) != CUDAGraphMode.NONE:
                self.missed = (uniform, size)
            return BatchExecutionDescriptor.eager(num_reqs, num_tokens, uniform_query_len,
                                                  num_tokens_across_dp)
        rows = num_reqs if key.mode == CUDAGraphMode.PIECEWISE else key.num_reqs_padded
        desc = BatchExecutionDescriptor(key.mode, num_reqs, rows, num_tokens, size,
                                        uniform_query_len, num_tokens_across_dp)
        if uniform_query_len is not None:
            self._handed[(num_reqs, num_tokens, uniform_query_len, num_tokens_across_dp)] = desc
        return desc

    def graph_key(self, desc: BatchExecutionDescriptor) -> BatchExecutionDescriptor:
        """The capture descriptor whose graph ``desc`` replays."""
        key = self._table.get((desc.uniform_query_len == self.decode_query_len,
                               desc.num_tokens_padded))
        if key is None or key.mode != desc.mode:
            return self._key(desc.mode, desc.num_tokens_padded, desc.uniform_query_len)
        return key

    def _key(self, mode: CUDAGraphMode, size: int, uniform_query_len: int | None
             ) -> BatchExecutionDescriptor:
        if mode == CUDAGraphMode.PIECEWISE:
            # NOTE: piecewise graphs depend on the token count only; one pad row
            # keeps the eager attention between pieces well-formed.
            return BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, 0, 1, 0, size)
        # NOTE: a uniform graph's key keeps its query length (0 requests x uniform = 0
        # tokens holds), so its metadata is decode-shaped and a mixed batch of the same
        # size never replays it.
        uniform = uniform_query_len if self.is_uniform_decode(uniform_query_len) else None
        return BatchExecutionDescriptor(mode, 0, self.full_graph_rows(size, uniform), 0, size,
                                        uniform)

    def full_graph_rows(self, size: int, uniform_query_len: int | None) -> int:
        """Request rows a FULL graph of ``size`` tokens is captured with."""
        if self.is_uniform_decode(uniform_query_len):
            return size // self.decode_query_len
        return min(size, self.max_num_reqs)

    def capture_descriptors(self) -> list[BatchExecutionDescriptor]:
        """Every graph key to capture: PIECEWISE before FULL, largest size first.

        Capture batches hold no real request: every row is a pad.
        """
        keys: list[BatchExecutionDescriptor] = []
        if self.mode.mixed_mode() == CUDAGraphMode.PIECEWISE:
            keys += [self._key(CUDAGraphMode.PIECEWISE, s, None) for s in reversed(self.sizes)]
        for uniform in (self.decode_query_len, None):
            if self.runtime_mode(uniform) == CUDAGraphMode.FULL:
                keys += [self._key(CUDAGraphMode.FULL, s, uniform) for s in reversed(self.sizes)]
        return list(dict.fromkeys(keys))
