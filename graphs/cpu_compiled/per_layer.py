"""Compiled CPU graphs per decoder layer: one artifact for every layer of the same kind.

A FULL graph of a model that exposes ``decoder_parts()`` is built from one inductor
artifact per layer KIND (Llama: one; Gemma 4: sliding, full, shared-KV and MoE variants),
not from the whole forward: compile cost grows with neither the depth nor (with a
symbolic batch) the ladder. An artifact's inputs are named relative to its layer
(graphs/cpu_compiled/layer_specs.py), so the artifact traced on layer 0 binds to layer 29 by name.

A replay runs the model's embedding eagerly (a gather), calls each layer's artifact in
turn on the previous one's hidden states (each gathers its rope from the positions), then
the EPILOGUE artifact: the final norm and the lm head of the sampled rows, so a replay
returns the logits with the hidden states. The lm head may pick its kernel by row count
(``DecoderParts.logits_splits``): one epilogue artifact per range of row counts, each
traced with its range on the symbolic row dim, so the range decides the branch, not the
trace's example size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from rung.core.forward_context import ForwardContext, forward_context
from rung.graphs.capture import CapturedGraph, ForwardOutput, memory_identity
from rung.graphs.cpu_compiled.artifact_cache import bind_inputs
from rung.graphs.cpu_compiled.artifacts import (
    MIN_DYNAMIC_SIZE,
    ArtifactCompiler,
    reproduces_eager,
    rounds_activations,
)
from rung.graphs.cpu_compiled.direct_call import DirectCall, PlainSizes, from_handles, to_handles
from rung.graphs.cpu_compiled.layer_specs import DecoderParts, layer_specs, layer_tensors
from rung.kernels.attention import Attention

logger = logging.getLogger(__name__)


class _LayerCall:
    """One layer's artifact and its argument list, filled in place at each replay."""

    __slots__ = ("run", "entry", "size_of", "args", "hidden_at", "rows_at", "tables", "sizes",
                 "source")

    def __init__(self, artifact: Callable[..., Any], direct: DirectCall | None,
                 names: list[str], named: dict, tables: list[torch.Tensor]) -> None:
        self.source = (artifact, direct, names)      # what ``rebound`` binds again
        # NOTE: both take a copy of the argument list (the direct call empties it)
        self.run = (direct.call if direct is not None
                    else functools.partial(_call_unpacked, artifact))
        self.entry = direct.entry if direct is not None else None    # see DirectCall
        self.size_of = direct.size_of if direct is not None else PlainSizes()
        self.args, sizes = bind_inputs(names, named)
        self.hidden_at, self.rows_at = (names.index(n) if n in names else None
                                        for n in ("hidden", "rows"))
        table_ids = [memory_identity(t) for t in tables]
        # (argument index, index into the replay's cut tables)
        self.tables = tuple((i, table_ids.index(memory_identity(a))) for i, a in
                            enumerate(self.args) if isinstance(a, torch.Tensor)
                            and memory_identity(a) in table_ids)
        self.sizes = tuple((i, src, dim) for i, (src, dim) in sizes.items())

    def rebound(self, named: dict, tables: list[torch.Tensor]) -> "_LayerCall":
        """The same artifact called on ``named``'s tensors (same names and shapes)."""
        return _LayerCall(*self.source, named, tables)


def _call_unpacked(artifact: Callable[..., Any], args: list) -> Any:
    return artifact(*args)


