"""Compiled CPU graphs of a drafter: its k greedy rounds as ONE inductor artifact.

Under the compiled backend a drafter's FULL graph (``GraphManager.capture_graph``) is built
as the target's whole-forward graphs are: dynamo traces the rounds once with attention
inlined as torch ops, each round's argmax included (the next round's token never leaves
the artifact), and inductor compiles it with the batch dimension symbolic, so one artifact
serves every size of the draft ladder of two rows or more (size 1 binds it too, once it is
built on two rows). It is keyed on what its code depends on (the target's and the
drafter's configs, the round count, each tensor's shape with its symbolic dims masked) and
kept in the disk cache; bound to a size, it must reproduce the eager rounds on that size's
capture batch before it goes live.

Why not per layer, as the target: a drafter is a few layers called k times per step, and
one artifact for the whole step is one call instead of k x (layers + head) calls, with
nothing eager in between (see ``python -m rung.bench.draft_step``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext
from rung.graphs.artifact_cache import bind_inputs
from rung.graphs.capture import memory_identity
from rung.graphs.compiled import (
    MIN_DYNAMIC_SIZE,
    CompiledGraph,
    CompiledGraphBackend,
    compile_key,
)

logger = logging.getLogger(__name__)

_METADATA = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


def capture_compiled_draft(backend: CompiledGraphBackend, desc: BatchExecutionDescriptor,
                           fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                           ctx: ForwardContext, tensors: Mapping[str, torch.Tensor],
                           modules: Mapping[str, nn.Module], graph_key: dict[str, Any],
                           symbolic: bool) -> CompiledGraph:
    """The compiled graph of ``fn(*inputs)`` (a drafter's rounds on ``desc``'s capture
    batch, in ``ctx``, which the caller has entered). ``tensors``: what else it may read by
    a stable name (the target's KV caches, parameters); ``modules``: prefix -> module whose
    parameters and buffers it may read; ``graph_key``: what its code depends on besides
    them (the drafter's config, the round count). ``symbolic``: trace the batch dim symbolic
    (the draft ladder has a size of two rows or more; they are captured first).

    NOTE: a graph bound to an artifact (built now, earlier, or loaded) must give the eager
    rounds' drafts on the capture batch; one that does not is dropped and built again
    (once), then a static one-size artifact is tried; RuntimeError if none does.
    """
    named = draft_tensors(inputs, ctx, tensors, modules)
    rows = desc.num_reqs_padded
    for batch in dict.fromkeys((symbolic, False)):
        dynamic = draft_dynamic(named, ctx, batch)
        key = backend.key(named, dynamic, {**compile_key(desc, ctx, batch), **graph_key})
        if batch and rows < MIN_DYNAMIC_SIZE:
            # NOTE: a one-row trace would specialise the batch dimension: bind the artifact
            # the larger sizes built (never drop it), else a static one of its own
            if backend.has_artifact(key):
                graph, _ = _bind(backend, key, fn, inputs, named, dynamic)
                if graph is not None:
                    return graph
            continue
        for _ in range(2):
            graph, loaded = _bind(backend, key, fn, inputs, named, dynamic)
            if graph is not None:
                return graph
            backend.forget(key)
            if not loaded:
                break
    raise RuntimeError(f"no compiled draft graph of {rows} requests reproduces the eager "
                       "draft rounds")


def _bind(backend: CompiledGraphBackend, key: str, fn: Callable[..., torch.Tensor],
          inputs: Sequence[torch.Tensor], named: dict[str, torch.Tensor],
          dynamic: dict[str, tuple[int, ...]]) -> tuple[CompiledGraph | None, bool]:
    """(the graph of artifact ``key`` bound to ``named`` if it reproduces eager on the
    capture batch, else None; whether the artifact was built before this call)."""
    start = time.perf_counter()
    artifact, names, compile_s = backend.layer_artifact(key, fn, inputs, named, dynamic)
    loaded = compile_s is None
    graph_inputs, sizes = bind_inputs(names, named)
    graph = CompiledGraph(artifact, inputs, graph_inputs, sizes, None, None,
                          backend.poison_hook)
    try:
        got = graph._run()                       # [num_reqs_padded, k] int64
    except Exception as e:  # noqa: BLE001 - e.g. a dim the trace specialised after all
        logger.warning("compiled draft graph %s does not run on %d rows (%s: %s)", key,
                       inputs[0].shape[0], type(e).__name__, str(e).splitlines()[0])
        return None, loaded
    want = fn(*inputs)
    if not torch.equal(got, want):
        logger.warning("compiled draft graph %s disagrees with the eager rounds on %d rows",
                       key, inputs[0].shape[0])
        return None, loaded
    seconds = time.perf_counter() - start
    graph.compile_s, graph.load_s = (None, seconds) if loaded else (seconds, None)
    graph.outputs, graph.nbytes = got, got.numel() * got.element_size()
    graph.artifact_key = key
    return graph, loaded


def draft_tensors(inputs: Sequence[torch.Tensor], ctx: ForwardContext,
                  tensors: Mapping[str, torch.Tensor], modules: Mapping[str, nn.Module]
                  ) -> dict[str, torch.Tensor]:
    """Every tensor a drafter's rounds may read, by a name stable across processes: the
    graph's inputs, each draft layer's metadata, ``tensors``, and each module's parameters
    and buffers under its prefix."""
    named = {f"input.{i}": t for i, t in enumerate(inputs)}
    for layer, meta in ctx.attn_metadata.items():
        common = getattr(meta, "common", meta)
        named.update({f"meta.{layer}.{f}": getattr(common, f) for f in _METADATA})
    named.update(tensors)
    for prefix, module in modules.items():
        named.update({f"{prefix}param.{n}": p for n, p in module.named_parameters()})
        named.update({f"{prefix}buffer.{n}": b for n, b in module.named_buffers()})
    return named


def draft_dynamic(named: dict[str, torch.Tensor], ctx: ForwardContext, batch: bool
                  ) -> dict[str, tuple[int, ...]]:
    """Dims traced symbolic: each KV cache's block count, each block table's width (cut at
    each replay) and, with ``batch``, the leading (request) dim of the inputs and the
    metadata."""
    tables = {memory_identity(getattr(m, "common", m).block_table)
              for m in ctx.attn_metadata.values()}
    dims: dict[str, tuple[int, ...]] = {}
    for name, t in named.items():
        wide = t.dim() > 1 and t.shape[1] >= MIN_DYNAMIC_SIZE
        if name.startswith("kv.") and wide:
            dims[name] = (1,)
        elif name.startswith(("input.", "meta.")):
            dims[name] = ((0,) if batch else ()) + ((1,) if memory_identity(t) in tables
                                                     and wide else ())
    return {name: d for name, d in dims.items() if d}
