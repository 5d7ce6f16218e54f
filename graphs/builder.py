"""GraphBuilder: brings a ladder's graphs live one at a time, between serving steps.

The engine serves eagerly from its first step; before each step it calls ``advance``,
which makes at most one more graph live. Going live is a state change on the serving
thread only: a capture writes the runner's input buffers (a pad-only batch), so it never
overlaps a step, and a size's batches replay its graph from the next dispatch on.

Compiled CPU graphs cost an inductor compile each; ``advance`` never compiles while a
``Prefetch`` (a subprocess compiling the same artifacts into the disk cache) is running:
it binds an artifact once the cache holds it, and skips the step otherwise. Every bound
artifact must reproduce eager on its capture batch before it goes live.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.manager import CaptureRecord, GraphManager

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2      # how often a serving step looks for newly built artifacts


class Prefetch(Protocol):
    """Artifacts compiled elsewhere into the disk cache (a subprocess)."""

    def poll(self) -> int | None:
        """None while it runs, else its exit status."""

    def describe_failure(self) -> str:
        """Why it stopped early (its last lines of output)."""


class GraphBuilder:
    def __init__(self, manager: GraphManager, after: Callable[[], None] | None = None,
                 progress: Callable[[CaptureRecord], None] | None = None,
                 prefetch: Prefetch | None = None) -> None:
        self.manager = manager
        self.pending = _build_order(manager.dispatcher.capture_descriptors())
        self.num_graphs = len(self.pending)
        self._after = after              # e.g. a drafter's graphs, once the target's are live
        self._progress = progress
        self.prefetch = prefetch
        self.started = time.perf_counter()
        self.finished_s: float | None = None    # seconds from start until every graph was live
        self._prefetch_failed = False
        self._polled = float("-inf")

    @property
    def done(self) -> bool:
        return not self.pending and self._after is None

    def advance(self, may_compile: bool = False) -> CaptureRecord | None:
        """Make at most one graph live (the serving thread, between steps). Compiles only
        with ``may_compile`` or when no prefetch is building the artifacts."""
        if self.done:
            return None
        if not self.pending:
            if not may_compile and self._prefetching():
                return None      # NOTE: it compiles the drafter's artifacts too: bind those
            after, self._after = self._after, None
            after()
            self._finish()
            return None
        key = self._next(may_compile)
        if key is None:
            return None
        self.pending.remove(key)
        record = self.manager.capture(key)
        logger.info("graph %s %d live (%d/%d)%s", record.mode, record.num_tokens_padded,
                    self.num_graphs - len(self.pending), self.num_graphs, _cost(record))
        if self._progress is not None:
            self._progress(record)
        if self.done:
            self._finish()
        return record

    def _next(self, may_compile: bool) -> BatchExecutionDescriptor | None:
        now = time.perf_counter()
        if not may_compile and now - self._polled < POLL_INTERVAL_S:
            return None                 # NOTE: a poll stats the cache; not every step
        self._polled = now
        # NOTE: strictly in build order: a PIECEWISE key is always "ready" but its first
        # capture traces the whole model on the serving thread, so it waits for the FULL
        # graphs rather than delaying the first answers
        key = self.pending[0]
        if self.manager.is_ready(key):
            # NOTE: a serving step binds once nothing of inductor is left to import on
            # this thread (a cached wrapper library needs none)
            return key if may_compile or self.manager.prepared(key) else None
        if self.prefetch is not None and not may_compile:
            status = self.prefetch.poll()
            if status is None:
                return None             # still compiling elsewhere: serve eagerly meanwhile
            if status != 0 and not self._prefetch_failed:
                self._prefetch_failed = True
                logger.warning("background graph compile failed (exit %d): %s; the %d sizes "
                               "not built yet compile on the serving thread, between steps",
                               status, self.prefetch.describe_failure(), len(self.pending))
        return key

    def _prefetching(self) -> bool:
        """Whether a prefetch still compiles (polled at most every POLL_INTERVAL_S)."""
        if self.prefetch is None:
            return False
        now = time.perf_counter()
        if now - self._polled < POLL_INTERVAL_S:
            return True
        self._polled = now
        return self.prefetch.poll() is None

    def wait(self, timeout: float | None = None) -> bool:
        """Bring every graph live now (compiling here if need be, never twice: artifacts
        a prefetch is building are waited for). True when all are live."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self.done:
            if deadline is not None and time.perf_counter() > deadline:
                return False
            prefetching = self.prefetch is not None and self.prefetch.poll() is None
            if self.advance(may_compile=not prefetching) is None and prefetching:
                time.sleep(0.05)
        return True

    def status(self) -> dict:
        """Which ladder sizes are live and which are still being built."""
        def sizes(keys):
            return sorted({f"{k.mode.name}:{k.num_tokens_padded}" for k in keys})
        return {"live": sizes(self.manager.dispatcher.live), "pending": sizes(self.pending),
                "done": self.done, "seconds_to_all_live": self.finished_s}

    def _finish(self) -> None:
        self.finished_s = time.perf_counter() - self.started
        logger.info("all %d graphs live %.1f s after start-up", self.num_graphs,
                    self.finished_s)


def _build_order(keys: list[BatchExecutionDescriptor]) -> list[BatchExecutionDescriptor]:
    """FULL graphs before PIECEWISE ones (a PIECEWISE capture first traces the model on
    the serving thread), smallest size first (the batches a first user sends)."""
    return sorted(keys, key=lambda k: (k.mode == CUDAGraphMode.PIECEWISE, k.num_tokens_padded,
                                       k.uniform_query_len is None))


def _cost(record: CaptureRecord) -> str:
    if record.compile_s is not None:
        return f", compiled in {record.compile_s:.1f} s"
    if record.load_s is not None:
        return f", bound a built artifact in {record.load_s:.1f} s"
    return f", captured in {record.seconds * 1e3:.0f} ms"
