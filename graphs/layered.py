"""Compiled CPU graphs per decoder layer: one artifact for every layer of the same kind.

A FULL graph of a model that exposes ``decoder_parts()`` is built from one inductor
artifact per layer KIND (Llama: one; Gemma 4: sliding, full, shared-KV and MoE variants),
not from the whole forward: compile cost grows with neither the depth nor (with a
symbolic batch) the ladder. An artifact's inputs are named relative to its layer
(``param.mlp.down_proj.weight``, ``kv.self_attn.attn``, ``meta.self_attn.attn.seq_lens``,
``hidden``, ``cos``, ``sin``), so the artifact traced on layer 0 binds to layer 29 by name.

A replay runs the model's embedding and rope eagerly (two gathers), calls each layer's
artifact in turn on the previous one's hidden states, then the final norm eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from rung.core.forward_context import ForwardContext, forward_context
from rung.graphs.artifact_cache import bind_inputs
from rung.graphs.capture import CapturedGraph, memory_identity
from rung.graphs.compiled import MIN_DYNAMIC_SIZE, CompiledGraphBackend
from rung.graphs.direct_call import DirectCall, PlainSizes
from rung.kernels.attention import Attention

logger = logging.getLogger(__name__)

class DecoderParts(Protocol):
    """What a model's ``decoder_parts()`` returns (models.layers.DecoderParts): its forward
    is ``norm(layer_n(...layer_1(rope, embed(input_ids))))``, each layer with the rope of
    its ``layer_type``."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    layers: nn.ModuleList
    rotaries: Mapping[str, nn.Module]
    norm: nn.Module


_METADATA = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
# NOTE: per-layer names (which KV cache, which metadata a layer reads); what they select
# comes in as inputs, so two layers that differ only in them share code.
_PER_LAYER_ATTRIBUTES = frozenset({"layer_name", "kv_sharing_target", "training"})


class _LayerCall:
    """One layer's artifact and its argument list, filled in place at each replay."""

    __slots__ = ("run", "size_of", "args", "hidden_at", "cos_at", "sin_at", "rope", "tables",
                 "sizes")

    def __init__(self, artifact: Callable[..., Any], direct: DirectCall | None,
                 names: list[str], named: dict, rope: str, tables: list[torch.Tensor]) -> None:
        # NOTE: both take a copy of the argument list (the direct call empties it)
        self.run = (direct.call if direct is not None
                    else functools.partial(_call_unpacked, artifact))
        self.size_of = direct.size_of if direct is not None else PlainSizes()
        self.args, sizes = bind_inputs(names, named)
        self.hidden_at, self.cos_at, self.sin_at = (names.index(n) if n in names else None
                                                    for n in ("hidden", "cos", "sin"))
        self.rope = rope
        table_ids = [memory_identity(t) for t in tables]
        # (argument index, index into the replay's cut tables)
        self.tables = tuple((i, table_ids.index(memory_identity(a))) for i, a in
                            enumerate(self.args) if isinstance(a, torch.Tensor)
                            and memory_identity(a) in table_ids)
        self.sizes = tuple((i, src, dim) for i, (src, dim) in sizes.items())


def _call_unpacked(artifact: Callable[..., Any], args: list) -> Any:
    return artifact(*args)


