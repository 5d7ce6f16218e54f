"""rung's torch.compile backend: split the FX graph at the attention op, wrap each piece.

PIECEWISE graphs capture the pieces between attention ops, one per padded token count;
attention runs eagerly between them and reads the forward context.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from rung.core.forward_context import current_descriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.capture import CapturedGraph


class PieceCapturer(Protocol):
    """What a piece needs of its graph manager."""

    capturing: bool               # a PIECEWISE capture is running: capture, don't replay

    def capture_piece(self, fn: Callable[..., Any], args: tuple) -> CapturedGraph:
        """Capture ``fn(*args)`` in the manager's backend, counting its memory."""

    def note_traced(self) -> None:
        """torch.compile has traced and split the model."""

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

    def __init__(self, fn: Callable[..., Any], manager: PieceCapturer) -> None:
        super().__init__()
        self.fn = fn
        self.manager = manager
        self.graphs: dict[int, CapturedGraph] = {}     # num_tokens_padded -> graph

    def forward(self, *args: Any) -> Any:
        desc = current_descriptor()
        if desc is None or desc.mode != CUDAGraphMode.PIECEWISE:
            return self.fn(*args)
        size = desc.num_tokens_padded
        if self.manager.capturing:
            graph = self.manager.capture_piece(self.fn, args)
            self.graphs[size] = graph
            return graph.outputs
        graph = self.graphs.get(size)
        return self.fn(*args) if graph is None else graph.replay(args)


class PiecewiseBackend:
    """The callable handed to torch.compile(backend=...)."""

    def __init__(self, manager: PieceCapturer, piece_compiler: str) -> None:
        self.manager = manager
        self.piece_compiler = piece_compiler

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        split, attention_pieces = split_at_attention(gm)
        names = [n for n, _ in split.named_children() if n not in attention_pieces]
        compiled = (piece_example_inputs(split, names, example_inputs)
                    if self.piece_compiler == "inductor" else {})
        for name in names:
            module = getattr(split, name)
            fn = compile_piece(module, compiled[name]) if name in compiled else module
            setattr(split, name, PiecewiseRunner(fn, self.manager))
        self.manager.note_traced()
        return split


def compile_piece(piece: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """One piece through inductor's compile entry point, as vLLM compiles its pieces.

    ``example_inputs``: the piece's arguments as met on the fake inputs dynamo traced
    with (fake tensors and SymInts), so the piece keeps the symbolic token count.
    """
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(piece, example_inputs)

    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        # NOTE: a piece with several outputs comes back as a list; callers (and capture
        # backends) expect the tuple the FX piece returns.
        return tuple(outputs) if isinstance(outputs, list) else outputs

    return run


class _PieceArguments(fx.Interpreter):
    """Runs the split graph on fake inputs, noting each named piece's arguments."""

    def __init__(self, split: fx.GraphModule, names: list[str]) -> None:
        super().__init__(split)
        self.names = set(names)
        self.seen: dict[str, list] = {}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        if target in self.names:
            self.seen[target] = list(args)
        return super().call_module(target, args, kwargs)


def piece_example_inputs(split: fx.GraphModule, names: list[str],
                         example_inputs: list) -> dict[str, list]:
    """piece name -> its example arguments, from dynamo's (fake) example inputs."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    # NOTE: dynamo hands lifted parameters and buffers over as real tensors
    fake_inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                   for t in example_inputs]
    interpreter = _PieceArguments(split, names)
    with fake_mode:
        interpreter.run(*fake_inputs)
    return interpreter.seen


def compile_model(model: nn.Module, manager: PieceCapturer, piece_compiler: str
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
