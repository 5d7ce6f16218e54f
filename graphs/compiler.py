"""rung's torch.compile backend: split the FX graph at the attention op, wrap each piece.

PIECEWISE graphs capture the pieces between attention ops, one per padded token count;
attention runs eagerly between them and reads the forward context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from rung.core.forward_context import current_descriptor
from rung.core.graph_mode import CUDAGraphMode

if TYPE_CHECKING:
    from rung.graphs.capture import CapturedGraph
    from rung.graphs.manager import GraphManager

_ATTENTION_TARGETS = ("rung.unified_attention", "rung::unified_attention")


def is_attention_node(node: fx.Node) -> bool:
    return node.op == "call_function" and any(
        name in str(node.target) for name in _ATTENTION_TARGETS)


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, set[str]]:
    """Split into pieces; attention calls get pieces of their own. Returns (graph, names of
    attention pieces)."""
    part, assignment, attention_parts = 0, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            part += 1
            assignment[node] = part
            attention_parts.add(part)
            part += 1
        else:
            assignment[node] = part
    split = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    return split, {f"submod_{p}" for p in attention_parts}


class PiecewiseRunner(nn.Module):
    """One non-attention piece: replays its graph for PIECEWISE batches of a captured size,
    runs directly otherwise (NONE batches, and inside FULL captures)."""

    def __init__(self, fn: Callable[..., Any], index: int, manager: GraphManager) -> None:
        super().__init__()
        self.fn = fn
        self.index = index
        self.manager = manager
        self.graphs: dict[int, CapturedGraph] = {}     # num_tokens_padded -> graph

    def forward(self, *args: Any) -> Any:
        desc = current_descriptor()
        if desc is None or desc.mode != CUDAGraphMode.PIECEWISE:
            return self.fn(*args)
        size = desc.num_tokens_padded
        if self.manager.capturing:
            graph = self.manager.capture_backend.capture(self.fn, args)
            self.graphs[size] = graph
            self.manager.note_piece(size, graph)
            return graph.outputs
        graph = self.graphs.get(size)
        return self.fn(*args) if graph is None else graph.replay(args)


class PiecewiseBackend:
    """The callable handed to torch.compile(backend=...)."""

    def __init__(self, manager: GraphManager, piece_compiler: str) -> None:
        self.manager = manager
        self.piece_compiler = piece_compiler
        self.num_pieces = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        split, attention_pieces = split_at_attention(gm)
        pieces = [(n, m) for n, m in split.named_children() if n not in attention_pieces]
        for index, (name, module) in enumerate(pieces):
            setattr(split, name, PiecewiseRunner(self._compile_piece(module), index,
                                                 self.manager))
        self.num_pieces = len(pieces)
        self.manager.note_traced()
        return split

    def _compile_piece(self, module: fx.GraphModule) -> Callable[..., Any]:
        if self.piece_compiler == "inductor":
            return torch.compile(module, backend="inductor", dynamic=True)
        return module


def compile_model(model: nn.Module, manager: GraphManager, piece_compiler: str
                  ) -> Callable[..., Any]:
    """model.forward(input_ids, positions) compiled with rung's piecewise backend."""
    backend = PiecewiseBackend(manager, piece_compiler)
    # NOTE: unspecialized Python floats (norm eps, scales) would become fresh 0-d tensors
    # on every call, which no captured graph can read from a stable address.
    torch._dynamo.config.specialize_float = True
    # NOTE: each engine's model is a new `self` for the same forward code object, so every
    # engine built in one process adds a cache entry; tests build dozens.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4096)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4096)
    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
