"""The engine owner: one thread steps the engine; HTTP handlers talk to it through queues.

The engine is not thread-safe, so exactly one thread (`EngineLoop._run`) calls it. Handlers,
on the asyncio event loop, put commands on a queue (add, abort, stats, abort-all, stop); the
owner drains it between two steps, steps while anything is unfinished, and hands every
step's outputs back to the event loop in one call, where each lands on the stream of the
HTTP request that owns it. A handler whose client hung up sends an abort; the owner aborts
the request between steps, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from rung.runtime import LLMEngine, RequestOutput, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict
IDLE_GRAPH_POLL_S = 0.2      # how often an idle engine looks for graphs built meanwhile


class EngineError(RuntimeError):
    """The engine failed while this request was in flight (the server keeps serving)."""


class RequestAborted(RuntimeError):
    """The server cut this request (shutdown): it ends with finish_reason "abort"."""


class QueueFull(RuntimeError):
    """More sequences in flight than ``max_num_seqs + max_queue``."""


class RequestStream:
    """The outputs of one HTTP request's engine requests (several prompts, or one), as the
    owner delivers them: DELTA outputs, then an exception if the request failed.

    NOTE: bounded whatever the client does: outputs that arrive before the reader takes
    them merge into one pending output per sequence (`put`), so a client that does not
    read holds at most its request's own output (at most max_tokens tokens per
    sequence), never one object per engine step."""

    def __init__(self, loop: EngineLoop, request_ids: list[str], num_seqs: int) -> None:
        self._loop = loop
        self.request_ids = request_ids
        self.num_seqs = num_seqs
        self._pending: dict[tuple[str, int], RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._unfinished = set(request_ids)

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            # NOTE: a DELTA output holds one completion (n > 1: one per child, by index)
            key = (item.request_id, item.outputs[0].index)
            pending = self._pending.get(key)
            self._pending[key] = item if pending is None else _merge(pending, item)
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in order per sequence; what piled up while the reader was busy comes
        merged, so a slow client gets fewer, larger deltas instead of falling behind. An
        error is raised after the outputs that came before it."""
        try:
            while self._unfinished:
                await self._ready.wait()
                self._ready.clear()
                items, self._pending = list(self._pending.values()), {}
                for item in items:
                    if item.finished:
                        self._unfinished.discard(item.request_id)
                    yield item
                if self._error is not None:
                    raise self._error
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever is unfinished (a client that hung up) and stop counting it."""
        if self._unfinished:
            self._loop._send(("abort", list(self._unfinished)))
            self._unfinished.clear()
        self._loop._forget(self)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    ca, cb = a.outputs[0], b.outputs[0]
    c = dataclasses.replace(
        cb, token_ids=ca.token_ids + cb.token_ids,
        logprobs=None if cb.logprobs is None else (ca.logprobs or []) + cb.logprobs)
    c.text = ca.text + cb.text
    return dataclasses.replace(b, outputs=[c],
                               prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs)


class EngineLoop:
    """Owns ``engine``: its thread is the only caller of the engine's methods."""

    def __init__(self, engine: LLMEngine, max_queue: int | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.max_num_seqs = engine.config.max_num_seqs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: set[RequestStream] = set()         # event-loop side only
        self._owners: dict[str, RequestStream] = {}       # engine request id -> stream
        self._ids = itertools.count()
        self._live: set[str] = set()                      # owner thread side only
        self._thread: threading.Thread | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.num_seqs_in_flight = 0

    # --- event-loop side --------------------------------------------------------------------
    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="rung-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._send(("stop",))
            self._thread.join(timeout_s)

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._streams)

    async def submit(self, prompts: list[Prompt], params: SamplingParams,
                     prefix: str = "req") -> RequestStream:
        """Queue one engine request per prompt; raises ValueError (bad input, nothing
        queued) or QueueFull. Outputs come as DELTAs on the returned stream."""
        num_seqs = len(prompts) * params.n
        limit = None if self.max_queue is None else self.max_num_seqs + self.max_queue
        if limit is not None and self.num_seqs_in_flight + num_seqs > limit:
            raise QueueFull(f"{self.num_seqs_in_flight} sequences in flight; {num_seqs} more "
                            f"would pass max_num_seqs + max_queue = {limit}")
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        base = next(self._ids)
        ids = [f"{prefix}-{base}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids, num_seqs)
        for rid in ids:
            self._owners[rid] = stream
        self._streams.add(stream)
        self.num_seqs_in_flight += num_seqs
        accepted = self._event_loop.create_future()
        self._send(("add", list(zip(ids, prompts)), params, accepted))
        try:
            await accepted
        except BaseException:
            self._forget(stream)
            raise
        return stream

    async def stats(self) -> dict[str, Any]:
        """``engine.stats()``, read by the owner between two steps."""
        future = self._event_loop.create_future()
        self._send(("stats", future))
        return await future

    async def abort_all(self) -> None:
        """Cut every request in flight: each stream ends with RequestAborted."""
        future = self._event_loop.create_future()
        self._send(("abort_all", future))
        await future

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    def _forget(self, stream: RequestStream) -> None:
        if stream in self._streams:
            self._streams.discard(stream)
            self.num_seqs_in_flight -= stream.num_seqs
        for rid in stream.request_ids:
            self._owners.pop(rid, None)

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        for rid, item in items:
            stream = self._owners.get(rid)
            if stream is not None:
                stream.put(item)

    def _resolve(self, future: asyncio.Future, value: Any) -> None:
        if not future.done():
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    # --- owner thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            # NOTE: an idle engine still brings built graphs live, between its commands
            graphs_pending = idle and self.engine.advance_graphs()
            if not self._drain(block=idle, timeout=IDLE_GRAPH_POLL_S if graphs_pending else None):
                return
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:      # noqa: BLE001 - one failure must not end serving
                self._fail_in_flight(e)
                continue
            items = []
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
                items.append((out.request_id, out))
            if items:
                self._call(self._deliver, items)

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Run every queued command (waiting for one if ``block``, at most ``timeout``
        seconds); False on stop."""
        try:
            command = self._commands.get(timeout=timeout) if block else (
                self._commands.get_nowait())
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            try:
                self._handle(command)
            except Exception as e:      # noqa: BLE001 - the owner thread must not die
                logger.exception("engine command %s failed", command[0])
                futures = [c for c in command if isinstance(c, asyncio.Future)]
                for future in futures:
                    self._call(self._resolve, future, e)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, entries, params, accepted = command
            self._call(self._resolve, accepted, self._add(entries, params))
        elif kind == "abort":
            for rid in command[1]:
                if rid in self._live:
                    self._live.discard(rid)
                    self.engine.abort_request(rid)
        elif kind == "stats":
            self._call(self._resolve, command[1], self.engine.stats())
        elif kind == "abort_all":
            cut = sorted(self._live)
            for rid in cut:
                self.engine.abort_request(rid)
            self._live.clear()
            self._call(self._deliver, [(rid, RequestAborted("the server is shutting down"))
                                       for rid in cut])
            self._call(self._resolve, command[1], len(cut))

    def _add(self, entries: list[tuple[str, Prompt]], params: SamplingParams
             ) -> BaseException | None:
        """Add every prompt, or none (a ValueError for the first bad one)."""
        added = []
        try:
            for rid, prompt in entries:
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception as e:          # noqa: BLE001 - handed to the handler
            for rid in added:
                self.engine.abort_request(rid)
            return e
        self._live.update(added)
        return None

    def _fail_in_flight(self, error: Exception) -> None:
        """The step failed: every request in flight may have been in it. Each is aborted
        (its KV blocks freed) and answered with an EngineError; serving goes on."""
        logger.exception("engine step failed; failing %d request(s) in flight",
                         len(self._live))
        failed = sorted(self._live)
        for rid in failed:
            try:
                self.engine.abort_request(rid)
            except Exception:           # noqa: BLE001
                logger.exception("abort of %s after a failed step failed", rid)
        self._live.clear()
        message = f"engine failure: {type(error).__name__}: {error}"
        self._call(self._deliver, [(rid, EngineError(message)) for rid in failed])

    def _call(self, fn, *args) -> None:
        self._event_loop.call_soon_threadsafe(fn, *args)
