"""GraphBuilder: brings a ladder's graphs live one at a time, between serving steps.

The engine serves eagerly from its first step; before each step it calls ``advance``,
which makes at most one more graph live. Going live is a state change on the serving
thread only, and a size's batches replay its graph from the next dispatch on.

FULL CPU graphs (``GraphManager.builds_off_thread``) are built by a worker thread: load
(or compile), bind to a scratch capture batch, check against eager there,
bind to the serving buffers; ``advance`` then only swaps a ready graph into the dispatch
table. A size that fails its check never goes live: its batches stay eager. The worker
builds first the size the last batch ran eagerly for want of (``Dispatcher.missed``),
else the smallest; while steps run it works at most half the time (its Python takes the
GIL a step needs), flat out while the engine is idle. That duty cycle is its low priority,
not a niceness: a niced thread on a loaded machine is descheduled while it holds the GIL,
and the serving thread waits for it (docs/performance.md: worse worst steps, a longer
switch-over). Other graphs
(CUDA, PIECEWISE pieces, a drafter's) are captured by ``advance`` itself: a capture
writes the runner's input buffers (a pad-only batch), so it never overlaps a step.

Compiled CPU graphs cost an inductor compile each; nothing compiles while a ``Prefetch``
(a subprocess compiling the same artifacts into the disk cache) is running: a graph is
built once the cache holds its artifacts. Every bound artifact must reproduce eager on
its capture batch before it goes live.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from typing import Callable, Protocol

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.manager import CaptureRecord, GraphManager, ReadyGraph

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2      # how often a serving step looks for newly built artifacts
IDLE_S = 0.2               # no step for this long (and 2 step intervals): the engine is idle


class Prefetch(Protocol):
    """Artifacts compiled elsewhere into the disk cache (a subprocess)."""

    def poll(self) -> int | None:
        """None while it runs, else its exit status."""

    def describe_failure(self) -> str:
        """Why it stopped early (its last lines of output)."""


class GraphBuilder:
    def __init__(self, manager: GraphManager, after: Callable[[], None] | None = None,
                 progress: Callable[[CaptureRecord], None] | None = None,
                 prefetch: Prefetch | None = None, off_thread: bool = False,
                 largest_first: bool = False) -> None:
        """``off_thread``: FULL graphs are built by a worker thread (``_Worker``), where
        the manager can (``builds_off_thread``); ``largest_first``: each mode's sizes are
        captured largest first (a blocking CUDA start: smaller graphs reuse the pool
        blocks larger ones freed)."""
        self.manager = manager
        self.pending = _build_order(manager.dispatcher.capture_descriptors(), largest_first)
        self.num_graphs = len(self.pending)
        self._after = after              # e.g. a drafter's graphs, once the target's are live
        self._progress = progress
        self.prefetch = prefetch
        self.started = time.perf_counter()
        self.finished_s: float | None = None    # seconds from start until every graph was live
        self._prefetch_failed = False
        self._polled = float("-inf")
        self._worker: _Worker | None = None
        self._stepped = False            # a step has followed an advance
        if off_thread and manager.builds_off_thread:
            keys = [k for k in self.pending if k.mode == CUDAGraphMode.FULL]
            if keys:
                self._worker = _Worker(manager, keys, prefetch)

    @property
    def off_thread(self) -> bool:
        """Whether a worker thread builds the FULL graphs."""
        return self._worker is not None

    @property
    def done(self) -> bool:
        return not self.pending and self._after is None

    def advance(self, may_compile: bool = False, stepping: bool = True
                ) -> CaptureRecord | None:
        """Make at most one graph live (the serving thread, between steps; ``stepping``:
        a step follows). Compiles only with ``may_compile`` or when no prefetch is building
        the artifacts."""
        if self.done:
            return None
        if self._worker is not None:
            if stepping:
                self._worker.note_step(self._missed())
            ready = self._worker.take()
            if ready is not None:
                return self._go_live(ready)
            if not self._worker.finished:
                return None
            self._worker = None      # NOTE: what it left (not built yet): on this thread
        if stepping and not self._stepped:
            # NOTE: the first step of a background start runs no capture (nor the trace a
            # capture may start): its batch is a user's first request, served eagerly
            self._stepped = True
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
        try:
            record = self.manager.capture(key)
        except Exception as e:  # noqa: BLE001 - one size lost, serving goes on eagerly
            logger.warning("graph %s %d does not go live: capture failed: %s: %s; batches "
                           "of its size run eagerly", key.mode.name, key.num_tokens_padded,
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            if self.done:
                self._finish()
            return None
        return self._went_live(record)

    def _missed(self) -> BatchExecutionDescriptor | None:
        """The pending graph the last batch ran eagerly for want of, if any."""
        dispatcher = self.manager.dispatcher
        missed, dispatcher.missed = dispatcher.missed, None
        if missed is None:
            return None
        uniform, size = missed
        return next((k for k in self.pending if k.num_tokens_padded == size
                     and (k.uniform_query_len is not None) == uniform), None)

    def _go_live(self, ready: ReadyGraph | tuple[BatchExecutionDescriptor, str]
                 ) -> CaptureRecord | None:
        """A graph the worker built: swapped in; or why it failed: its size stays eager."""
        if isinstance(ready, tuple):
            key, why = ready
            self.pending.remove(key)
            logger.warning("graph %s %d does not go live: %s; batches of its size run "
                           "eagerly", key.mode.name, key.num_tokens_padded, why)
            if self.done:
                self._finish()
            return None
        self.pending.remove(ready.key)
        self.manager.go_live(ready)
        return self._went_live(ready.record)

    def _went_live(self, record: CaptureRecord) -> CaptureRecord:
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
            building = self._worker is not None and not self._worker.finished
            if self.advance(not prefetching, stepping=False) is None and (prefetching
                                                                      or building):
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


class _Worker:
    """A thread that builds FULL graphs (``GraphManager.build``), throttled while steps
    run, into a queue the serving thread takes them from (``take``): first the one the
    serving thread last asked for (``note_step``), else in order. It waits for a running
    prefetch to put a graph's artifacts in the cache, and stops at the first graph whose
    artifacts nobody is building: the serving thread then takes over."""

    def __init__(self, manager: GraphManager, keys: list[BatchExecutionDescriptor],
                 prefetch: Prefetch | None) -> None:
        self._manager, self._keys, self._prefetch = manager, keys, prefetch
        # set by the serving thread (note_step), read by the worker: plain attributes
        self._wanted: BatchExecutionDescriptor | None = None
        self._last_step = float("-inf")        # time.monotonic() of the last step
        self._step_interval = 0.0              # between the last two steps
        self._resumed = 0.0                    # when the worker last started working
        self._stop = threading.Event()
        # a built graph, or (its key, why it failed its build or check)
        self._built: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()          # set once nothing more will be queued
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="rung-graph-builder")
        self._thread.start()
        # NOTE: stopped (at its next layer) before the interpreter exits: a daemon thread
        # still inside torch when the process tears down aborts it
        weakref.finalize(self, _stop_thread, self._stop, self._thread)

    @property
    def finished(self) -> bool:
        """Whether it stopped and every graph it built was taken."""
        return self._done.is_set() and self._built.empty()

    def note_step(self, wanted: BatchExecutionDescriptor | None) -> None:
        """A step is about to run (the serving thread); ``wanted``: the pending graph the
        last batch missed."""
        now = time.monotonic()
        self._step_interval = min(now - self._last_step, 10.0)
        self._last_step = now
        if wanted is not None:
            self._wanted = wanted

    def _serving(self) -> bool:
        """Whether steps are running (one began within IDLE_S and two step intervals)."""
        return time.monotonic() - self._last_step < max(IDLE_S, 2 * self._step_interval)

    def _throttle(self) -> None:
        """While steps run, rest as long as the worker just worked (at most half the
        time: the GIL and a core stay mostly the serving thread's)."""
        worked = time.monotonic() - self._resumed
        if self._serving():
            self._stop.wait(min(worked, 1.0))
        if self._stop.is_set():
            raise _Stopped
        self._resumed = time.monotonic()

    def take(self) -> ReadyGraph | tuple[BatchExecutionDescriptor, str] | None:
        try:
            return self._built.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        keys = list(self._keys)
        try:
            while keys and not self._stop.is_set():
                wanted = self._wanted
                key = wanted if wanted in keys else keys[0]
                while not self._manager.is_ready(key):
                    if self._prefetch is None or self._prefetch.poll() is not None \
                            or self._stop.wait(POLL_INTERVAL_S):
                        return
                keys.remove(key)
                self._resumed = time.monotonic()
                try:
                    self._built.put(self._manager.build(key, self._throttle))
                except Exception as e:  # noqa: BLE001 - reported by the serving thread
                    self._built.put((key, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
                self._throttle()
        except _Stopped:
            pass
        finally:
            self._done.set()


class _Stopped(BaseException):
    """Ends a build at its next pause (BaseException: no check may take it for a failed
    artifact and discard it)."""


def _stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=30)


def _build_order(keys: list[BatchExecutionDescriptor], largest_first: bool = False
                 ) -> list[BatchExecutionDescriptor]:
    """FULL graphs before PIECEWISE ones (a PIECEWISE capture first traces the model on
    the serving thread), smallest size first (the batches a first user sends), or largest
    first."""
    sign = -1 if largest_first else 1
    return sorted(keys, key=lambda k: (k.mode == CUDAGraphMode.PIECEWISE,
                                       sign * k.num_tokens_padded,
                                       k.uniform_query_len is None))


def _cost(record: CaptureRecord) -> str:
    if record.compile_s is not None:
        return f", compiled in {record.compile_s:.1f} s"
    if record.load_s is not None:
        return f", bound a built artifact in {record.load_s:.1f} s"
    return f", captured in {record.seconds * 1e3:.0f} ms"
