"""GraphManager: dispatch, capture every graph on the ladder, replay the right one."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import (
    ForwardContext,
    current_descriptor,
    forward_context,
    get_forward_context,
)
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.capture import CapturedGraph, make_capture_backend
from rung.graphs.compiler import compile_model
from rung.graphs.dispatcher import Dispatcher, downgrade
from rung.graphs.ladder import capture_sizes


@dataclasses.dataclass
class CaptureRecord:
    mode: str
    num_tokens_padded: int
    num_reqs_padded: int
    seconds: float
    nbytes: int
    num_kernel_nodes: int | None


class GraphManager:
    def __init__(self, runner: Any, mode: CUDAGraphMode, sizes: list[int],
                 decode_query_len: int, piece_compiler: str, graph_backend: str,
                 poison: bool) -> None:
        self.runner = runner
        mode = downgrade(mode, runner.backend.graph_support, runner.backend.name)
        self.dispatcher = Dispatcher(mode, sizes, runner.input_batch.max_num_reqs,
                                     decode_query_len)
        self._poison_gen = torch.Generator().manual_seed(1234)
        self.capture_backend = make_capture_backend(graph_backend, runner.device,
                                                    self._poison_pads if poison else None)
        self.compiled = (compile_model(runner.model, self, piece_compiler)
                         if mode.has_piecewise() else None)
        self.full_graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.capturing = False
        self.records: list[CaptureRecord] = []
        self.trace_seconds = 0.0      # one-time torch.compile tracing, not in any record
        self._traced_at: float | None = None
        self._piece_bytes = 0
        self._piece_nodes: int | None = None

    @classmethod
    def for_runner(cls, runner: Any, config: Any) -> "GraphManager":
        comp = config.compilation
        sizes = capture_sizes(comp.cudagraph_capture_sizes, config.max_num_seqs,
                              config.num_spec_tokens, config.max_num_batched_tokens,
                              comp.max_cudagraph_capture_size,
                              short=runner.device.type == "cpu")
        return cls(runner, comp.cudagraph_mode, sizes, 1 + config.num_spec_tokens,
                   comp.backend, comp.graph_backend, config.debug_padding)

    @property
    def mode(self) -> CUDAGraphMode:
        return self.dispatcher.mode

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_query_len: int | None,
                 num_tokens_across_dp: tuple[int, ...] | None = None
                 ) -> BatchExecutionDescriptor:
        return self.dispatcher.dispatch(num_reqs, num_tokens, uniform_query_len,
                                        num_tokens_across_dp)

    # --- capture --------------------------------------------------------------------------
    @property
    def num_graphs_to_capture(self) -> int:
        return len(self.dispatcher.capture_descriptors())

    def note_traced(self) -> None:
        """Called by the compile backend once torch.compile has traced and split the model."""
        self._traced_at = time.perf_counter()

    def capture_all(self, progress: Callable[[CaptureRecord], None] | None = None) -> None:
        with torch.inference_mode():
            for desc in self.dispatcher.capture_descriptors():
                record = self._capture(desc)
                self.records.append(record)
                if progress is not None:
                    progress(record)

    def _capture(self, desc: BatchExecutionDescriptor) -> CaptureRecord:
        start = time.perf_counter()
        self._traced_at = None
        ids, positions, ctx = self.runner.dummy_batch(desc)
        with forward_context(ctx):
            if desc.mode == CUDAGraphMode.PIECEWISE:
                self._piece_bytes, self._piece_nodes = 0, None
                self.capturing = True
                try:
                    self.compiled(ids, positions)
                finally:
                    self.capturing = False
                nbytes, nodes = self._piece_bytes, self._piece_nodes
            else:
                graph = self.capture_backend.capture(
                    self._full_forward, self._full_inputs(ids, positions, ctx))
                self.full_graphs[(desc.num_tokens_padded, desc.num_reqs_padded)] = graph
                nbytes, nodes = graph.nbytes, graph.num_kernel_nodes
        if self._traced_at is not None:
            # NOTE: tracing happens once (or on a recompile); charging it to the graph
            # that happened to trigger it would make that size look slow forever.
            self.trace_seconds += self._traced_at - start
            start = self._traced_at
        return CaptureRecord(desc.mode.name, desc.num_tokens_padded, desc.num_reqs_padded,
                             time.perf_counter() - start, nbytes, nodes)

    def _forward_fn(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        model = self.compiled if self.compiled is not None else self.runner.model
        return model(ids, positions)

    def note_piece(self, size: int, graph: CapturedGraph) -> None:
        self._piece_bytes += graph.nbytes
        if graph.num_kernel_nodes is not None:
            self._piece_nodes = (self._piece_nodes or 0) + graph.num_kernel_nodes

    def _full_forward(self, ids: torch.Tensor, positions: torch.Tensor, *metadata) -> Any:
        # NOTE: metadata tensors are passed only so replay checks their identity; the
        # attention ops read them through the forward context.
        return self._forward_fn(ids, positions)

    @staticmethod
    def _full_inputs(ids: torch.Tensor, positions: torch.Tensor,
                     ctx: ForwardContext) -> list[torch.Tensor]:
        tensors = [ids, positions]
        seen: set[int] = set()
        for meta in ctx.attn_metadata.values():
            common = getattr(meta, "common", meta)
            for t in (common.query_start_loc, common.seq_lens, common.block_table,
                      common.slot_mapping):
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)
        return tensors

    # --- replay ---------------------------------------------------------------------------
    def run(self, desc: BatchExecutionDescriptor, ids: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
        if desc.mode == CUDAGraphMode.FULL:
            graph = self.full_graphs[(desc.num_tokens_padded, desc.num_reqs_padded)]
            return graph.replay(self._full_inputs(ids, positions, get_forward_context()))
        return self._forward_fn(ids, positions)

    def _poison_pads(self) -> None:
        """Garbage into pad input rows before a replay: real outputs must not change."""
        desc = current_descriptor()
        if desc is None:
            return
        ib, t, t_pad = self.runner.input_batch, desc.num_tokens, desc.num_tokens_padded
        n = t_pad - t
        if n:
            ib.input_ids.gpu[t:t_pad] = torch.randint(0, self.runner.vocab_size, (n,),
                                                      generator=self._poison_gen)
            ib.positions.gpu[t:t_pad] = torch.randint(0, self.runner.max_model_len, (n,),
                                                      generator=self._poison_gen)
