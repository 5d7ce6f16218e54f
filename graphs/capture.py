"""Capture backends with one interface: CUDA graphs, and their CPU emulation."""

from __future__ import annotations

import gc
from typing import Callable, Sequence

import torch

from rung.core.errors import ContractError

Outputs = torch.Tensor | tuple


class CapturedGraph:
    """A captured callable. ``replay(inputs)`` returns the static outputs."""

    def __init__(self, static_inputs: Sequence[torch.Tensor], outputs: Outputs,
                 nbytes: int) -> None:
        self.input_ptrs = [_identity(t) for t in static_inputs]
        self.outputs = outputs
        self.nbytes = nbytes          # pool bytes (CUDA) or static buffer bytes (CPU)
        self.num_kernel_nodes: int | None = None

    def check_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        got = [_identity(t) for t in inputs]
        if got != self.input_ptrs:
            raise ContractError(
                "graph replay with inputs at other addresses or shapes than at capture: "
                f"{[i for i, (a, b) in enumerate(zip(got, self.input_ptrs)) if a != b]}")

    def replay(self, inputs: Sequence[torch.Tensor]) -> Outputs:
        raise NotImplementedError


def _identity(t: object) -> tuple:
    if isinstance(t, torch.Tensor):
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
    return ("const", t)


def _flat(outputs: Outputs) -> list[torch.Tensor]:
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in items if isinstance(t, torch.Tensor)]


class EmulatedGraph(CapturedGraph):
    def __init__(self, fn: Callable[..., Outputs], static_inputs, outputs, nbytes,
                 poison: Callable[[], None] | None) -> None:
        super().__init__(static_inputs, outputs, nbytes)
        self.fn = fn
        self.poison = poison

    def replay(self, inputs):
        self.check_inputs(inputs)
        if self.poison is not None:
            self.poison()
        fresh = self.fn(*inputs)
        for static, new in zip(_flat(self.outputs), _flat(fresh)):
            static.copy_(new)
        return self.outputs


class EmulatedGraphBackend:
    """CPU twin of CUDA graphs: same rules (static inputs checked for identity, outputs in
    static buffers), and an optional poison hook run before every replay."""

    name = "emulated"

    def __init__(self, poison_hook: Callable[[], None] | None = None) -> None:
        self.poison_hook = poison_hook

    def capture(self, fn: Callable[..., Outputs], inputs: Sequence) -> CapturedGraph:
        fn(*inputs)                                       # warm-up, as on CUDA
        outputs = fn(*inputs)
        outputs = tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs) \
            if isinstance(outputs, tuple) else outputs.clone()
        nbytes = sum(t.numel() * t.element_size() for t in _flat(outputs))
        return EmulatedGraph(fn, inputs, outputs, nbytes, self.poison_hook)


class CudaGraph(CapturedGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph, static_inputs, outputs, nbytes) -> None:
        super().__init__(static_inputs, outputs, nbytes)
        self.graph = graph

    def replay(self, inputs):
        self.check_inputs(inputs)
        self.graph.replay()
        return self.outputs


class CudaGraphBackend:
    """torch.cuda.CUDAGraph with one memory pool shared by every size (target and draft)."""

    name = "cuda"

    def __init__(self, pool=None) -> None:
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[..., Outputs], inputs: Sequence) -> CapturedGraph:
        torch.cuda.synchronize()
        fn(*inputs)                                       # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved()
        gc_was_enabled = gc.isenabled()
        gc.disable()                                      # NOTE: gc during capture can free
        try:                                              # tensors the graph still uses
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn(*inputs)
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        captured = CudaGraph(graph, inputs, outputs, torch.cuda.memory_reserved() - before)
        captured.num_kernel_nodes = _count_kernel_nodes(graph)
        return captured


def _count_kernel_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Kernel nodes in a captured graph, when cuda-python is installed."""
    try:
        from cuda.bindings import runtime as cudart  # type: ignore
    except ImportError:
        return None
    try:
        raw = graph.raw_cuda_graph()
        err, nodes, count = cudart.cudaGraphGetNodes(raw, None, 0)
        err, nodes, count = cudart.cudaGraphGetNodes(raw, None, count)
        kernel = cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel
        return sum(1 for n in nodes if cudart.cudaGraphNodeGetType(n)[1] == kernel)
    except Exception:  # noqa: BLE001 - a counting aid, never a reason to fail capture
        return None


def make_capture_backend(name: str, device: torch.device,
                         poison_hook: Callable[[], None] | None):
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "emulated"
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError(f"graph_backend 'cuda' needs a CUDA device, got {device}")
        return CudaGraphBackend()
    if name == "emulated":
        return EmulatedGraphBackend(poison_hook)
    raise ValueError(f"graph_backend {name!r} not in ('auto', 'cuda', 'emulated')")
