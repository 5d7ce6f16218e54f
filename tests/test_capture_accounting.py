"""CUDA capture bookkeeping, held on CPU with fakes: pool memory per graph and in total,
and kernel-node counts through cuda-bindings' calling convention."""

import logging
import types

import pytest

from rung.graphs.capture import CudaGraphBackend, PoolMeter, count_kernel_nodes, pool_bytes


class _FakeAllocator:
    """Reserved memory = live tensors + cached free blocks + the graph pool's segments."""

    def __init__(self) -> None:
        self.live, self.cached, self.pool, self.pool_free = 1000, 0, 0, 0

    def reserved(self) -> int:
        return self.live + self.cached + self.pool

    def empty_cache(self) -> None:
        self.cached = 0                           # graph pools keep their segments

    def capture(self, need: int) -> types.SimpleNamespace:
        """torch.cuda.graph: empties the cache, then allocates ``need`` in the pool,
        reusing what earlier graphs freed there first."""
        self.empty_cache()
        reuse = min(need, self.pool_free)
        self.pool_free -= reuse
        self.pool += need - reuse
        self.pool_free += need // 2               # the graph's temporaries, freed at its end
        return types.SimpleNamespace(nbytes=None)


def _reserved_after_emptying(alloc: _FakeAllocator):
    return lambda: (alloc.empty_cache(), alloc.reserved())[1]


def test_each_graph_reports_what_it_added_to_the_shared_pool():
    alloc = _FakeAllocator()
    meter = PoolMeter(_reserved_after_emptying(alloc), lambda: alloc.pool)
    figures = []
    for need in (4096, 1024, 512, 8192):           # largest first, then a bigger one
        alloc.cached += 3000                         # warm-up leaves freed blocks cached
        pool_before = alloc.pool
        graph = meter.measure(lambda need=need: alloc.capture(need))
        figures.append(graph.nbytes)
        assert graph.nbytes == alloc.pool - pool_before
    assert figures == [4096, 0, 0, 8192 - 1280]     # smaller ones reuse freed blocks
    assert sum(figures) == meter.total_bytes == alloc.pool


def test_a_reading_that_keeps_the_cache_would_go_negative():
    """The failure the meter exists to avoid (reserved read without emptying first)."""
    alloc = _FakeAllocator()
    meter = PoolMeter(alloc.reserved)
    alloc.cached += 3000
    graph = meter.measure(lambda: alloc.capture(1024))
    assert graph.nbytes < 0


def test_total_without_a_pool_reader_sums_the_growths():
    readings = iter([10, 110, 110, 110, 110, 150])
    meter = PoolMeter(lambda: next(readings))
    for _ in range(3):
        meter.measure(lambda: types.SimpleNamespace(nbytes=None))
    assert meter.per_graph == [100, 0, 40] and meter.total_bytes == 140


def test_pool_bytes_counts_only_the_pools_segments():
    segments = [{"total_size": 2 << 20, "segment_pool_id": (0, 0)},
                {"total_size": 4 << 20, "segment_pool_id": (1, 3)},
                {"total_size": 1 << 20, "segment_pool_id": [1, 3]},
                {"total_size": 8 << 20}]
    assert pool_bytes(segments, (1, 3)) == 5 << 20
    assert pool_bytes(segments, (2, 0)) == 0


def _fake_cudart(types_of_nodes: list[str], fail: bool = False) -> types.SimpleNamespace:
    ok, bad = "cudaSuccess", "cudaErrorInvalidValue"
    node_type = types.SimpleNamespace(cudaGraphNodeTypeKernel="kernel")

    def get_nodes(graph, numNodes=0):             # cuda-bindings' signature
        assert graph == ("cudaGraph_t", 0xABC)
        if numNodes == 0:
            return (bad if fail else ok), None, len(types_of_nodes)
        return ok, list(range(len(types_of_nodes))) + [None] * (numNodes - len(types_of_nodes)), \
            len(types_of_nodes)

    return types.SimpleNamespace(
        cudaGraph_t=lambda address: ("cudaGraph_t", address),
        cudaGraphGetNodes=get_nodes, cudaGraphNodeType=node_type,
        cudaGraphNodeGetType=lambda node: (ok, types_of_nodes[node]),
        cudaError_t=types.SimpleNamespace(cudaSuccess=ok))


def test_kernel_nodes_counted_with_the_bindings_signature():
    cudart = _fake_cudart(["kernel", "memset", "kernel", "memcpy", "kernel"])
    assert count_kernel_nodes(0xABC, cudart) == 3


def test_kernel_node_errors_raise_with_the_call_named():
    with pytest.raises(RuntimeError, match="cudaGraphGetNodes returned cudaErrorInvalidValue"):
        count_kernel_nodes(0xABC, _fake_cudart(["kernel"], fail=True))


def test_missing_counts_say_why_once(caplog, monkeypatch):
    backend = object.__new__(CudaGraphBackend)       # no CUDA here: only the counting path
    backend.kernel_nodes_note = None
    graph = types.SimpleNamespace(raw_cuda_graph=lambda: 0xABC)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings", None)
    with caplog.at_level(logging.WARNING, logger="rung.graphs.capture"):
        assert backend._count_nodes(graph) is None
        assert backend._count_nodes(graph) is None
    assert "cuda-bindings is not importable" in backend.kernel_nodes_note
    assert len([r for r in caplog.records if "kernel-node counts" in r.message]) == 1
