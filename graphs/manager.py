"""GraphManager: dispatch, capture every graph on the ladder, replay the right one, through
its capture backend's interface (graphs/capture.py: `CaptureBackend`), whichever it is.

A FULL CPU graph (compiled or emulated) can also be built off the serving thread
(``build``: loaded or compiled, checked against eager on a scratch capture batch, then
bound to the serving input buffers), and swapped into the dispatch table between two
steps (``go_live``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import (
    ForwardContext,
    current_descriptor,
    forward_context,
)
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.backends import (
    make_capture_backend,
    resolve_graph_backend,
    without_cpu_pieces,
)
from rung.graphs.capture import CapturedGraph, ForwardOutput, Outputs
from rung.graphs.dispatcher import Dispatcher, downgrade
from rung.graphs.piecewise import compile_model
from rung.kernels.backend import AttentionBackend

logger = logging.getLogger(__name__)

# (descriptor of the replay, generator) -> garbage into the pad input rows of one batch
PadPoisoner = Callable[[BatchExecutionDescriptor, torch.Generator], None]
TARGET = "target"            # the target model's graphs; a drafter's go by its own name


class GraphRunner(Protocol):
    """What a GraphManager needs of the model runner it captures for (runtime's
    ModelRunner); the graph machinery sees the model only as an ``nn.Module``."""

    model: nn.Module
    backend: type[AttentionBackend]
    device: torch.device
    max_num_reqs: int

    def dummy_batch(self, desc: BatchExecutionDescriptor, scratch: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Inputs of a capture batch of ``desc``: every row a pad; ``scratch``: in input
        buffers no step reads or writes."""

    def input_views(self, desc: BatchExecutionDescriptor
                    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """The serving input buffers as a FULL step of ``desc`` hands them to its graph,
        made without writing them."""

    def poison_pads(self, desc: BatchExecutionDescriptor, generator: torch.Generator) -> None:
        """Garbage into the pad rows of the target's input buffers."""


@dataclasses.dataclass
class CaptureRecord:
    mode: str                     # PIECEWISE, FULL, or DRAFT_FULL for a drafter's graph
    num_tokens_padded: int
    num_reqs_padded: int
    seconds: float
    nbytes: int
    num_kernel_nodes: int | None
    graph: str = TARGET           # whose graph: TARGET, or the drafter's name
    compile_s: float | None = None   # compiled CPU graphs: trace + compile seconds
    load_s: float | None = None      # compiled CPU graphs: seconds to bind a built artifact
    artifact: str | None = None      # compiled CPU graphs: key of the artifact (sizes share)


@dataclasses.dataclass
class ReadyGraph:
    """A FULL graph built and checked off the serving thread (``GraphManager.build``),
    bound to the serving input buffers: going live is a swap (``GraphManager.go_live``)."""

    key: BatchExecutionDescriptor     # its graph key (capture descriptor)
    graph: CapturedGraph
    record: CaptureRecord


class GraphManager:
    def __init__(self, runner: GraphRunner, mode: CUDAGraphMode, sizes: list[int],
                 decode_query_len: int, piece_compiler: str, graph_backend: str,
                 poison: bool, artifact_cache: Any = None,
                 compile_threads: int | None = None) -> None:
        self.runner = runner
        mode = downgrade(mode, runner.backend.graph_support, runner.backend.name)
        if (mode.has_piecewise() and piece_compiler == "eager"
                and resolve_graph_backend(graph_backend, runner.device) == "compiled"):
            mode = without_cpu_pieces(mode)
        self.dispatcher = Dispatcher(mode, sizes, runner.max_num_reqs, decode_query_len)
        # a FULL step's descriptor -> the key of the graph it replays: a pure function of
        # the descriptor (`Dispatcher.graph_key`), kept so a replay asks the dispatcher once
        # per distinct batch shape (bounded by the ladder's sizes and max_num_seqs)
        self._replay_keys: dict[BatchExecutionDescriptor, BatchExecutionDescriptor] = {}
        self._poison_gen = torch.Generator().manual_seed(1234)
        self.capture_backend = make_capture_backend(graph_backend, runner.device,
                                                    self._poison_pads if poison else None,
                                                    artifact_cache, compile_threads)
        self.compiled = (compile_model(runner.model, self, piece_compiler)
                         if mode.has_piecewise() else None)
        # NOTE: a FULL capture runs the torch.compile wrapper only when it brings compiled
        # pieces (inductor); with eager pieces it would only add dynamo's trace of the whole
        # model (and a retrace once size 1 specialises) to the first FULL captures
        self._full_through_compiled = self.compiled is not None and piece_compiler == "inductor"
        # NOTE: a CUDA or compiled FULL replay runs captured kernels on the inputs it was
        # captured with and reads no forward context; an emulated one re-runs the forward,
        # and the debug poison hook reads the replay's descriptor from the context
        self._full_replay_reads_context = poison or self.capture_backend.replay_reads_context
        # (TARGET or a drafter's name, graph key: the capture descriptor) -> FULL graph
        self.full_graphs: dict[tuple[str, BatchExecutionDescriptor], CapturedGraph] = {}
        self.capturing = False
        # compiled CPU graphs: one artifact with a symbolic batch serves every size of >= 2
        # request rows; size 1 too with per-layer artifacts (traced on two rows), a static
        # artifact of its own with the whole forward in one
        self.symbolic_batch = True
        # compiled CPU graphs of a model with ``decoder_parts()``: one artifact per decoder
        # layer kind, called once per layer (False: the whole forward in one artifact)
        self.per_layer = True
        self.records: list[CaptureRecord] = []
        self.trace_seconds = 0.0      # one-time torch.compile tracing, not in any record
        self._traced_at: float | None = None
        self.num_traces = 0           # torch.compile traces of the model (note_traced)
        self._in_capture = False
        self._piece_bytes = 0
        self._piece_nodes: int | None = None
        # NOTE: an emulated replay poisons the pads of the batch its graph reads: the
        # target's input batch, or the draft batch during a drafter's replay.
        self._poisoners: dict[str, PadPoisoner] = {TARGET: runner.poison_pads}
        self._replaying = TARGET

    @property
    def mode(self) -> CUDAGraphMode:
        return self.dispatcher.mode

    @property
    def pool_bytes(self) -> int:
        """What the capture pool holds for every graph captured so far (target and draft)."""
        return self.capture_backend.pool_bytes

    # --- capture --------------------------------------------------------------------------
    @property
    def num_graphs_to_capture(self) -> int:
        return len(self.dispatcher.capture_descriptors())

    def note_traced(self) -> None:
        """Called by the compile backend once torch.compile has traced and split the model.

        NOTE: recompile_limit is raised for the many engines of one process (compile_model),
        so a recompile during serving would pass silently: a trace outside a capture is
        one, and says so."""
        self._traced_at = time.perf_counter()
        self.num_traces += 1
        if not self._in_capture:
            logger.warning("torch.compile traced the model during a step (trace %d): a "
                           "recompile; its PIECEWISE graphs run eagerly from now on "
                           "(TORCH_LOGS=recompiles says which guard failed)", self.num_traces)

    def capture_all(self, progress: Callable[[CaptureRecord], None] | None = None) -> None:
        for key in self.dispatcher.capture_descriptors():
            record = self.capture(key)
            if progress is not None:
                progress(record)

    @property
    def builds_off_thread(self) -> bool:
        """Whether FULL graphs may be built on a worker thread while steps run (``build``):
        CPU graphs, compiled or emulated, of a mode without PIECEWISE pieces (their
        torch.compile wrapper traces the model at its first call). A CUDA capture stays
        on the serving thread, ordered with the serving stream."""
        return self.compiled is None and not self.capture_backend.serving_thread_captures

    def build(self, key: BatchExecutionDescriptor,
              pause: Callable[[], None] | None = None) -> ReadyGraph:
        """The FULL graph of ``key``: loaded (or compiled) and checked against eager on a
        scratch capture batch of its own, then bound to the serving input buffers.

        NOTE: it writes no tensor a step reads or writes: its input buffers are the
        runner's scratch batch; weights are read-only; a capture batch is all pads (seq_len
        0, PAD_SLOT_ID slots), so its attention reads no KV entry and writes none a request
        owns; the forward context is per thread. So it runs on a worker thread while steps
        run, and a check that fails leaves nothing live. ``pause``: called between the
        layers of a per-layer graph's check (the builder's throttle)."""
        if key.mode != CUDAGraphMode.FULL or not self.builds_off_thread:
            raise ValueError(f"build({key.mode.name} key) with {self.capture_backend.name} "
                             "graphs: only FULL CPU graphs are built off the serving thread")
        start = time.perf_counter()
        with torch.inference_mode():
            ids, positions, ctx = self.runner.dummy_batch(key, scratch=True)
            with forward_context(ctx):
                graph = self.capture_backend.capture_full(
                    self, key, ctx, self.full_inputs(ids, positions, ctx), scratch=True,
                    pause=pause)
            ids, positions, ctx = self.runner.input_views(key)
            with forward_context(ctx):
                graph = self.capture_backend.rebind_full(
                    self, graph, self.full_inputs(ids, positions, ctx), ctx)
        record = CaptureRecord(key.mode.name, key.num_tokens_padded, key.num_reqs_padded,
                               time.perf_counter() - start, graph.nbytes,
                               graph.num_kernel_nodes, compile_s=graph.compile_s,
                               load_s=graph.load_s, artifact=graph.artifact_key)
        return ReadyGraph(key, graph, record)

    def go_live(self, ready: ReadyGraph) -> None:
        """Batches of ``ready.key``'s size replay its graph from the next dispatch on: a
        swap into the dispatch table (the serving thread, between steps)."""
        self.full_graphs[(TARGET, ready.key)] = ready.graph
        self.records.append(ready.record)
        self.dispatcher.go_live(ready.key)

    def capture(self, key: BatchExecutionDescriptor) -> CaptureRecord:
        """Capture (or compile, or load) the graph of ``key`` and make it live; on the
        serving thread, between steps (it writes the runner's input buffers)."""
        self._in_capture = True
        try:
            with torch.inference_mode():
                record = self._capture(key)
        finally:
            self._in_capture = False
        self.records.append(record)
        self.dispatcher.go_live(key)
        return record

    def is_ready(self, key: BatchExecutionDescriptor) -> bool:
        """Whether capturing ``key`` now costs no compile (always, but for compiled CPU
        graphs whose artifact is neither built in this process nor in the disk cache)."""
        return self.capture_backend.is_ready(self, key)

    def prepared(self, key: BatchExecutionDescriptor) -> bool:
        """Whether capturing ``key`` (``is_ready``) now imports nothing on this thread
        (compiled CPU graphs: inductor)."""
        return self.capture_backend.prepared(self, key)

    def _capture(self, desc: BatchExecutionDescriptor) -> CaptureRecord:
        start = time.perf_counter()
        self._traced_at = None
        compiled_s = load_s = artifact = None
        ids, positions, ctx = self.runner.dummy_batch(desc)
        with forward_context(ctx), self.capture_backend.capture_batch() as batch:
            if desc.mode == CUDAGraphMode.PIECEWISE:
                self._piece_bytes, self._piece_nodes = 0, None
                self.capturing = True
                try:
                    self.compiled(ids, positions)
                finally:
                    self.capturing = False
                nbytes, nodes = self._piece_bytes, self._piece_nodes
            else:
                graph = self.capture_backend.capture_full(
                    self, desc, ctx, self.full_inputs(ids, positions, ctx))
                compiled_s, load_s, artifact = graph.compile_s, graph.load_s, graph.artifact_key
                self.full_graphs[(TARGET, desc)] = graph
                nbytes, nodes = graph.nbytes, graph.num_kernel_nodes
        if batch.nbytes is not None:          # CUDA: what the key's captures added
            nbytes = batch.nbytes
        if self._traced_at is not None:
            # NOTE: tracing happens once (or on a recompile); charging it to the graph
            # that happened to trigger it would make that size look slow forever.
            self.trace_seconds += self._traced_at - start
            start = self._traced_at
        return CaptureRecord(desc.mode.name, desc.num_tokens_padded, desc.num_reqs_padded,
                             time.perf_counter() - start, nbytes, nodes,
                             compile_s=compiled_s, load_s=load_s, artifact=artifact)

    def _forward_fn(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        model = self.compiled if self.compiled is not None else self.runner.model
        return model(ids, positions)

    def capture_piece(self, fn: Callable[..., Any], args: tuple) -> CapturedGraph:
        """One PIECEWISE piece (called by the piece itself during a PIECEWISE capture)."""
        graph = self.capture_backend.capture(fn, args)
        self._piece_bytes += graph.nbytes
        if graph.num_kernel_nodes is not None:
            self._piece_nodes = (self._piece_nodes or 0) + graph.num_kernel_nodes
        return graph

    def capture_graph(self, name: str, desc: BatchExecutionDescriptor,
                      fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor],
                      poison: PadPoisoner,
                      progress: Callable[[CaptureRecord], None] | None = None,
                      rounds: Any = None) -> CaptureRecord:
        """Capture ``fn(*inputs)`` as the FULL graph ``name`` of ``desc``'s size (a drafter's
        rounds), in the target's capture backend and memory pool; the caller has entered the
        forward context. ``poison`` garbles the pad rows of the batch ``inputs`` view.

        A backend that compiles builds it from ``rounds`` (one draft round's forward, its
        artifact called once per round); otherwise, and without ``rounds``, ``fn`` itself
        is captured."""
        start = time.perf_counter()
        self._poisoners[name] = poison
        with torch.inference_mode():
            graph = self.capture_backend.capture_draft(self, desc, fn, inputs, rounds,
                                                       f"{name}.")
        self.full_graphs[(name, desc)] = graph
        record = CaptureRecord(f"{name.upper()}_FULL", desc.num_tokens_padded,
                               desc.num_reqs_padded, time.perf_counter() - start,
                               graph.nbytes, graph.num_kernel_nodes, name,
                               compile_s=graph.compile_s, load_s=graph.load_s,
                               artifact=graph.artifact_key)
        self.records.append(record)
        if progress is not None:
            progress(record)
        return record

    def replay(self, name: str, key: BatchExecutionDescriptor,
               inputs: Sequence[torch.Tensor]) -> Outputs:
        """Replay the FULL graph ``name`` captured for ``key`` (the graph key its dispatcher
        gave the batch)."""
        graph = self.full_graphs[(name, key)]
        self._replaying = name
        try:
            return graph.replay(inputs)
        finally:
            self._replaying = TARGET

    def full_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                      *metadata: torch.Tensor) -> torch.Tensor:
        # NOTE: metadata tensors are passed only so replay checks their identity; the
        # attention ops read them through the forward context.
        if self._full_through_compiled:
            return self.compiled(ids, positions)
        return self.runner.model(ids, positions)

    def model_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                       *metadata: torch.Tensor) -> torch.Tensor:
        """The model's own forward, for backends that trace it whole (compiled CPU graphs)."""
        return self.runner.model(ids, positions)

    def named_tensors(self, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor a traced forward may read, by a name stable across processes."""
        named = {f"input.{i}": t for i, t in enumerate(inputs)}
        named.update({f"kv.{n}": t for n, t in getattr(self.runner, "kv_caches", {}).items()})
        model = self.runner.model
        named.update({f"param.{n}": p for n, p in model.named_parameters()})
        named.update({f"buffer.{n}": b for n, b in model.named_buffers()})
        return named

    @staticmethod
    def full_inputs(ids: torch.Tensor, positions: torch.Tensor,
                     ctx: ForwardContext) -> list[torch.Tensor]:
        tensors = [ids, positions]
        for common in ctx.commons:          # NOTE: one per KV cache group, in group order
            tensors += [common.query_start_loc, common.seq_lens, common.block_table,
                        common.slot_mapping]
        return tensors

    # --- replay ---------------------------------------------------------------------------
    def run(self, desc: BatchExecutionDescriptor, ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext, rows: torch.Tensor) -> ForwardOutput:
        """The forward of ``desc`` (dispatched by ``dispatcher``), in ``ctx`` (entered here
        for what reads it): hidden states, and the logits of hidden[rows] where a FULL
        graph computes them (``CapturedGraph.forward``)."""
        if desc.mode == CUDAGraphMode.FULL:
            key = self._replay_keys.get(desc)
            if key is None:
                key = self._replay_keys[desc] = self.dispatcher.graph_key(desc)
            graph = self.full_graphs[(TARGET, key)]
            # NOTE: a target replay: _replaying is TARGET outside a drafter's replay
            inputs = self.full_inputs(ids, positions, ctx)
            if not self._full_replay_reads_context:
                return graph.forward(inputs, rows)
            with forward_context(ctx):
                return graph.forward(inputs, rows)
        with forward_context(ctx):
            if desc.mode == CUDAGraphMode.NONE:
                # NOTE: the model itself, not the torch.compile wrapper of the pieces: its
                # first call traces the whole model, which must not delay an eager step
                # (background start-up serves eagerly before any graph is live)
                return ForwardOutput(self.runner.model(ids, positions), None)
            return ForwardOutput(self._forward_fn(ids, positions), None)

    def _poison_pads(self) -> None:
        """Garbage into pad input rows before a replay: real outputs must not change."""
        desc = current_descriptor()
        if desc is not None:
            self._poisoners[self._replaying](desc, self._poison_gen)

