"""The capture backend of compiled CPU graphs (`CompiledGraphBackend`): how the
GraphManager's FULL graphs are built from inductor artifacts (one per decoder-layer kind
with ``decoder_parts()``, else the whole forward; a drafter's from one draft round), bound
to the serving buffers, and whether building one now would compile or import inductor."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext, forward_context, get_forward_context
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.capture import CapturedGraph, GraphHost, Outputs
from rung.graphs.cpu_compiled.artifact_cache import prepare_inductor
from rung.graphs.cpu_compiled.artifacts import (
    MIN_DYNAMIC_SIZE,
    ArtifactCompiler,
    compile_key,
    symbolic_dims,
)
from rung.graphs.cpu_compiled.draft_rounds import DraftRounds, capture_compiled_draft
from rung.graphs.cpu_compiled.layer_specs import build_layer_artifacts, layer_specs
from rung.graphs.cpu_compiled.per_layer import LayeredGraph, capture_layers, rebind_layers


class CompiledGraphBackend(ArtifactCompiler):
    """`CaptureBackend` of compiled CPU graphs. A replay runs compiled code on the inputs it
    was traced with and reads no forward context."""

    replay_reads_context = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._artifact_keys: dict[BatchExecutionDescriptor, tuple[str, ...]] = {}

    # --- the target's FULL graphs -------------------------------------------------------
    def capture_full(self, host: GraphHost, desc: BatchExecutionDescriptor,
                     ctx: ForwardContext, inputs: list[torch.Tensor], scratch: bool = False,
                     pause: Callable[[], None] | None = None) -> CapturedGraph:
        parts = _decoder_parts(host)
        if parts is None:
            return self.capture_model(host.model_forward, inputs,
                                      *self._compiled_spec(host, desc, ctx, inputs))
        built_s = (0.0 if _symbolic(host, desc)
                   else self._symbolic_from_two_rows(host, desc, scratch))
        symbolic = built_s is not None
        for batch in dict.fromkeys((symbolic, False)):
            graph = capture_layers(self, inputs, parts, ctx, compile_key(desc, ctx, batch),
                                   batch, off_thread=scratch, pause=pause)
            if graph is not None:
                if built_s:            # compiled on two rows just now: this graph's cost
                    graph.compile_s = built_s + (graph.compile_s or graph.load_s or 0.0)
                    graph.load_s = None
                return graph
        raise RuntimeError(f"no per-layer compiled graph of {desc.num_tokens_padded} tokens "
                           "reproduces eager; compilation_config={'per_layer_graphs': "
                           "False} compiles the whole forward instead")

    def rebind_full(self, host: GraphHost, graph: CapturedGraph, inputs: list[torch.Tensor],
                    ctx: ForwardContext) -> CapturedGraph:
        if isinstance(graph, LayeredGraph):
            return rebind_layers(graph, inputs, ctx)
        return self.rebind(graph, inputs, host.named_tensors(inputs))

    def capture_draft(self, host: GraphHost, desc: BatchExecutionDescriptor,
                      fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor],
                      rounds: DraftRounds | None, prefix: str) -> CapturedGraph:
        """Built from ``rounds``' artifact of one round, called once per round
        (``draft_rounds``); without ``rounds``, emulated (a replay re-runs ``fn``)."""
        if rounds is None:
            return self.capture(fn, inputs)
        symbolic = host.symbolic_batch and host.runner.max_num_reqs >= MIN_DYNAMIC_SIZE
        return capture_compiled_draft(self, desc, fn, inputs, get_forward_context(),
                                      host.named_tensors([]), rounds, prefix, symbolic)

    # --- whether a build would compile -------------------------------------------------
    def is_ready(self, host: GraphHost, key: BatchExecutionDescriptor) -> bool:
        """A FULL graph whose artifacts are built in this process or in the disk cache."""
        if key.mode != CUDAGraphMode.FULL:
            return True
        if key not in self._artifact_keys:
            self._artifact_keys[key] = self._artifact_keys_of(host, key)
        return all(map(self.has_artifact, self._artifact_keys[key]))

    def prepared(self, host: GraphHost, key: BatchExecutionDescriptor) -> bool:
        """A FULL graph whose artifacts load without inductor, anything once inductor is
        prepared in a thread, started at the first ask (``prepare_inductor``)."""
        keys = self._artifact_keys.get(key)
        if keys is not None and all(map(self.loads_without_inductor, keys)):
            return True
        return prepare_inductor().is_set()

    def _artifact_keys_of(self, host: GraphHost, desc: BatchExecutionDescriptor
                          ) -> tuple[str, ...]:
        """Keys of the artifacts the compiled graph of ``desc`` is built from."""
        parts = _decoder_parts(host)
        if parts is None:
            return (self._compiled_spec(host, desc)[-1],)
        # NOTE: on the scratch batch: a worker thread asks while steps run
        ids, positions, ctx = host.runner.dummy_batch(desc, scratch=True)
        symbolic = host.symbolic_batch and (_symbolic(host, desc)
                                            or host.runner.max_num_reqs >= MIN_DYNAMIC_SIZE)
        with torch.no_grad():
            specs = layer_specs(self, parts, ctx, ids, positions,
                                compile_key(desc, ctx, symbolic), symbolic)
        return tuple(dict.fromkeys(spec[-1] for spec in specs))

    def _symbolic_from_two_rows(self, host: GraphHost, desc: BatchExecutionDescriptor,
                                scratch: bool = False) -> float | None:
        """A one-row graph binds the symbolic per-layer artifacts (one compile for every
        size, and a replay as fast as a static artifact's: docs/performance.md), built
        first on a capture batch of two rows if need be (a trace of one row would
        specialise the batch dimension): the seconds that compile took. None when the
        batch is never two rows: a static artifact then."""
        if not host.symbolic_batch or host.runner.max_num_reqs < MIN_DYNAMIC_SIZE:
            return None
        compile_s = 0.0
        if not self.is_ready(host, desc):
            rows = dataclasses.replace(desc, num_reqs_padded=MIN_DYNAMIC_SIZE,
                                       num_tokens_padded=MIN_DYNAMIC_SIZE * desc.num_tokens_padded
                                       // desc.num_reqs_padded)
            ids, positions, ctx = host.runner.dummy_batch(rows, scratch)
            with forward_context(ctx):
                specs = layer_specs(self, _decoder_parts(host), ctx, ids, positions,
                                    compile_key(rows, ctx, True), True)
                compile_s = build_layer_artifacts(self, specs)
            host.runner.dummy_batch(desc, scratch)   # NOTE: back to the one-row batch's pads
        return compile_s

    def _compiled_spec(self, host: GraphHost, desc: BatchExecutionDescriptor,
                       ctx: ForwardContext | None = None,
                       inputs: list[torch.Tensor] | None = None) -> tuple:
        """(named tensors, symbolic dims, graph key, artifact key) of the compiled graph of
        ``desc``; without ``ctx``, on a capture batch of its own."""
        if ctx is None:
            ids, positions, ctx = host.runner.dummy_batch(desc, scratch=True)
            inputs = host.full_inputs(ids, positions, ctx)
        named = host.named_tensors(inputs)
        batch = _symbolic(host, desc)
        dynamic, graph_key = symbolic_dims(named, ctx, batch), compile_key(desc, ctx, batch)
        return named, dynamic, graph_key, self.key(named, dynamic, graph_key)


def _decoder_parts(host: GraphHost) -> Any:
    """The model's forward in pieces, when it has them and graphs are built per layer."""
    parts = getattr(host.runner.model, "decoder_parts", None)
    return parts() if parts is not None and host.per_layer else None


def _symbolic(host: GraphHost, desc: BatchExecutionDescriptor) -> bool:
    """Whether ``desc``'s compiled graph shares a symbolic-batch artifact."""
    return host.symbolic_batch and desc.num_reqs_padded >= MIN_DYNAMIC_SIZE