class LayeredGraph(CapturedGraph):
    """A FULL graph as one artifact call per decoder layer, then the epilogue's (see the
    module docstring)."""

    def __init__(self, static_inputs: Sequence[torch.Tensor], parts: DecoderParts,
                 seq_lens: torch.Tensor, tables: list[tuple[torch.Tensor, int]],
                 poison: Callable[[], None] | None) -> None:
        super().__init__(static_inputs, None, 0)
        self.ids, self.positions = static_inputs[0], static_inputs[1]   # [T] input views
        self.parts = parts
        self.seq_lens = seq_lens                 # [R] int32, host memory on CPU
        self.tables = tables                     # (full block table [R, W], block size)
        self.calls: list[_LayerCall] = []
        # number of logits rows (1..T) -> the epilogue whose range holds it; [0] is None
        self.epilogues: list[_LayerCall | None] = [None]
        self.poison = poison                     # debug mode: garbage into pad rows
        self.compile_s: float | None = None
        self.load_s: float | None = None
        self.artifact_key: str | None = None     # "+"-joined keys of its artifacts
        # (graph key, symbolic batch) its artifacts were bound with (``rebind_layers``)
        self.bound_as: tuple[dict[str, Any], bool] | None = None

    def forward(self, inputs: Sequence[torch.Tensor], rows: torch.Tensor) -> ForwardOutput:
        if self.poison is not None:     # debug mode: the identity check, then garbage
            self.check_inputs(inputs)
            self.poison()
        return self._run(rows)

    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.forward(inputs, self.ids[:0]).hidden

    def _run(self, rows: torch.Tensor,
             teacher: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             last: torch.Tensor | None = None) -> ForwardOutput:
        """The replay: hidden [T, H] and the logits [len(rows), vocab] of hidden[rows] (None
        for no rows: the norm alone then runs, eagerly). With ``teacher`` (the capture
        check), layer i's artifact gets the hidden states ``teacher(i - 1, ...)`` returned,
        instead of its own previous output; with ``last``, only the epilogue runs, on it.
        """
        hidden = last
        if hidden is None:
            # NOTE: seq_lens lives in host memory on CPU: reading its max costs no sync.
            # Each table is cut to the blocks the longest sequence covers (see
            # CompiledGraph).
            max_seq_len = int(self.seq_lens.max())
            cut = [table[:, :min(max(-(-max_seq_len // block_size), MIN_DYNAMIC_SIZE),
                                 table.shape[1])].contiguous()
                   for table, block_size in self.tables]
            hidden = self.parts.embed(self.ids)                          # [T, H]
            for n, call in enumerate(self.calls):
                args = call.args
                args[call.hidden_at] = hidden
                for i, t in call.tables:
                    args[i] = cut[t]
                for i, src, dim in call.sizes:
                    args[i] = call.size_of[args[src].shape[dim]]
                out = (call.run(args.copy()) if call.entry is None
                       else from_handles(call.entry(to_handles(args))))[0]
                hidden = out if teacher is None else teacher(n, hidden, out)
        call = self.epilogues[rows.shape[0]]
        if call is None:                 # nothing sampled (a data-parallel dummy step)
            return ForwardOutput(self.parts.norm(hidden), None)
        args = call.args
        args[call.hidden_at], args[call.rows_at] = hidden, rows
        for i, src, dim in call.sizes:
            args[i] = call.size_of[args[src].shape[dim]]
        hidden, logits = (call.run(args.copy()) if call.entry is None
                          else from_handles(call.entry(to_handles(args))))
        return ForwardOutput(hidden, logits)


def capture_layers(backend: ArtifactCompiler, inputs: Sequence[torch.Tensor],
                   parts: DecoderParts, ctx: ForwardContext,
                   graph_key: dict[str, Any], symbolic: bool,
                   off_thread: bool = False,
                   pause: Callable[[], None] | None = None) -> LayeredGraph | None:
    """The FULL graph of the model's forward on ``inputs`` (ids, positions; in ``ctx``)
    from per-layer artifacts, each compiled once per kind or loaded from the disk cache.

    NOTE: every layer's artifact must reproduce the eager layer on the capture batch, both
    fed the eager model's hidden states (``_Teacher``), and each epilogue the eager norm
    and lm head, fed the eager last hidden states (``_check_epilogues``). Loaded artifacts
    that do not are dropped and compiled again (once); None when freshly compiled ones do
    not either (e.g. a size the symbolic trace specialised).

    ``off_thread``: built while the serving thread runs steps; the check then leaves the
    process's torch thread count alone (another thread's matmuls read it) and runs its
    eager layers on this thread, after each artifact, then calls ``pause`` (if given).
    """
    start = time.perf_counter()
    with torch.no_grad():
        specs = layer_specs(backend, parts, ctx, inputs[0], inputs[1], graph_key, symbolic)
    for _ in range(2):
        graph, loaded = _bind_layers(backend, inputs, parts, ctx, specs)
        try:
            mismatches: list[str] = []
            # NOTE: eager beside the artifacts only where these run on one thread: an
            # artifact generated for more waits at each parallel loop's barrier for a core
            # the eager thread holds, many times the layer's own time
            overlap = backend.threads == 1 and not off_thread
            with _one_thread() if overlap else contextlib.nullcontext():
                with _Teacher(parts, inputs[0], inputs[1], _eager_context(ctx),
                              mismatches, overlap, pause) as teacher:
                    graph.outputs = graph._run(inputs[0][:0], teacher).hidden
                _check_epilogues(graph, parts, teacher.last(), mismatches)
            ok = not mismatches
            why = f"disagrees with eager ({'; '.join(mismatches[:3])})"
        except Exception as e:  # noqa: BLE001 - e.g. a dim the trace specialised after all
            ok, why = False, f"does not run at this size ({type(e).__name__}: {e})"
        if ok:
            seconds = time.perf_counter() - start
            compiled = graph.compile_s is not None
            graph.compile_s, graph.load_s = (seconds, None) if compiled else (None, seconds)
            graph.nbytes = graph.outputs.numel() * graph.outputs.element_size()
            graph.bound_as = (graph_key, symbolic)
            return graph
        logger.warning("per-layer graph of %d tokens %s", inputs[0].shape[0],
                       why.splitlines()[0])
        if not loaded:
            return None
        for key in loaded:
            backend.forget(key)
    return None


def rebind_layers(graph: LayeredGraph, inputs: Sequence[torch.Tensor],
                  ctx: ForwardContext) -> LayeredGraph:
    """``graph`` (checked on its capture batch) bound to ``inputs`` (ids, positions, ...;
    in ``ctx``) of the same shapes: the same artifacts, each layer's arguments taken from
    these buffers (the epilogues read no input buffer: shared). Runs no layer, loads,
    compiles and hashes nothing."""
    parts = graph.parts
    metas = [ctx.attn_metadata[a.layer_name].common for a in _attention_modules(parts.layers)]
    tables = list({memory_identity(m.block_table): (m.block_table, m.block_size)
                   for m in metas}.values())
    if [t.shape for t, _ in tables] != [t.shape for t, _ in graph.tables]:
        raise RuntimeError("rebinding a per-layer graph to block tables of other shapes")
    bound = LayeredGraph(inputs, parts, metas[0].seq_lens, tables, graph.poison)
    hidden = graph.outputs                                              # [T, H]
    with torch.no_grad():
        for layer, call in zip(parts.layers, graph.calls):
            named = layer_tensors(layer, ctx, hidden, inputs[1], parts.rotaries[layer.layer_type])
            bound.calls.append(call.rebound(named, [t for t, _ in tables]))
    bound.epilogues = graph.epilogues
    bound.outputs, bound.nbytes = graph.outputs, graph.nbytes
    bound.compile_s, bound.load_s = graph.compile_s, graph.load_s
    bound.artifact_key, bound.bound_as = graph.artifact_key, graph.bound_as
    return bound


class _Teacher:
    """The capture check of each layer's artifact against the eager layer, both fed the
    eager model's hidden states (``LayeredGraph._run``'s teacher); what disagrees goes into
    ``mismatches``; ``last()``: the eager last layer's output (the epilogues' input).

    NOTE: layer by layer, not on the last hidden states: where activations are rounded to
    int8 (GGUF on CPU), inductor's last-bit differences in a fused norm flip roundings, and
    the flips compound over the layers into differences far past any tolerance that say
    nothing about the artifact. Fed the same input, a layer differs by a flip at most,
    which ``reproduces_eager`` measures against the row's norm.

    NOTE: with ``overlap`` the eager layers run in a thread, one layer ahead of the
    artifacts: both release the GIL in their kernels, so on two cores a check costs about
    the longer of the two forwards, not their sum. Eager layer m never runs beside artifact
    m (``teach(m - 1)`` returns once eager layer m is done), nor beside artifact m - 1 when
    the two layers share a KV cache (each writes the capture batch's pad slot, values that
    differ in the last bits). The eager layers alone enter the eager forward context;
    artifacts read none. Without ``overlap``, eager layer m runs after artifact m returned.
    """

    def __init__(self, parts: DecoderParts, ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext, mismatches: list[str], overlap: bool = True,
                 pause: Callable[[], None] | None = None) -> None:
        self.parts, self.ids, self.positions, self.ctx = parts, ids, positions, ctx
        self.mismatches, self.overlap, self.pause = mismatches, overlap, pause
        num_layers = len(parts.layers)
        self._expected: list[torch.Tensor | None] = [None] * num_layers
        self._eager_done = [threading.Event() for _ in range(num_layers)]
        self._artifact_done = [threading.Event() for _ in range(num_layers)]
        kv = [{memory_identity(m.kv_cache) for m in layer.modules()
               if isinstance(m, Attention) and m.kv_cache is not None} for layer in parts.layers]
        self._shares_kv = [m > 0 and bool(kv[m] & kv[m - 1]) for m in range(num_layers)]
        self._rounded = [rounds_activations(layer) for layer in parts.layers]
        self._modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._ropes: dict[str, tuple] = {}     # layer type -> (rotary, cos, sin)

    def __enter__(self) -> "_Teacher":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped = True
        for event in self._artifact_done:
            event.set()
        if self._thread is not None:
            self._thread.join()

    def __call__(self, n: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Artifact ``n`` returned ``out``: the eager layer's output (with ``overlap``, once
        eager layer ``n + 1`` is done too: artifact ``n + 1`` runs next)."""
        self._artifact_done[n].set()
        if not self.overlap:
            self._run_eager(n)
        else:
            if self._thread is None:  # NOTE: started once artifact 0 is done (see above)
                self._thread = threading.Thread(target=self._run_eager, daemon=True,
                                                name="rung-capture-check")
                self._thread.start()
            self._eager_done[min(n + 1, len(self._expected) - 1)].wait()
        if self._error is not None:
            raise self._error
        expected = self._expected[n]
        if not reproduces_eager(out, expected, self._rounded[n]):
            err = float((out - expected).abs().max())
            self.mismatches.append(f"layer {n}: max |difference| {err:.3g}")
        if self.pause is not None:
            self.pause()
        return expected

    def last(self) -> torch.Tensor:
        """The eager last layer's output, once the check has run."""
        expected = self._expected[-1]
        if expected is None:
            raise RuntimeError("the capture check has not run the eager layers")
        return expected

    def _run_eager(self, only: int | None = None) -> None:
        """The eager layers in order (on the checking thread: layer ``only`` alone)."""
        parts = self.parts
        inference, grad = self._modes     # NOTE: both are per thread in torch
        layers = range(len(parts.layers)) if only is None else (only,)
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    forward_context(self.ctx):
                hidden = parts.embed(self.ids) if layers[0] == 0 else self._expected[layers[0] - 1]
                for m in layers:
                    layer = parts.layers[m]
                    if self._shares_kv[m]:
                        self._artifact_done[m - 1].wait()
                    if self._stopped:
                        return
                    if layer.layer_type not in self._ropes:
                        rotary = parts.rotaries[layer.layer_type]
                        self._ropes[layer.layer_type] = (
                            rotary, *rotary.cos_sin(self.positions, hidden.dtype))
                    hidden = self._expected[m] = layer(self._ropes[layer.layer_type], hidden)
                    self._eager_done[m].set()
        except BaseException as e:  # noqa: BLE001 - raised on the checking thread
            self._error = e
        finally:
            if only is None or self._error is not None:
                for event in self._eager_done:
                    event.set()


def _check_epilogues(graph: LayeredGraph, parts: DecoderParts, hidden: torch.Tensor,
                     mismatches: list[str]) -> None:
    """Each epilogue artifact of ``graph`` against the eager norm and lm head, both fed
    the eager model's last hidden states ``hidden`` [T, H], at the fewest and the most
    logits rows it serves in this graph; what disagrees goes into ``mismatches``."""
    counts: dict[int, list[int]] = {}
    for n, call in enumerate(graph.epilogues):
        if call is not None:
            counts.setdefault(id(call), []).append(n)
    normed = parts.norm(hidden)
    head_rounded = rounds_activations(parts.head)
    for n in sorted({n for ns in counts.values() for n in (ns[0], ns[-1])}):
        rows = torch.arange(n, device=hidden.device)
        out = graph._run(rows, last=hidden)
        for what, got, want, rounded in (
                ("norm", out.hidden, normed, False),
                ("logits", out.logits, parts.logits(normed[rows]), head_rounded)):
            if not reproduces_eager(got, want, rounded):
                err = float((got - want).abs().max())
                mismatches.append(f"epilogue of {n} rows, {what}: max |difference| {err:.3g}")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The capture-batch check on one torch thread: on a busy small machine two OpenMP
    threads wait at every op's barrier for a core (seconds per check at 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _eager_context(ctx: ForwardContext) -> ForwardContext:
    """``ctx`` with each metadata's max_seq_len as an eager step of this batch has it,
    rounded up to the blocks a replay reads (a capture batch holds max_model_len there,
    and eager attention would read every block of every row: seconds per check at 8k)."""
    def eager(meta: Any) -> Any:
        if not (dataclasses.is_dataclass(meta) and hasattr(meta, "max_seq_len")):
            return meta
        blocks = max(-(-int(meta.seq_lens.max()) // meta.block_size), MIN_DYNAMIC_SIZE)
        return dataclasses.replace(meta, max_seq_len=min(blocks * meta.block_size,
                                                         meta.max_seq_len))
    metas = {id(m): eager(m) for m in ctx.attn_metadata.values()}
    return dataclasses.replace(ctx, attn_metadata={name: metas[id(m)] for name, m
                                                   in ctx.attn_metadata.items()})


def _bind_layers(backend: ArtifactCompiler, inputs: Sequence[torch.Tensor],
                 parts: DecoderParts, ctx: ForwardContext, specs: list
                 ) -> tuple[LayeredGraph, set[str]]:
    """The graph with every layer bound to its kind's artifact (compiled or loaded now),
    and the keys of the artifacts that were loaded rather than compiled."""
    metas = [ctx.attn_metadata[a.layer_name].common for a in _attention_modules(parts.layers)]
    tables = list({memory_identity(m.block_table): (m.block_table, m.block_size)
                   for m in metas}.values())
    graph = LayeredGraph(inputs, parts, metas[0].seq_lens, tables, backend.poison_hook)
    keys, loaded, compiled, epilogues = [], set(), False, []
    for spec in specs:
        artifact, names, compile_s = backend.layer_artifact(spec.key, spec.fn, spec.example,
                                                            spec.named, spec.dynamic,
                                                            spec.ranges)
        compiled |= compile_s is not None
        if compile_s is None:
            loaded.add(spec.key)
        call = _LayerCall(artifact, backend.direct_call(spec.key, spec.named), names,
                          spec.named, [t for t, _ in tables])
        if spec.rows is None:
            graph.calls.append(call)
        else:
            epilogues.append((spec.rows, call))
        keys.append(spec.key)
    graph.epilogues += [next(c for (lo, hi), c in epilogues if lo <= n <= hi)
                        for n in range(1, inputs[0].shape[0] + 1)]
    graph.compile_s = 0.0 if compiled else None
    graph.artifact_key = "+".join(dict.fromkeys(keys))
    return graph, loaded


def _attention_modules(layers: nn.ModuleList) -> list[Attention]:
    return [m for m in layers.modules() if isinstance(m, Attention)]
