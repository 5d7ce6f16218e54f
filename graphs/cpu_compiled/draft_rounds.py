"""Compiled CPU graphs of a drafter: ONE inductor artifact of a draft round, called k times.

Under the compiled backend a drafter's FULL graph (``GraphManager.capture_graph``) is built
from the artifact of one greedy round (``DraftModel.greedy_round``: the drafter's forward,
its head and the argmax), traced once with attention inlined as torch ops. A replay calls
it k times, each round on the token and hidden state the previous one returned; the drafts
never leave the artifacts' outputs but for the final stack. The batch dimension is traced
symbolic, so one artifact serves every size of the draft ladder (size 1 too: it binds the
artifact the larger sizes built, traced on two rows); its key holds what its code depends
on (the target's and the drafter's configs, each tensor's shape with its symbolic dims
masked; not k), and it is kept in the disk cache. Bound to a size, a graph must give the
eager rounds' drafts on that size's capture batch before it goes live.

Why a round and not all k rounds in one artifact: the unrolled rounds' compile grows with k
and their replay is no faster (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext
from rung.graphs.capture import ArtifactGraph, memory_identity
from rung.graphs.cpu_compiled.artifact_cache import bind_inputs
from rung.graphs.cpu_compiled.artifacts import (
    MIN_DYNAMIC_SIZE,
    ArtifactCompiler,
    compile_key,
    symbolic_dims,
)
from rung.graphs.cpu_compiled.direct_call import PlainSizes

logger = logging.getLogger(__name__)

_METADATA = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
# names whose leading dim is the request batch (``symbolic_dims``): the draft batch's
# views and its metadata
DRAFT_BATCHED = ("input.", "meta.")
# the inputs a round takes from the previous one: the draft batch's token ids and hidden rows
_IDS, _HIDDEN = "input.0", "input.1"


@dataclasses.dataclass(frozen=True)
class DraftRounds:
    """What the compiled backend needs of a drafter's graph besides the eager ``fn``."""

    round_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (ids [R], hidden [R, B], positions [R], *metadata) -> (token [R] int64, hidden [R, B])
    num_rounds: int
    module: nn.Module                 # the drafter: its parameters and buffers are named
    graph_key: dict[str, Any]         # what else the round's code depends on (its config)


