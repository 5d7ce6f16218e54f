"""GraphManager: dispatch, capture every graph on the ladder, replay the right one.

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
    get_forward_context,
)
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.artifact_cache import prepare_inductor
from rung.graphs.backends import (
    make_capture_backend,
    resolve_graph_backend,
    without_cpu_pieces,
)
from rung.graphs.capture import CapturedGraph, CudaGraphBackend, ForwardOutput, Outputs
from rung.graphs.compiled import (
    MIN_DYNAMIC_SIZE,
    CompiledGraph,
    CompiledGraphBackend,
    compile_key,
    symbolic_dims,
)
from rung.graphs.compiled_draft import DraftRounds, capture_compiled_draft
from rung.graphs.compiler import compile_model
from rung.graphs.dispatcher import Dispatcher, downgrade
from rung.graphs.layer_artifacts import build_layer_artifacts, layer_specs
from rung.graphs.layered import LayeredGraph, capture_layers, rebind_layers
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
        self._full_replay_reads_context = poison or not isinstance(
            self.capture_backend, (CompiledGraphBackend, CudaGraphBackend))
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
        self._artifact_keys: dict[BatchExecutionDescriptor, tuple[str, ...]] = {}   # is_ready
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
        compile_s = load_s = artifact = None
        with torch.inference_mode():
            ids, positions, ctx = self.runner.dummy_batch(key, scratch=True)
            with forward_context(ctx):
                graph = self._full_graph(key, ctx, self._full_inputs(ids, positions, ctx),
                                         scratch=True, pause=pause)
            ids, positions, ctx = self.runner.input_views(key)
            inputs = self._full_inputs(ids, positions, ctx)
            with forward_context(ctx):
                if isinstance(graph, LayeredGraph):
                    graph = rebind_layers(graph, inputs, ctx)
                elif isinstance(graph, CompiledGraph):
                    graph = self.capture_backend.rebind(graph, inputs,
                                                        self._named_tensors(inputs))
                else:
                    graph = graph.rebind(inputs)
        if isinstance(graph, (LayeredGraph, CompiledGraph)):
            compile_s, load_s, artifact = graph.compile_s, graph.load_s, graph.artifact_key
        record = CaptureRecord(key.mode.name, key.num_tokens_padded, key.num_reqs_padded,
                               time.perf_counter() - start, graph.nbytes,
                               graph.num_kernel_nodes, compile_s=compile_s, load_s=load_s,
                               artifact=artifact)
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
        if key.mode != CUDAGraphMode.FULL or not isinstance(self.capture_backend,
                                                            CompiledGraphBackend):
            return True
        if key not in self._artifact_keys:
            self._artifact_keys[key] = self._artifact_keys_of(key)
        return all(map(self.capture_backend.has_artifact, self._artifact_keys[key]))

    def prepared(self, key: BatchExecutionDescriptor) -> bool:
        """Whether capturing ``key`` (``is_ready``) now imports nothing on this thread: a
        FULL compiled CPU graph whose artifacts load without inductor, anything once
        inductor is prepared in a thread, started at the first ask (``prepare_inductor``)."""
        backend = self.capture_backend
        if not isinstance(backend, CompiledGraphBackend):
            return True
        keys = self._artifact_keys.get(key)
        if keys is not None and all(map(backend.loads_without_inductor, keys)):
            return True
        return prepare_inductor().is_set()

    def _artifact_keys_of(self, desc: BatchExecutionDescriptor) -> tuple[str, ...]:
        """Keys of the artifacts the compiled graph of ``desc`` is built from."""
        parts = self._decoder_parts()
        if parts is None:
            return (self._compiled_spec(desc)[-1],)
        # NOTE: on the scratch batch: a worker thread asks while steps run
        ids, positions, ctx = self.runner.dummy_batch(desc, scratch=True)
        symbolic = self.symbolic_batch and (self._symbolic(desc)
                                            or self.runner.max_num_reqs >= MIN_DYNAMIC_SIZE)
        with torch.no_grad():
            specs = layer_specs(self.capture_backend, parts, ctx, ids, positions,
                                compile_key(desc, ctx, symbolic), symbolic)
        return tuple(dict.fromkeys(spec[-1] for spec in specs))

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
                graph = self._full_graph(desc, ctx, self._full_inputs(ids, positions, ctx))
                if isinstance(self.capture_backend, CompiledGraphBackend):
                    compiled_s, load_s = graph.compile_s, graph.load_s
                    artifact = graph.artifact_key
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

    def _full_graph(self, desc: BatchExecutionDescriptor, ctx: ForwardContext,
                    inputs: list[torch.Tensor], scratch: bool = False,
                    pause: Callable[[], None] | None = None) -> CapturedGraph:
        """The FULL graph of ``desc`` on ``inputs`` (in ``ctx``, entered); ``scratch``:
        built off the serving thread (``build``, with its ``pause``)."""
        if isinstance(self.capture_backend, CompiledGraphBackend):
            return self._capture_compiled(desc, ctx, inputs, scratch, pause)
        return self.capture_backend.capture(self._full_forward, inputs)

    def _capture_compiled(self, desc: BatchExecutionDescriptor, ctx: ForwardContext,
                          inputs: list[torch.Tensor], scratch: bool = False,
                          pause: Callable[[], None] | None = None) -> CapturedGraph:
        parts = self._decoder_parts()
        if parts is None:
            return self.capture_backend.capture_model(
                self._model_forward, inputs, *self._compiled_spec(desc, ctx, inputs))
        built_s = 0.0 if self._symbolic(desc) else self._symbolic_from_two_rows(desc, scratch)
        symbolic = built_s is not None
        for batch in dict.fromkeys((symbolic, False)):
            graph = capture_layers(self.capture_backend, inputs, parts,
                                   ctx, compile_key(desc, ctx, batch), batch,
                                   off_thread=scratch, pause=pause)
            if graph is not None:
                if built_s:            # compiled on two rows just now: this graph's cost
                    graph.compile_s = built_s + (graph.compile_s or graph.load_s or 0.0)
                    graph.load_s = None
                return graph
        raise RuntimeError(f"no per-layer compiled graph of {desc.num_tokens_padded} tokens "
                           "reproduces eager; compilation_config={'per_layer_graphs': "
                           "False} compiles the whole forward instead")

    def _symbolic_from_two_rows(self, desc: BatchExecutionDescriptor,
                                scratch: bool = False) -> float | None:
        """A one-row graph binds the symbolic per-layer artifacts (one compile for every
        size, and a replay as fast as a static artifact's: docs/performance.md), built
        first on a capture batch of two rows
        if need be (a trace of one row would specialise the batch dimension): the seconds
        that compile took. None when the batch is never two rows: a static artifact then."""
        if not self.symbolic_batch or self.runner.max_num_reqs < MIN_DYNAMIC_SIZE:
            return None
        compile_s = 0.0
        if not self.is_ready(desc):
            rows = dataclasses.replace(desc, num_reqs_padded=MIN_DYNAMIC_SIZE,
                                       num_tokens_padded=MIN_DYNAMIC_SIZE * desc.num_tokens_padded
                                       // desc.num_reqs_padded)
            ids, positions, ctx = self.runner.dummy_batch(rows, scratch)
            with forward_context(ctx):
                specs = layer_specs(self.capture_backend, self._decoder_parts(), ctx, ids,
                                    positions, compile_key(rows, ctx, True), True)
                compile_s = build_layer_artifacts(self.capture_backend, specs)
            self.runner.dummy_batch(desc, scratch)   # NOTE: back to the one-row batch's pads
        return compile_s

    def _decoder_parts(self) -> Any:
        """The model's forward in pieces, when it has them and graphs are built per layer."""
        parts = getattr(self.runner.model, "decoder_parts", None)
        return parts() if parts is not None and self.per_layer else None

    def _symbolic(self, desc: BatchExecutionDescriptor) -> bool:
        """Whether ``desc``'s compiled graph shares a symbolic-batch artifact."""
        return self.symbolic_batch and desc.num_reqs_padded >= MIN_DYNAMIC_SIZE

    def _compiled_spec(self, desc: BatchExecutionDescriptor, ctx: ForwardContext | None = None,
                       inputs: list[torch.Tensor] | None = None) -> tuple:
        """(named tensors, symbolic dims, graph key, artifact key) of the compiled graph of
        ``desc``; without ``ctx``, on a capture batch of its own."""
        if ctx is None:
            ids, positions, ctx = self.runner.dummy_batch(desc, scratch=True)
            inputs = self._full_inputs(ids, positions, ctx)
        named = self._named_tensors(inputs)
        batch = self._symbolic(desc)
        dynamic, graph_key = symbolic_dims(named, ctx, batch), compile_key(desc, ctx, batch)
        return named, dynamic, graph_key, self.capture_backend.key(named, dynamic, graph_key)

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
                      rounds: DraftRounds | None = None) -> CaptureRecord:
        """Capture ``fn(*inputs)`` as the FULL graph ``name`` of ``desc``'s size (a drafter's
        rounds), in the target's capture backend and memory pool; the caller has entered the
        forward context. ``poison`` garbles the pad rows of the batch ``inputs`` view.

        Compiled CPU graphs build it from ``rounds``' artifact of one round, called once per
        round (``graphs.compiled_draft``); without ``rounds`` it is emulated there (a replay
        re-runs ``fn``)."""
        start = time.perf_counter()
        self._poisoners[name] = poison
        compile_s = load_s = artifact = None
        with torch.inference_mode():
            if isinstance(self.capture_backend, CompiledGraphBackend) and rounds is not None:
                symbolic = self.symbolic_batch and self.runner.max_num_reqs >= MIN_DYNAMIC_SIZE
                graph = capture_compiled_draft(
                    self.capture_backend, desc, fn, inputs, get_forward_context(),
                    self._named_tensors([]), rounds, f"{name}.", symbolic)
                compile_s, load_s, artifact = graph.compile_s, graph.load_s, graph.artifact_key
            else:
                graph = self.capture_backend.capture(fn, inputs)
        self.full_graphs[(name, desc)] = graph
        record = CaptureRecord(f"{name.upper()}_FULL", desc.num_tokens_padded,
                               desc.num_reqs_padded, time.perf_counter() - start,
                               graph.nbytes, graph.num_kernel_nodes, name,
                               compile_s=compile_s, load_s=load_s, artifact=artifact)
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

    def _full_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                      *metadata: torch.Tensor) -> torch.Tensor:
        # NOTE: metadata tensors are passed only so replay checks their identity; the
        # attention ops read them through the forward context.
        if self._full_through_compiled:
            return self.compiled(ids, positions)
        return self.runner.model(ids, positions)

    def _model_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                       *metadata: torch.Tensor) -> torch.Tensor:
        """The model's own forward, for backends that trace it whole (compiled CPU graphs)."""
        return self.runner.model(ids, positions)

    def _named_tensors(self, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor a traced forward may read, by a name stable across processes."""
        named = {f"input.{i}": t for i, t in enumerate(inputs)}
        named.update({f"kv.{n}": t for n, t in getattr(self.runner, "kv_caches", {}).items()})
        model = self.runner.model
        named.update({f"param.{n}": p for n, p in model.named_parameters()})
        named.update({f"buffer.{n}": b for n, b in model.named_buffers()})
        return named

    @staticmethod
    def _full_inputs(ids: torch.Tensor, positions: torch.Tensor,
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
            inputs = self._full_inputs(ids, positions, ctx)
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

