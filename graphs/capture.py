"""The capture-backend interface (`CaptureBackend`) and its two plain backends: CUDA graphs,
and their CPU emulation. Compiled CPU graphs implement the same interface in
graphs/cpu_compiled/; the GraphManager never asks which backend it has."""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import torch

from rung.core.errors import ContractError

Outputs = torch.Tensor | tuple

logger = logging.getLogger(__name__)


class ForwardOutput(NamedTuple):
    """What a target forward (eager, or a graph's replay) hands the runner."""

    hidden: torch.Tensor            # [num_tokens_padded, H] the last hidden states
    # [num_rows, vocab] fp32: the logits of the rows the runner asked for, when the forward
    # ends in the lm head (per-layer compiled graphs); None: the runner's lm head computes them
    logits: torch.Tensor | None


class CapturedGraph:
    """A captured callable. ``replay(inputs)`` returns the static outputs; ``forward`` is a
    target graph's replay as the runner takes it."""

    # what building it cost (compiled CPU graphs; None elsewhere): trace + compile seconds,
    # seconds to load a built artifact, and the key of its artifact (sizes may share one)
    compile_s: float | None = None
    load_s: float | None = None
    artifact_key: str | None = None

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

    def forward(self, inputs: Sequence[torch.Tensor], rows: torch.Tensor) -> ForwardOutput:
        """The replay of a target graph (its outputs: the hidden states) and the logits of
        hidden[rows] [len(rows)] when the graph computes them; this one does not."""
        return ForwardOutput(self.replay(inputs), None)


class ArtifactGraph(CapturedGraph):
    """A CPU graph whose replay calls compiled code on the capture's own buffers
    (``_run``). ``poison``, set in debug mode: a replay first checks that its inputs are
    the capture's, then garbles their pad rows."""

    poison: Callable[[], None] | None = None

    def replay(self, inputs: Sequence[torch.Tensor]) -> Outputs:
        if self.poison is not None:
            self.check_inputs(inputs)
            self.poison()
        return self._run()

    def _run(self) -> Outputs:
        raise NotImplementedError


def memory_identity(t: torch.Tensor) -> tuple:
    """What a view reads: two view objects of one buffer slice compare equal."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _identity(t: object) -> tuple:
    return memory_identity(t) if isinstance(t, torch.Tensor) else ("const", t)


def _flat(outputs: Outputs) -> list[torch.Tensor]:
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in items if isinstance(t, torch.Tensor)]


class EmulatedGraph(CapturedGraph):
    def __init__(self, fn: Callable[..., Outputs], static_inputs, outputs, nbytes,
                 poison: Callable[[], None] | None) -> None:
        super().__init__(static_inputs, outputs, nbytes)
        self.fn = fn
        self.poison = poison

    def rebind(self, inputs: Sequence[torch.Tensor]) -> "EmulatedGraph":
        """This graph replayed on ``inputs`` (same shapes) instead of its capture's."""
        return EmulatedGraph(self.fn, inputs, self.outputs, self.nbytes, self.poison)

    def replay(self, inputs):
        self.check_inputs(inputs)
        if self.poison is not None:
            self.poison()
        fresh = self.fn(*inputs)
        for static, new in zip(_flat(self.outputs), _flat(fresh)):
            static.copy_(new)
        return self.outputs