class CompiledRounds(ArtifactGraph):
    """A drafter's FULL graph: ``num_rounds`` calls of one round's artifact, bound by name
    to the capture's tensors (the draft batch's views, the target's KV and weights)."""

    def __init__(self, static_inputs: Sequence[torch.Tensor], artifact: Callable[..., Any],
                 direct: Any, names: list[str], named: dict[str, torch.Tensor],
                 ctx: ForwardContext, num_rounds: int,
                 poison: Callable[[], None] | None) -> None:
        super().__init__(static_inputs, None, 0)
        # NOTE: both take a copy of the argument list (the direct call empties it)
        self.run = (direct.call if direct is not None
                    else functools.partial(_call_unpacked, artifact))
        self.size_of = direct.size_of if direct is not None else PlainSizes()
        self.args, sizes = bind_inputs(names, named)
        self.ids_at, self.hidden_at = names.index(_IDS), names.index(_HIDDEN)
        self.sizes = tuple((i, src, dim) for i, (src, dim) in sizes.items())
        metas = [getattr(m, "common", m) for m in ctx.attn_metadata.values()]
        seq_lens = {memory_identity(m.seq_lens) for m in metas}
        widths = {memory_identity(m.block_table): m.block_size for m in metas}
        tensors = [(i, memory_identity(a)) for i, a in enumerate(self.args)
                   if isinstance(a, torch.Tensor)]
        self.seq_lens_at = next((i for i, m in tensors if m in seq_lens), None)
        self.tables = tuple((i, widths[m]) for i, m in tensors if m in widths)
        self.num_rounds = num_rounds
        self.poison = poison            # debug mode: garbage into pad rows before each replay
        self.compile_s: float | None = None   # seconds to trace + compile (and check)
        self.load_s: float | None = None      # seconds to bind an artifact built earlier
        self.artifact_key: str | None = None  # shared by every size of the draft ladder

    def _run(self) -> torch.Tensor:
        """-> drafts [num_reqs_padded, num_rounds] int64."""
        args = list(self.args)
        if self.seq_lens_at is not None:
            # NOTE: seq_lens lives in host memory on CPU: reading its max costs no sync.
            # Each table is cut to the blocks the longest sequence covers, as the target's.
            max_seq_len = int(args[self.seq_lens_at].max())
            for i, block_size in self.tables:
                width = min(max(-(-max_seq_len // block_size), MIN_DYNAMIC_SIZE),
                            args[i].shape[1])
                args[i] = args[i][:, :width].contiguous()
        for i, src, dim in self.sizes:
            args[i] = self.size_of[args[src].shape[dim]]
        drafts = []
        for _ in range(self.num_rounds):
            ids, hidden = self.run(args.copy())[:2]
            args[self.ids_at], args[self.hidden_at] = ids, hidden
            drafts.append(ids)
        return torch.stack(drafts, dim=1)


def _call_unpacked(artifact: Callable[..., Any], args: list) -> Any:
    return artifact(*args)


def capture_compiled_draft(backend: ArtifactCompiler, desc: BatchExecutionDescriptor,
                           fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                           ctx: ForwardContext, tensors: Mapping[str, torch.Tensor],
                           rounds: DraftRounds, prefix: str, symbolic: bool
                           ) -> CompiledRounds:
    """The compiled graph of ``fn(*inputs)`` (a drafter's k rounds on ``desc``'s capture
    batch, in ``ctx``, which the caller has entered) from ``rounds.round_fn``'s artifact.
    ``tensors``: what else a round may read by a stable name (the target's KV caches and
    weights); the drafter's own go under ``prefix``. ``symbolic``: trace the batch dim
    symbolic (the draft ladder has a size of two rows or more; those are captured first).

    NOTE: a graph bound to an artifact (built now, earlier, or loaded from disk) must give
    the eager rounds' drafts on the capture batch; one that does not is dropped and built
    again (once), then a static one-size artifact is tried; RuntimeError if none does.
    """
    named = draft_tensors(inputs, ctx, tensors, {prefix: rounds.module})
    rows = desc.num_reqs_padded
    for batch in dict.fromkeys((symbolic, False)):
        dynamic = symbolic_dims(named, ctx, batch, DRAFT_BATCHED)
        key = backend.key(named, dynamic, {**compile_key(desc, ctx, batch), **rounds.graph_key})
        if batch and rows < MIN_DYNAMIC_SIZE:
            # NOTE: a one-row trace would specialise the batch dimension: bind the artifact
            # the larger sizes built (never drop it), else a static one of its own
            if backend.has_artifact(key):
                graph, _ = _bind(backend, key, fn, inputs, named, dynamic, ctx, rounds)
                if graph is not None:
                    return graph
            continue
        for _ in range(2):
            graph, loaded = _bind(backend, key, fn, inputs, named, dynamic, ctx, rounds)
            if graph is not None:
                return graph
            backend.forget(key)
            if not loaded:
                break
    raise RuntimeError(f"no compiled draft graph of {rows} requests reproduces the eager "
                       "draft rounds")


def _bind(backend: ArtifactCompiler, key: str, fn: Callable[..., torch.Tensor],
          inputs: Sequence[torch.Tensor], named: dict[str, torch.Tensor],
          dynamic: dict[str, tuple[int, ...]], ctx: ForwardContext, rounds: DraftRounds
          ) -> tuple[CompiledRounds | None, bool]:
    """(the graph of artifact ``key`` bound to ``named`` if it reproduces the eager rounds
    on the capture batch, else None; whether the artifact was built before this call)."""
    start = time.perf_counter()
    artifact, names, compile_s = backend.layer_artifact(key, rounds.round_fn, inputs, named,
                                                        dynamic)
    loaded = compile_s is None
    try:
        graph = CompiledRounds(inputs, artifact, backend.direct_call(key, named), names,
                               named, ctx, rounds.num_rounds, backend.poison_hook)
        got = graph._run()                       # [num_reqs_padded, k] int64
    except Exception as e:  # noqa: BLE001 - e.g. a dim the trace specialised after all
        logger.warning("compiled draft graph %s does not run on %d rows (%s: %s)", key,
                       inputs[0].shape[0], type(e).__name__, str(e).splitlines()[0])
        return None, loaded
    if not torch.equal(got, fn(*inputs)):
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
    """Every tensor a draft round may read, by a name stable across processes: the graph's
    inputs, each draft layer's metadata, ``tensors``, and each module's parameters and
    buffers under its prefix."""
    named = {f"input.{i}": t for i, t in enumerate(inputs)}
    for layer, meta in ctx.attn_metadata.items():
        common = getattr(meta, "common", meta)
        named.update({f"meta.{layer}.{f}": getattr(common, f) for f in _METADATA})
    named.update(tensors)
    for prefix, module in modules.items():
        named.update({f"{prefix}param.{n}": p for n, p in module.named_parameters()})
        named.update({f"{prefix}buffer.{n}": b for n, b in module.named_buffers()})
    return named
