"""Inductor artifacts of a forward (whole, or one decoder layer: ``per_layer``), what
compiled CPU graphs are made of: traced with attention inlined
(``ForwardContext.inline_attention``), compiled or loaded from the disk cache, and replayed
on the very tensors they were traced with (weights, KV caches, input buffer views): no
guard is evaluated, nothing is re-traced."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Sequence

import torch
from torch import fx

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext, get_forward_context
from rung.graphs.capture import ArtifactGraph, EmulatedGraphBackend, memory_identity
from rung.graphs.cpu_compiled.artifact_cache import (
    ArtifactCache,
    artifact_key,
    bind_inputs,
    input_names,
)
from rung.graphs.cpu_compiled.direct_call import DirectCall, direct_call, wrapper_library

logger = logging.getLogger(__name__)

# NOTE: the C++ wrapper calls a replay's kernels without Python in between (closer to the
# matmul floor at one request, docs/performance.md) at the price of a longer compile.
# Part of the artifact cache key.
INDUCTOR_OPTIONS: dict[str, Any] = {"config_patches": {"cpp_wrapper": True}}


def inductor_options(threads: int) -> dict[str, Any]:
    """INDUCTOR_OPTIONS generating CPU kernels for ``threads`` threads (inductor writes the
    count into each parallel loop: ``omp parallel num_threads(n)``), whoever compiles."""
    patches = {**INDUCTOR_OPTIONS.get("config_patches", {}), "cpp.threads": threads}
    return {**copy.deepcopy(INDUCTOR_OPTIONS), "config_patches": patches}


# A rounding flip moves one int8 input of a matmul by one step, 1/127 of its group's
# largest value (at most the group's norm): its output moves by about that fraction of its
# norm at most, far past an elementwise tolerance where outputs are large or near zero.
# Wrong inputs (a slot, a mask, a position) are off by the row's order of magnitude.
ROUNDED_ROW_RTOL = 1e-2


def rounds_activations(module: torch.nn.Module) -> bool:
    """Whether a matmul inside ``module`` rounds its input to int8 first (a module's
    ``rounds_activations``: GGUF weights on rung's CPU kernel)."""
    return any(getattr(m, "rounds_activations", False) is True for m in module.modules())


def reproduces_eager(got: torch.Tensor, want: torch.Tensor, rounded: bool) -> bool:
    """The capture check's verdict on an artifact's output ``got`` against eager's
    ``want``: elementwise (rtol 1e-3, atol 1e-4), or, where activations were ``rounded``
    to int8 on the way (eager and the artifact may round an input a step apart), each
    row's difference within ``ROUNDED_ROW_RTOL`` of the row's norm."""
    if not rounded:
        return torch.allclose(got, want, rtol=1e-3, atol=1e-4)
    diff = (got.float() - want.float()).reshape(-1, want.shape[-1]).norm(dim=-1)
    bound = ROUNDED_ROW_RTOL * want.float().reshape(-1, want.shape[-1]).norm(dim=-1) + 1e-4
    return bool((diff <= bound).all())


class CompiledGraph(ArtifactGraph):
    """An inductor artifact and the flat inputs it was traced with.

    Each block table is handed over cut to the blocks the batch's longest sequence
    covers, so attention reads the real context, not max_model_len. Every symbolic size
    (a table's width, a KV cache's block count) is itself an int input of the artifact,
    set from the size of the tensor it measures (``sizes``).
    """

    def __init__(self, artifact: Callable[..., Any], static_inputs: Sequence[torch.Tensor],
                 graph_inputs: list[torch.Tensor], sizes: dict[int, tuple[int, int]],
                 compile_s: float | None, load_s: float | None,
                 poison: Callable[[], None] | None = None) -> None:
        super().__init__(static_inputs, None, 0)
        self.artifact = artifact
        self.poison = poison         # debug mode: garbage into pad rows before each replay
        self.graph_inputs = graph_inputs   # weights, KV caches, input-buffer views: stable
        self.compile_s = compile_s   # seconds to trace + compile; None when loaded
        self.load_s = load_s         # seconds to load from the disk cache; None when compiled
        self.seq_lens_index, self.block_tables = _kv_width_inputs(graph_inputs)
        self.sizes = sizes           # int input index -> (tensor input index, its dim)
        self.artifact_key: str | None = None   # shared by every size traced symbolic

    def _run(self) -> torch.Tensor:
        args = list(self.graph_inputs)
        if self.block_tables:
            # NOTE: seq_lens lives in host memory on CPU: reading its max costs no sync
            max_seq_len = int(args[self.seq_lens_index].max())
            for index, block_size in self.block_tables:
                table = args[index]
                width = min(max(-(-max_seq_len // block_size), MIN_DYNAMIC_SIZE), table.shape[1])
                # NOTE: the artifact was traced on a contiguous table; a few hundred ints
                args[index] = table[:, :width].contiguous()
        for index, (tensor_index, dim) in self.sizes.items():
            args[index] = args[tensor_index].shape[dim]
        # NOTE: the hidden states come back in a fresh tensor per replay (inductor's output
        # buffer), not a static one; every caller reads them before the next replay.
        return self.artifact(*args)[0]


# NOTE: a dynamic dimension is compiled for sizes >= 2 (sizes 0 and 1 specialise), so a
# block table is never cut below 2 blocks.
MIN_DYNAMIC_SIZE = 2
# NOTE: an explicit bound (torch needs one); no block table or KV cache comes near it
MAX_DYNAMIC_SIZE = 1 << 20


def _kv_width_inputs(graph_inputs: list[torch.Tensor]
                     ) -> tuple[int | None, list[tuple[int, int]]]:
    """(index of a seq_lens, [(index of a block table, its block size)]) among the graph's
    inputs, matched with the current forward context's metadata by memory, not by object.

    NOTE: each KV cache group's metadata holds its own view of the shared seq_lens, and a
    graph loaded from disk gets one tensor per name: matching by ``id`` would miss the
    other groups' tables, which then stay uncut while the width says otherwise.
    """
    seq_lens, tables = set(), {}
    for meta in get_forward_context().attn_metadata.values():
        common = getattr(meta, "common", meta)
        seq_lens.add(memory_identity(common.seq_lens))
        tables[memory_identity(common.block_table)] = common.block_size
    seq_lens_index, found = None, []
    for i, t in enumerate(graph_inputs):
        if not isinstance(t, torch.Tensor):
            continue
        memory = memory_identity(t)
        if seq_lens_index is None and memory in seq_lens:
            seq_lens_index = i
        if memory in tables:
            found.append((i, tables[memory]))
    return seq_lens_index, found


def _mark_dynamic(named: dict[str, torch.Tensor], dynamic: dict[str, tuple[int, ...]],
                  ranges: dict[str, tuple[int, int]]) -> None:
    """Trace the ``dynamic`` dimensions of the named tensors as symbols (sizes >= 2); a
    dim 0 named in ``ranges`` with that range as the symbol's bounds.

    NOTE: leading (batch) dims are tied to each other (query_start_loc holds one more
    row than seq_lens, a verify batch 1 + k tokens per row), which a range given to each
    would contradict: they are marked without one, and a size the trace specialised
    anyway fails the check against eager at its capture.
    """
    for name, dims in dynamic.items():
        for dim in dims:
            if dim == 0 and name in ranges:
                torch._dynamo.mark_dynamic(named[name], dim, min=ranges[name][0],
                                           max=ranges[name][1])
            elif dim == 0:
                torch._dynamo.maybe_mark_dynamic(named[name], dim)
            else:
                torch._dynamo.mark_dynamic(named[name], dim, min=MIN_DYNAMIC_SIZE,
                                           max=MAX_DYNAMIC_SIZE)


class TracedGraph:
    """What dynamo hands a backend: the FX graph and its (real) flat inputs."""

    def __init__(self) -> None:
        self.gm: fx.GraphModule | None = None
        self.inputs: list[torch.Tensor] = []
        self.sizes: dict[int, tuple[int, int]] = {}   # see CompiledGraph.sizes

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        self.gm, self.inputs = gm, list(example_inputs)
        self.sizes = _size_inputs(gm)
        return gm.forward


def _size_inputs(gm: fx.GraphModule) -> dict[int, tuple[int, int]]:
    """int input index -> (index, dim) of the first tensor input that has that size."""
    placeholders = [n.meta.get("example_value") for n in gm.graph.nodes
                    if n.op == "placeholder"]
    dims: dict[Any, tuple[int, int]] = {}
    for i, value in enumerate(placeholders):
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (i, d))
    sizes = {}
    for i, value in enumerate(placeholders):
        if isinstance(value, torch.SymInt):
            if value.node.expr not in dims:
                raise RuntimeError(f"traced forward input {i} is a size no tensor input has")
            sizes[i] = dims[value.node.expr]
    return sizes


def trace_forward(fn: Callable[..., torch.Tensor], inputs: Sequence,
                  named: dict[str, torch.Tensor] | None = None,
                  dynamic: dict[str, tuple[int, ...]] | None = None,
                  ranges: dict[str, tuple[int, int]] | None = None) -> TracedGraph:
    """One dynamo trace of ``fn(*inputs)`` with attention inlined; runs it once.
    ``dynamic``: name (in ``named``) -> dimensions traced symbolic; ``ranges``: name ->
    the bounds of its dim 0's symbol."""
    traced = TracedGraph()
    # NOTE: every trace of one function (one per artifact, engines built in one process)
    # adds an entry to dynamo's cache of that code object; past its limit dynamo stops
    # calling the backend
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4096)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4096)
    ctx = get_forward_context()
    ctx.inline_attention = True
    _mark_dynamic(named or {}, dynamic or {}, ranges or {})
    try:
        torch.compile(fn, backend=traced, fullgraph=True, dynamic=False)(*inputs)
    finally:
        ctx.inline_attention = False
    if traced.gm is None:
        raise RuntimeError("dynamo produced no graph for the forward pass")
    return traced


def compile_traced(traced: TracedGraph, options: dict[str, Any]) -> Any:
    """An inductor artifact of a traced forward: static shapes but the dims traced symbolic,
    compiled with ``options`` (``inductor_options``)."""
    return torch._inductor.standalone_compile(traced.gm, traced.inputs,
                                              dynamic_shapes="from_graph",
                                              options=copy.deepcopy(options))


class ArtifactCompiler(EmulatedGraphBackend):
    """Inductor artifacts of FULL graphs: trace + compile at the capture's static shapes, or
    a load from the on-disk artifact cache when an entry with the same key exists; each
    bound to the tensors it replays on. `capture_backend.CompiledGraphBackend` builds graphs from
    them for the GraphManager.

    PIECEWISE pieces are captured as the emulated backend captures them (run as
    ``compilation_config.backend`` compiled them); a drafter's graphs are one artifact of a
    draft round, called once per round (``draft_rounds``). In debug mode every replay,
    compiled or not, first poisons the pad rows of its inputs, as emulated replays do.
    """

    name = "compiled"
    auto_startup = "background"      # a cold compile takes minutes: eager serves meanwhile

    def __init__(self, cache: ArtifactCache | None = None,
                 poison_hook: Callable[[], None] | None = None,
                 threads: int | None = None) -> None:
        super().__init__(poison_hook)
        self.cache = cache
        # threads the CPU kernels are generated for (in the key): the serving engine's
        self.threads = threads or torch.get_num_threads()
        self.options = inductor_options(self.threads)
        # key -> (artifact, or None when loaded as its wrapper library alone; input names)
        self.artifacts: dict[str, tuple[Any, list[str]]] = {}
        self.direct_calls: dict[str, DirectCall | None] = {}   # see direct_call

    def key(self, named: dict[str, torch.Tensor], dynamic: dict[str, tuple[int, ...]],
            graph_key: dict[str, Any]) -> str:
        base = self.cache.model_key if self.cache is not None else {}
        return artifact_key(base, {**graph_key, "options": self.options}, named, dynamic)

    def has_artifact(self, key: str) -> bool:
        """Built in this process, or in the disk cache (capture then binds, no compile)."""
        return key in self.artifacts or (self.cache is not None and self.cache.has(key))

    def capture_model(self, fn: Callable[..., torch.Tensor], inputs: Sequence,
                      named: dict[str, torch.Tensor], dynamic: dict[str, tuple[int, ...]],
                      graph_key: dict[str, Any], key: str | None = None) -> CompiledGraph:
        """``fn(*inputs)``: the model's whole forward, attention included. ``named``: every
        tensor the forward may read, by a stable name; ``dynamic``: name -> dims traced
        symbolic; ``graph_key``: what else the traced code depends on (sizes, metadata
        constants). An artifact is keyed on all three: sizes traced symbolic share one.

        NOTE: an artifact compiled earlier (this process, or the disk cache) is bound to
        this capture's tensors by name and must reproduce eager on the capture batch
        before it is used; one that does not is discarded and rebuilt.
        """
        key = key or self.key(named, dynamic, graph_key)
        start = time.perf_counter()
        known = self.artifacts.get(key)
        if known is None and self.cache is not None:
            known = self.cache.load(key, named)
        if known is not None:
            graph = self._bind(key, *known, fn, inputs, named)
            if graph is not None:
                self.artifacts[key] = known
                graph.load_s = time.perf_counter() - start
                return graph
        traced = trace_forward(fn, inputs, named, dynamic)
        artifact = compile_traced(traced, self.options)
        compile_s = time.perf_counter() - start
        logger.info("compiled a graph of %d inputs in %.1f s", len(traced.inputs), compile_s)
        names = input_names(traced.inputs, traced.sizes, named)
        if names is None:
            logger.warning("compiled graph reads a tensor rung cannot name; not shared")
        else:
            self.artifacts[key] = (artifact, names)
            if self.cache is not None:
                self.cache.save(key, artifact, names)
        graph = self._finish(CompiledGraph(artifact, inputs, traced.inputs, traced.sizes,
                                           compile_s, None, self.poison_hook))
        graph.artifact_key = key
        return graph

    def layer_artifact(self, key: str, fn: Callable[..., torch.Tensor], inputs: Sequence,
                       named: dict[str, torch.Tensor], dynamic: dict[str, tuple[int, ...]],
                       ranges: dict[str, tuple[int, int]] | None = None
                       ) -> tuple[Any, list[str], float | None]:
        """(artifact, its input names, compile seconds or None when it was built earlier)
        of ``fn(*inputs)`` (one decoder layer, or a per-layer graph's epilogue), keyed
        ``key``: from this process, the disk cache (its wrapper library alone when it has
        one: no inductor import), or traced and compiled now, then probed for a direct call
        (``direct_call``) on ``named``'s tensors (a capture batch: its KV write goes to pad
        slots) and saved."""
        known = self.artifacts.get(key)
        if known is None and self.cache is not None:
            wrapped = self.cache.load_wrapper(key, named)
            if wrapped is not None:
                # NOTE: no inductor artifact in this process: the layer is called through
                # its wrapper library alone (``direct_calls``), never as artifact(*args)
                self.direct_calls[key], names = wrapped
                known = (None, names)
            else:
                known = self.cache.load(key, named)
        if known is not None:
            self.artifacts[key] = known
            return *known, None
        start = time.perf_counter()
        traced = trace_forward(fn, inputs, named, dynamic, ranges)
        artifact = compile_traced(traced, self.options)
        compile_s = time.perf_counter() - start
        names = input_names(traced.inputs, traced.sizes, named)
        if names is None:
            raise RuntimeError("a compiled decoder layer reads a tensor rung cannot name")
        logger.info("compiled a decoder layer artifact of %d inputs in %.1f s", len(names),
                    compile_s)
        self.artifacts[key] = (artifact, names)
        direct = self.direct_call(key, named)
        if self.cache is not None:
            self.cache.save(key, artifact, names,
                            wrapper_library(direct) if direct is not None else None)
        return artifact, names, compile_s

    def loads_without_inductor(self, key: str) -> bool:
        """Whether binding the artifact ``key`` imports nothing of inductor: built in this
        process, or a disk cache entry whose wrapper library this machine can load."""
        return key in self.artifacts or (self.cache is not None and self.cache.has_wrapper(key))

    def direct_call(self, key: str, named: dict[str, torch.Tensor]
                    ) -> DirectCall | None:
        """``direct_call`` of the artifact ``key`` (built by ``layer_artifact``), checked
        once, on ``named``'s tensors (a capture batch: its KV write goes to pad slots)."""
        if key not in self.direct_calls:
            artifact, names = self.artifacts[key]
            args, sizes = bind_inputs(names, named)
            for index, (tensor_index, dim) in sizes.items():
                args[index] = args[tensor_index].shape[dim]
            self.direct_calls[key] = direct_call(artifact, args)
            if self.direct_calls[key] is None:
                logger.info("decoder layer artifact %s is called through inductor's "
                            "wrappers (they change its arguments or outputs)", key)
        return self.direct_calls[key]

    def forget(self, key: str) -> None:
        """Drop an artifact that failed its check, here and on disk."""
        self.artifacts.pop(key, None)
        self.direct_calls.pop(key, None)
        if self.cache is not None:
            self.cache.discard(key)

    def rebind(self, graph: CompiledGraph, inputs: Sequence,
               named: dict[str, torch.Tensor]) -> CompiledGraph:
        """``graph`` (checked) bound to ``inputs`` / ``named`` of the same shapes instead of
        its capture's; runs nothing. The caller has entered the forward context of
        ``inputs`` (it locates the block tables)."""
        if graph.artifact_key not in self.artifacts:
            raise RuntimeError(f"compiled graph {graph.artifact_key} is not named: it cannot "
                               "be bound to other input buffers")
        artifact, names = self.artifacts[graph.artifact_key]
        graph_inputs, sizes = bind_inputs(names, named)
        bound = CompiledGraph(artifact, inputs, graph_inputs, sizes, graph.compile_s,
                              graph.load_s, self.poison_hook)
        bound.outputs, bound.nbytes = graph.outputs, graph.nbytes
        bound.artifact_key = graph.artifact_key
        return bound

    def _bind(self, key: str, artifact: Any, names: list[str], fn: Callable[..., torch.Tensor],
              inputs: Sequence, named: dict[str, torch.Tensor]) -> CompiledGraph | None:
        graph_inputs, sizes = bind_inputs(names, named)
        try:
            graph = self._finish(CompiledGraph(artifact, inputs, graph_inputs, sizes, None,
                                               0.0, self.poison_hook))
        except Exception as e:  # noqa: BLE001 - e.g. a dim the trace specialised after all
            logger.warning("compiled graph %s does not run at this size (%s: %s); compiling "
                           "one for it", key, type(e).__name__, str(e).splitlines()[0])
            return None
        expected = fn(*inputs)
        if not reproduces_eager(graph.outputs, expected, rounded=False):
            logger.warning("compiled graph %s disagrees with eager; rebuilding", key)
            self.artifacts.pop(key, None)
            if self.cache is not None:
                self.cache.discard(key)
            return None
        graph.artifact_key = key
        return graph

    @staticmethod
    def _finish(graph: CompiledGraph) -> CompiledGraph:
        graph.outputs = graph._run()     # outputs of the pad-only capture batch; sizes nbytes
        graph.nbytes = graph.outputs.numel() * graph.outputs.element_size()
        return graph


def compile_key(desc: BatchExecutionDescriptor, ctx: ForwardContext, symbolic_batch: bool
                ) -> dict[str, Any]:
    """What a traced forward specialises on besides tensor shapes.

    NOTE: inlined attention reads the block size alone of the metadata's constants (it
    covers every column of the block table it is handed): max_seq_len and max_query_len
    follow max_model_len and the batch, and would split the cache for nothing.
    """
    block_sizes = {m.block_size for m in (getattr(x, "common", x)
                                          for x in ctx.attn_metadata.values())}
    key = {"mode": desc.mode.name, "uniform_query_len": desc.uniform_query_len,
           "block_sizes": sorted(block_sizes)}
    if symbolic_batch:
        return {**key, "symbolic_batch": True}
    return {**key, "num_tokens_padded": desc.num_tokens_padded,
            "num_reqs_padded": desc.num_reqs_padded}


def symbolic_dims(named: dict[str, torch.Tensor], ctx: ForwardContext, batch: bool,
                  batched: tuple[str, ...] = ("input.",)) -> dict[str, tuple[int, ...]]:
    """Dimensions a compiled forward traces as symbols, by tensor name: each KV cache's
    block count (dim 1 of [2, num_blocks, block_size, kv_heads, head_dim]), each block
    table's width (blocks read per request, cut at each replay) and, with ``batch``, the
    leading (token or request) dimension of every tensor named with a ``batched`` prefix
    (the input buffer views; a drafter's metadata too), so one artifact serves every
    ladder size."""
    tables = {memory_identity(getattr(m, "common", m).block_table)
              for m in ctx.attn_metadata.values()}
    dims: dict[str, tuple[int, ...]] = {}
    for name, t in named.items():
        wide = t.dim() > 1 and t.shape[1] >= MIN_DYNAMIC_SIZE
        if name.startswith("kv.") and wide:
            dims[name] = (1,)
        elif name.startswith(batched):
            dims[name] = ((0,) if batch else ()) + ((1,) if memory_identity(t) in tables
                                                     and wide else ())
    return {name: d for name, d in dims.items() if d}