class GraphHost(Protocol):
    """What a capture backend may ask of the GraphManager it captures for."""

    runner: Any                  # the GraphRunner: model, max_num_reqs, dummy_batch
    symbolic_batch: bool         # compiled CPU graphs: share a symbolic-batch artifact
    per_layer: bool              # compiled CPU graphs: one artifact per decoder-layer kind

    def full_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                     *metadata: torch.Tensor) -> torch.Tensor:
        """The forward a FULL graph captures."""

    def model_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                      *metadata: torch.Tensor) -> torch.Tensor:
        """The model's own forward, for a backend that traces it whole."""

    def full_inputs(self, ids: torch.Tensor, positions: torch.Tensor,
                    ctx: Any) -> list[torch.Tensor]:
        """A FULL graph's flat inputs: ids, positions, then each KV group's metadata."""

    def named_tensors(self, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor a traced forward may read, by a name stable across processes."""


class CaptureBackend(Protocol):
    """What the GraphManager asks of a capture backend.

    ``name``, ``auto_startup`` (what graph_startup="auto" means), ``serving_thread_captures``
    (every capture on the serving thread), ``replay_reads_context`` (a FULL replay reads the
    forward context: it re-runs the forward), ``pool_bytes``, ``kernel_nodes_note``.
    """

    name: str
    auto_startup: str
    serving_thread_captures: bool
    replay_reads_context: bool
    pool_bytes: int

    def capture_batch(self) -> contextlib.AbstractContextManager[CaptureBatch]:
        """The captures of one graph key."""

    def capture(self, fn: Callable[..., Outputs], inputs: Sequence) -> CapturedGraph:
        """``fn(*inputs)`` as a graph (a PIECEWISE piece, or a FULL graph's forward)."""

    def capture_full(self, host: GraphHost, desc: Any, ctx: Any, inputs: list[torch.Tensor],
                     scratch: bool = False, pause: Callable[[], None] | None = None
                     ) -> CapturedGraph:
        """The target's FULL graph of ``desc`` on ``inputs`` (in ``ctx``, entered);
        ``scratch``: built off the serving thread, with its throttle ``pause``."""

    def rebind_full(self, host: GraphHost, graph: CapturedGraph, inputs: list[torch.Tensor],
                    ctx: Any) -> CapturedGraph:
        """``graph`` (built on a scratch batch) bound to ``inputs``, the serving buffers."""

    def capture_draft(self, host: GraphHost, desc: Any, fn: Callable[..., Outputs],
                      inputs: Sequence[torch.Tensor], rounds: Any, prefix: str
                      ) -> CapturedGraph:
        """A drafter's FULL graph of ``desc``: ``fn(*inputs)``, or built from ``rounds``
        (one draft round's forward) where the backend compiles one."""

    def is_ready(self, host: GraphHost, key: Any) -> bool:
        """Whether capturing ``key`` now costs no compile."""

    def prepared(self, host: GraphHost, key: Any) -> bool:
        """Whether capturing ``key`` now imports nothing on the calling thread."""


class PlainFullGraphs:
    """The FULL-graph half of `CaptureBackend` for backends that capture the forward itself
    (CUDA graphs and their emulation): nothing to compile, nothing to prepare."""

    replay_reads_context = False

    def capture_full(self, host: GraphHost, desc: Any, ctx: Any, inputs: list[torch.Tensor],
                     scratch: bool = False, pause: Callable[[], None] | None = None
                     ) -> CapturedGraph:
        return self.capture(host.full_forward, inputs)

    def rebind_full(self, host: GraphHost, graph: CapturedGraph, inputs: list[torch.Tensor],
                    ctx: Any) -> CapturedGraph:
        return graph.rebind(inputs)

    def capture_draft(self, host: GraphHost, desc: Any, fn: Callable[..., Outputs],
                      inputs: Sequence[torch.Tensor], rounds: Any, prefix: str
                      ) -> CapturedGraph:
        return self.capture(fn, inputs)

    def is_ready(self, host: GraphHost, key: Any) -> bool:
        return True

    def prepared(self, host: GraphHost, key: Any) -> bool:
        return True


class CaptureBatch:
    """The captures of one graph key (a FULL graph, or every piece of a PIECEWISE size):
    ``nbytes``, what they added to the CUDA graph pool, set at its end (None on CPU)."""

    nbytes: int | None = None


class EmulatedGraphBackend(PlainFullGraphs):
    """CPU twin of CUDA graphs: same rules (static inputs checked for identity, outputs in
    static buffers), and an optional poison hook run before every replay.

    NOTE: a replay re-runs the forward, which reads the forward context."""

    replay_reads_context = True

    name = "emulated"
    # start-up policy (read by GraphStartup and GraphManager; a test may force CUDA's):
    # what graph_startup="auto" means, and whether captures stay on the serving thread
    auto_startup = "blocking"        # the tests' oracle: every graph live before serving
    serving_thread_captures = False

    def __init__(self, poison_hook: Callable[[], None] | None = None) -> None:
        self.poison_hook = poison_hook
        self.pool_bytes = 0           # static output buffers held, all graphs
        self.kernel_nodes_note = "no CUDA graph: nothing to count"

    @contextlib.contextmanager
    def capture_batch(self) -> Iterator[CaptureBatch]:
        """The captures of one graph key (nothing to share on CPU)."""
        yield CaptureBatch()

    def capture(self, fn: Callable[..., Outputs], inputs: Sequence) -> CapturedGraph:
        fn(*inputs)                                       # warm-up, as on CUDA
        outputs = fn(*inputs)
        outputs = tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs) \
            if isinstance(outputs, tuple) else outputs.clone()
        nbytes = sum(t.numel() * t.element_size() for t in _flat(outputs))
        self.pool_bytes += nbytes
        return EmulatedGraph(fn, inputs, outputs, nbytes, self.poison_hook)


class CudaGraph(CapturedGraph):
    """A captured CUDA graph. ``poison``, set in debug mode: a replay first checks that its
    inputs are the capture's (a Python compare per input: debug mode only), then garbles
    their pad rows, as an emulated replay does."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_inputs, outputs, nbytes,
                 poison: Callable[[], None] | None = None) -> None:
        super().__init__(static_inputs, outputs, nbytes)
        self.graph = graph
        self.poison = poison

    def replay(self, inputs):
        if self.poison is not None:
            self.check_inputs(inputs)
            self.poison()
        self.graph.replay()
        return self.outputs


class PoolMeter:
    """Capture memory: what each capture added to the shared graph pool, and its total.

    NOTE: ``torch.cuda.graph`` empties the allocator cache on entry, so a change in
    reserved memory read without emptying it first comes out 0 or negative. Every reading
    here empties the cache first: what stays reserved is live tensors and graph pools.
    The pool is shared, so a later graph may reuse blocks an earlier one freed and add
    nothing: its figure is 0, and the figures sum to what captures added to the pool.
    """

    def __init__(self, read_reserved: Callable[[], int],
                 read_pool: Callable[[], int] | None = None) -> None:
        self._read_reserved = read_reserved
        self._read_pool = read_pool
        self.per_graph: list[int] = []

    def measure(self, capture: Callable[[], "CudaGraph"]) -> "CudaGraph":
        self.begin()
        graph = capture()
        graph.nbytes = self.end()
        return graph

    def begin(self) -> None:
        """Before the captures of one graph key (``end`` reads what they added)."""
        self._before = self._read_reserved()

    def end(self) -> int:
        nbytes = self._read_reserved() - self._before
        self.per_graph.append(nbytes)
        return nbytes

    @property
    def total_bytes(self) -> int:
        """The pool's own segments when they can be read, else the sum of the growths."""
        return self._read_pool() if self._read_pool is not None else sum(self.per_graph)


def _reserved_after_emptying() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def pool_bytes(segments: Sequence[dict], pool: tuple[int, int]) -> int:
    """Bytes of the segments (``torch.cuda.memory_snapshot()``) that belong to ``pool``."""
    return sum(seg["total_size"] for seg in segments
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


class CudaGraphBackend(PlainFullGraphs):
    """torch.cuda.CUDAGraph with one memory pool shared by every size (target and draft).

    Warm-up and capture run on ONE side stream: library state made lazily per stream
    (cuBLAS workspaces) is created by the warm-up, not inside the first capture.
    """

    name = "cuda"
    # NOTE: "auto" starts in the background (a capture costs the serving thread ms, not
    # the seconds a CPU compile does), and every capture runs on the serving thread,
    # ordered with the serving stream (it writes the runner's input buffers)
    auto_startup = "background"
    serving_thread_captures = True

    def __init__(self, pool=None, poison_hook: Callable[[], None] | None = None) -> None:
        self.poison_hook = poison_hook
        self._batch: CaptureBatch | None = None      # the capture batch in progress
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.meter = PoolMeter(_reserved_after_emptying,
                               lambda: pool_bytes(torch.cuda.memory_snapshot(), self.pool))
        self.kernel_nodes_note: str | None = None     # why counts are missing, if they are

    @property
    def pool_bytes(self) -> int:
        return self.meter.total_bytes

    @contextlib.contextmanager
    def capture_batch(self) -> Iterator[CaptureBatch]:
        """The captures of one graph key share one device sync and one allocator flush
        (the pool meter's reading, before and after): a PIECEWISE size's 30-odd pieces
        stall the serving thread once, not once per piece (``torch.cuda.graph`` syncs
        and empties the cache on every entry; captures here call capture_begin
        themselves). Nested batches are one."""
        if self._batch is not None:
            yield self._batch
            return
        batch = self._batch = CaptureBatch()
        self.meter.begin()                     # synchronize + empty_cache, once
        try:
            yield batch
        finally:
            self._batch = None
        batch.nbytes = self.meter.end()

    def capture(self, fn: Callable[..., Outputs], inputs: Sequence) -> CapturedGraph:
        if self._batch is None:
            with self.capture_batch() as batch:
                graph = self.capture(fn, inputs)
            graph.nbytes = batch.nbytes
            return graph
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                fn(*inputs)                               # warm-up, on the capture stream
            # NOTE: no sync between warm-up and capture: both are on the capture stream,
            # in order, and the capture allocates from its pool, not the warm-up's blocks
            captured = self._capture(fn, inputs)
        except BaseException:
            # NOTE: a failed capture is dropped and serving goes on (GraphBuilder): the
            # serving stream must still see whatever the capture stream wrote
            torch.cuda.current_stream().wait_stream(self.stream)
            raise
        captured.num_kernel_nodes = self._count_nodes(captured.graph)
        return captured

    def _capture(self, fn: Callable[..., Outputs], inputs: Sequence) -> "CudaGraph":
        # NOTE: keep_graph keeps the cudaGraph_t so its kernel nodes can be counted;
        # instantiate() then builds the executable now, not at the first replay.
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        gc_was_enabled = gc.isenabled()
        gc.disable()                                      # NOTE: gc during capture can free
        try:                                              # tensors the graph still uses
            with torch.cuda.stream(self.stream):
                graph.capture_begin(self.pool)
                try:
                    outputs = fn(*inputs)
                finally:
                    graph.capture_end()
        finally:
            if gc_was_enabled:
                gc.enable()
        graph.instantiate()
        torch.cuda.current_stream().wait_stream(self.stream)
        return CudaGraph(graph, inputs, outputs, 0, self.poison_hook)

    def _count_nodes(self, graph: torch.cuda.CUDAGraph) -> int | None:
        try:
            from cuda.bindings import runtime as cudart  # type: ignore
        except ImportError as exc:
            return self._no_count(f"cuda-bindings is not importable ({exc})")
        try:
            return count_kernel_nodes(graph.raw_cuda_graph(), cudart)
        except Exception as exc:  # noqa: BLE001 - a counting aid, never a reason to fail
            return self._no_count(f"{type(exc).__name__}: {exc}")

    def _no_count(self, why: str) -> None:
        if self.kernel_nodes_note is None:
            logger.warning("kernel-node counts unavailable: %s", why)
        self.kernel_nodes_note = why
        return None


def count_kernel_nodes(raw_graph: int, cudart: Any) -> int:
    """Kernel nodes of a cudaGraph_t, through cuda-bindings' runtime module.

    cuda-bindings' ``cudaGraphGetNodes(graph, numNodes=0)`` returns (err, nodes, count):
    first the count, then that many nodes. ``raw_graph`` is the address torch's
    ``raw_cuda_graph()`` returns, wrapped in the bindings' handle type.
    """
    graph = cudart.cudaGraph_t(raw_graph)
    err, _, num_nodes = cudart.cudaGraphGetNodes(graph, numNodes=0)
    _check(cudart, err, "cudaGraphGetNodes")
    err, nodes, _ = cudart.cudaGraphGetNodes(graph, numNodes=num_nodes)
    _check(cudart, err, "cudaGraphGetNodes")
    kernel = cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel
    count = 0
    for node in nodes[:num_nodes]:
        err, node_type = cudart.cudaGraphNodeGetType(node)
        _check(cudart, err, "cudaGraphNodeGetType")
        count += node_type == kernel
    return count


def _check(cudart: Any, err: Any, call: str) -> None:
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{call} returned {err}")