class LayeredGraph(CapturedGraph):
    """A FULL graph as one artifact call per decoder layer (see the module docstring)."""

    def __init__(self, static_inputs: Sequence[torch.Tensor], parts: DecoderParts,
                 seq_lens: torch.Tensor, tables: list[tuple[torch.Tensor, int]],
                 poison: Callable[[], None] | None) -> None:
        super().__init__(static_inputs, None, 0)
        self.ids, self.positions = static_inputs[0], static_inputs[1]   # [T] input views
        self.parts = parts
        self.seq_lens = seq_lens                 # [R] int32, host memory on CPU
        self.tables = tables                     # (full block table [R, W], block size)
        self.calls: list[_LayerCall] = []
        self.poison = poison                     # debug mode: garbage into pad rows
        self.compile_s: float | None = None
        self.load_s: float | None = None
        self.artifact_key: str | None = None     # "+"-joined keys of its layer artifacts

    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.poison is not None:     # debug mode: the identity check, then garbage
            self.check_inputs(inputs)
            self.poison()
        return self._run()

    def _run(self, teacher: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None
             = None) -> torch.Tensor:
        """The replay; with ``teacher`` (the capture check), layer i's artifact gets the
        hidden states ``teacher(i - 1, ...)`` returned, instead of its own previous output.
        """
        # NOTE: seq_lens lives in host memory on CPU: reading its max costs no sync. Each
        # table is cut to the blocks the longest sequence covers (see CompiledGraph).
        max_seq_len = int(self.seq_lens.max())
        cut = [table[:, :min(max(-(-max_seq_len // block_size), MIN_DYNAMIC_SIZE),
                             table.shape[1])].contiguous() for table, block_size in self.tables]
        parts = self.parts
        hidden = parts.embed(self.ids)                                   # [T, H]
        ropes = {t: r.cos_sin(self.positions, hidden.dtype) for t, r in parts.rotaries.items()}
        for n, call in enumerate(self.calls):
            args = call.args
            args[call.hidden_at] = hidden
            if call.cos_at is not None:
                args[call.cos_at], args[call.sin_at] = ropes[call.rope]
            for i, t in call.tables:
                args[i] = cut[t]
            for i, src, dim in call.sizes:
                args[i] = call.size_of[args[src].shape[dim]]
            out = call.run(args.copy())[0]
            hidden = out if teacher is None else teacher(n, hidden, out)
        return parts.norm(hidden)


def capture_layers(backend: CompiledGraphBackend, inputs: Sequence[torch.Tensor],
                   parts: DecoderParts, ctx: ForwardContext,
                   graph_key: dict[str, Any], symbolic: bool) -> LayeredGraph | None:
    """The FULL graph of the model's forward on ``inputs`` (ids, positions; in ``ctx``)
    from per-layer artifacts, each compiled once per kind or loaded from the disk cache.

    NOTE: every layer's artifact must reproduce the eager layer on the capture batch, both
    fed the eager model's hidden states (``_Teacher``). Loaded artifacts that do not are
    dropped and compiled again (once); None when freshly compiled ones do not either (e.g.
    a size the symbolic trace specialised).
    """
    start = time.perf_counter()
    with torch.no_grad():
        specs = layer_specs(backend, parts, ctx, inputs[0], inputs[1], graph_key, symbolic)
    for _ in range(2):
        graph, loaded = _bind_layers(backend, inputs, parts, ctx, specs)
        try:
            mismatches: list[str] = []
            with _one_thread(), _Teacher(parts, inputs[0], inputs[1], _eager_context(ctx),
                                         mismatches) as teacher:
                graph.outputs = graph._run(teacher)
            ok = not mismatches
            why = f"disagrees with eager ({'; '.join(mismatches[:3])})"
        except Exception as e:  # noqa: BLE001 - e.g. a dim the trace specialised after all
            ok, why = False, f"does not run at this size ({type(e).__name__}: {e})"
        if ok:
            seconds = time.perf_counter() - start
            compiled = graph.compile_s is not None
            graph.compile_s, graph.load_s = (seconds, None) if compiled else (None, seconds)
            graph.nbytes = graph.outputs.numel() * graph.outputs.element_size()
            return graph
        logger.warning("per-layer graph of %d tokens %s", inputs[0].shape[0],
                       why.splitlines()[0])
        if not loaded:
            return None
        for key in loaded:
            backend.forget(key)
    return None


class _Teacher:
    """The capture check of each layer's artifact against the eager layer, both fed the
    eager model's hidden states (``LayeredGraph._run``'s teacher); what disagrees goes into
    ``mismatches``.

    NOTE: layer by layer, not on the last hidden states: where activations are rounded to
    int8 (GGUF on CPU), inductor's last-bit differences in a fused norm flip roundings, and
    the flips compound over the layers into differences far past any tolerance (SmolLM2
    Q4_1: 0.27 of 28.8 after 30 layers) that say nothing about the artifact. Fed the same
    input, each layer holds rtol 1e-3, atol 1e-4 (SmolLM2, sizes 1-16: the worst element
    used 0.71 of it in Q4_1, 0.40 in fp32).

    NOTE: the eager layers run in a thread, one layer ahead of the artifacts: both release
    the GIL in their kernels, so on two cores a check costs about the longer of the two
    forwards, not their sum. Eager layer m never runs beside artifact m (``teach(m - 1)``
    returns once eager layer m is done), nor beside artifact m - 1 when the two layers share
    a KV cache (each writes the capture batch's pad slot, values that differ in the last
    bits). The thread alone enters the eager forward context; artifacts read none.
    """

    def __init__(self, parts: DecoderParts, ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext, mismatches: list[str]) -> None:
        self.parts, self.ids, self.positions, self.ctx = parts, ids, positions, ctx
        self.mismatches = mismatches
        num_layers = len(parts.layers)
        self._expected: list[torch.Tensor | None] = [None] * num_layers
        self._eager_done = [threading.Event() for _ in range(num_layers)]
        self._artifact_done = [threading.Event() for _ in range(num_layers)]
        kv = [{memory_identity(m.kv_cache) for m in layer.modules()
               if isinstance(m, Attention) and m.kv_cache is not None} for layer in parts.layers]
        self._shares_kv = [m > 0 and bool(kv[m] & kv[m - 1]) for m in range(num_layers)]
        self._modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False

    def __enter__(self) -> "_Teacher":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped = True
        for event in self._artifact_done:
            event.set()
        if self._thread is not None:
            self._thread.join()

    def __call__(self, n: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Artifact ``n`` returned ``out``: the eager layer's output, once eager layer
        ``n + 1`` is done too (artifact ``n + 1`` runs next)."""
        if self._thread is None:      # NOTE: started once artifact 0 is done (see above)
            self._thread = threading.Thread(target=self._run_eager, daemon=True,
                                            name="rung-capture-check")
            self._thread.start()
        self._artifact_done[n].set()
        self._eager_done[min(n + 1, len(self._expected) - 1)].wait()
        if self._error is not None:
            raise self._error
        expected = self._expected[n]
        if not torch.allclose(out, expected, rtol=1e-3, atol=1e-4):
            err = float((out - expected).abs().max())
            self.mismatches.append(f"layer {n}: max |difference| {err:.3g}")
        return expected

    def _run_eager(self) -> None:
        parts = self.parts
        inference, grad = self._modes     # NOTE: both are per thread in torch
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    forward_context(self.ctx):
                hidden = parts.embed(self.ids)                           # [T, H]
                ropes: dict[str, tuple] = {}
                for m, layer in enumerate(parts.layers):
                    if self._shares_kv[m]:
                        self._artifact_done[m - 1].wait()
                    if self._stopped:
                        return
                    if layer.layer_type not in ropes:
                        rotary = parts.rotaries[layer.layer_type]
                        ropes[layer.layer_type] = (rotary, *rotary.cos_sin(self.positions,
                                                                            hidden.dtype))
                    hidden = self._expected[m] = layer(ropes[layer.layer_type], hidden)
                    self._eager_done[m].set()
        except BaseException as e:  # noqa: BLE001 - raised on the checking thread
            self._error = e
        finally:
            for event in self._eager_done:
                event.set()


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


def _bind_layers(backend: CompiledGraphBackend, inputs: Sequence[torch.Tensor],
                 parts: DecoderParts, ctx: ForwardContext, specs: list
                 ) -> tuple[LayeredGraph, set[str]]:
    """The graph with every layer bound to its kind's artifact (compiled or loaded now),
    and the keys of the artifacts that were loaded rather than compiled."""
    metas = [ctx.attn_metadata[a.layer_name].common for a in _attention_modules(parts.layers)]
    tables = list({memory_identity(m.block_table): (m.block_table, m.block_size)
                   for m in metas}.values())
    graph = LayeredGraph(inputs, parts, metas[0].seq_lens, tables, backend.poison_hook)
    keys, loaded, compiled = [], set(), False
    for layer, rope, named, dynamic, key in specs:
        rotary, cos, sin = rope, named["cos"], named["sin"]
        artifact, names, compile_s = backend.layer_artifact(
            key, _layer_fn(layer, parts.rotaries[rotary]), [named["hidden"], cos, sin],
            named, dynamic)
        compiled |= compile_s is not None
        if compile_s is None:
            loaded.add(key)
        graph.calls.append(_LayerCall(artifact, backend.direct_call(key, named), names,
                                      named, rotary, [t for t, _ in tables]))
        keys.append(key)
    graph.compile_s = 0.0 if compiled else None
    graph.artifact_key = "+".join(dict.fromkeys(keys))
    return graph, loaded


def build_layer_artifacts(backend: CompiledGraphBackend, parts: DecoderParts,
                          specs: list) -> float:
    """Compile (or load) the artifact of every layer kind in ``specs``, binding nothing;
    the seconds spent compiling."""
    seen: set[str] = set()
    compile_s = 0.0
    for layer, rope, named, dynamic, key in specs:
        if key not in seen:
            seen.add(key)
            compile_s += backend.layer_artifact(
                key, _layer_fn(layer, parts.rotaries[rope]),
                [named["hidden"], named["cos"], named["sin"]], named, dynamic)[2] or 0.0
    return compile_s


def _layer_fn(layer: nn.Module, rotary: nn.Module) -> Callable[..., torch.Tensor]:
    def run_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return layer((rotary, cos, sin), hidden)
    return run_layer


def layer_specs(backend: CompiledGraphBackend, parts: DecoderParts, ctx: ForwardContext,
                ids: torch.Tensor, positions: torch.Tensor, graph_key: dict[str, Any],
                symbolic: bool) -> list[tuple]:
    """(layer, its rope type, its named tensors, dims traced symbolic, artifact key) of
    every decoder layer, on the capture batch ``ids`` / ``positions`` in ``ctx``."""
    hidden = parts.embed(ids)                                            # [T, H]
    ropes = {t: r.cos_sin(positions, hidden.dtype) for t, r in parts.rotaries.items()}
    specs = []
    for layer in parts.layers:
        named = layer_tensors(layer, ctx, hidden, *ropes[layer.layer_type],
                              parts.rotaries[layer.layer_type])
        dynamic = _layer_dynamic(named, symbolic)
        key = backend.key(named, dynamic, {**graph_key, "per_layer": layer_signature(layer)})
        specs.append((layer, layer.layer_type, named, dynamic, key))
    return specs


def layer_tensors(layer: nn.Module, ctx: ForwardContext, hidden: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, rotary: nn.Module
                  ) -> dict[str, torch.Tensor]:
    """Every tensor a decoder layer may read, by a name relative to the layer."""
    named = {"hidden": hidden, "cos": cos, "sin": sin}
    named.update({f"param.{n}": p for n, p in layer.named_parameters()})
    named.update({f"buffer.{n}": b for n, b in layer.named_buffers()})
    named.update({f"rotary.{n}": b for n, b in rotary.named_buffers()})
    for path, module in layer.named_modules():
        if isinstance(module, Attention):
            if module.kv_cache is not None:
                named[f"kv.{path}"] = module.kv_cache
            meta = ctx.attn_metadata[module.layer_name].common
            named.update({f"meta.{path}.{f}": getattr(meta, f) for f in _METADATA})
    return named


def _layer_dynamic(named: dict[str, torch.Tensor], symbolic: bool
                   ) -> dict[str, tuple[int, ...]]:
    """Dims traced as symbols: each KV cache's block count and each block table's width
    (as whole-forward graphs do) and, when ``symbolic``, the token / request dimension."""
    dims: dict[str, tuple[int, ...]] = {}
    for name, t in named.items():
        wide = t.dim() > 1 and t.shape[1] >= MIN_DYNAMIC_SIZE
        if name.startswith("kv.") and wide:
            dims[name] = (1,)
        elif name in ("hidden", "cos", "sin") or name.startswith("meta."):
            dims[name] = (((0,) if symbolic else ())
                          + ((1,) if name.endswith(".block_table") and wide else ()))
    return {name: d for name, d in dims.items() if d}


def layer_signature(layer: nn.Module) -> list:
    """What a layer's traced code depends on besides its tensors' shapes: each submodule's
    class and plain attributes (head counts, eps, sliding window, activation...)."""
    return [[path, type(m).__qualname__,
             {k: _describe(v) for k, v in sorted(vars(m).items())
              if not k.startswith("_") and k not in _PER_LAYER_ATTRIBUTES
              and not isinstance(v, torch.Tensor)}]
            for path, m in layer.named_modules()]


def _describe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if dataclasses.is_dataclass(value):
        return repr(value)
    return getattr(value, "__qualname__", type(value).__qualname__)


def _attention_modules(layers: nn.ModuleList) -> list[Attention]:
    return [m for m in layers.modules() if isinstance(m, Attention)]
