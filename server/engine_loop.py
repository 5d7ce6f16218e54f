"""The engine owner and its handle on the event loop.

`EngineCore` is the only caller of the engine's methods (the engine is not thread-safe):
it takes commands (add, abort, stats, abort-all, stop) between two steps, steps while
anything is unfinished, and emits every step's outputs, for all requests, as ONE event.
`EngineLoop`, on the asyncio event loop, sends it commands and hands each output to the
`RequestStream` of the HTTP request that owns it. A handler whose client hung up sends an
abort; the owner aborts the request between steps, which frees its KV blocks.

Between the two runs a transport carrying plain, picklable tuples: a thread of this
process (`ThreadTransport`, ``--engine-in-process``) or a process of the engine's own
(rung.server.engine_process, the default). The owner's rules are the same either way.

Commands: ``("add", token, [(request_id, prompt)], params)``, ``("abort", [request_id])``,
``("stats", token)``, ``("abort_all", token)``, ``("stop",)``.
Events: ``("outputs", [(request_id, RequestOutput | exception)])``, ``("reply", token,
value | exception)``, and from the transport itself ``("dead", message)`` when the owner
is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from rung.runtime import GrammarCompiler, RequestOutput, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from rung.runtime import LLMEngine

logger = logging.getLogger(__name__)

Prompt = str | dict
Command = tuple
Event = tuple
IDLE_GRAPH_POLL_S = 0.2      # how often an idle engine looks for graphs built meanwhile
MAX_PENDING_DELTAS = 64      # a sequence's undelivered outputs merge into one at this many


class EngineError(RuntimeError):
    """The engine failed while this request was in flight (the server keeps serving)."""


class EngineDead(EngineError):
    """The engine's owner is gone (its process died): nothing in flight will finish and the
    server must exit."""


class RequestAborted(RuntimeError):
    """The server cut this request (shutdown): it ends with finish_reason "abort"."""


class QueueFull(RuntimeError):
    """More sequences in flight than ``max_num_seqs + max_queue``."""


@dataclasses.dataclass
class EngineInfo:
    """What the HTTP side knows of the engine: enough to prepare requests without it."""

    model_path: str
    tokenizer: Any                    # None: the model has none (token ids only)
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_ids: list[int]          # what ends a structured output
    grammars: GrammarCompiler | None = None     # checks a request's grammar (a 400)

    def __post_init__(self) -> None:
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size,
                                            self.eos_token_ids)

    def __getstate__(self) -> dict:
        # NOTE: the compiler holds a thread pool; the receiving side builds its own
        return {**self.__dict__, "grammars": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()


def engine_info(engine: LLMEngine, own_grammars: bool = True) -> EngineInfo:
    """``own_grammars``: share the engine's grammar cache (same process)."""
    eos = [t for t in [engine.inputs.eos_token_id, *engine.loaded.generation_stop_ids]
           if t is not None]
    return EngineInfo(engine.config.model, engine.tokenizer, engine.max_model_len,
                      engine.runner.vocab_size, engine.config.max_num_seqs, eos,
                      engine.grammars if own_grammars else None)


# --- the owner ------------------------------------------------------------------------------
class EngineCore:
    """Owns ``engine``: ``run`` is the only caller of its methods. ``emit`` takes each
    event; ``receive(timeout)`` gives the next command or None when none came in
    ``timeout`` seconds (None: wait for one; 0: do not wait)."""

    def __init__(self, engine: LLMEngine, emit: Callable[[Event], None]) -> None:
        self.engine = engine
        self.emit = emit
        self._live: set[str] = set()        # request ids added and not finished

    def run(self, receive: Callable[[float | None], Command | None]) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            # NOTE: an idle engine still brings built graphs live, between its commands
            graphs_pending = idle and engine.advance_graphs()
            timeout = (IDLE_GRAPH_POLL_S if graphs_pending else None) if idle else 0
            if not self._drain(receive, timeout):
                return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:      # noqa: BLE001 - one failure must not end serving
                self._fail_in_flight(e)
                continue
            items = []
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
                # NOTE: the prompt is the HTTP side's already; only what is new travels
                items.append((out.request_id,
                              dataclasses.replace(out, prompt=None, prompt_token_ids=[])))
            if items:
                self.emit(("outputs", items))

    def _drain(self, receive: Callable[[float | None], Command | None],
               timeout: float | None) -> bool:
        """Run every queued command (the first waited for at most ``timeout`` s); False
        on stop."""
        command = receive(timeout)
        while command is not None:
            if command[0] == "stop":
                return False
            try:
                self._handle(command)
            except Exception as e:      # noqa: BLE001 - the owner must not die
                logger.exception("engine command %s failed", command[0])
                if command[0] in ("add", "stats", "abort_all"):
                    self.emit(("reply", command[1], RuntimeError(f"{type(e).__name__}: {e}")))
            command = receive(0)
        return True

    def _handle(self, command: Command) -> None:
        kind = command[0]
        if kind == "add":
            _, token, entries, params = command
            self.emit(("reply", token, self._add(entries, params)))
        elif kind == "abort":
            for rid in command[1]:
                if rid in self._live:
                    self._live.discard(rid)
                    self.engine.abort_request(rid)
        elif kind == "stats":
            self.emit(("reply", command[1], self.engine.stats()))
        elif kind == "abort_all":
            cut = sorted(self._live)
            for rid in cut:
                self.engine.abort_request(rid)
            self._live.clear()
            self.emit(("outputs", [(rid, RequestAborted("the server is shutting down"))
                                   for rid in cut]))
            self.emit(("reply", command[1], len(cut)))

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
            # NOTE: a plain exception of its message: it may cross a process boundary
            return (ValueError(str(e)) if isinstance(e, ValueError)
                    else RuntimeError(f"{type(e).__name__}: {e}"))
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
        self.emit(("outputs", [(rid, EngineError(message)) for rid in failed]))


class ThreadTransport:
    """The owner on a thread of this process (``--engine-in-process``): commands go
    through a queue, events to the event loop by ``call_soon_threadsafe``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = engine_info(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_event: Callable[[Event], None]
              ) -> None:
        """Start the owner; ``on_event`` is called on ``loop``."""
        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(on_event, event)

        core = EngineCore(self.engine, emit)

        def run() -> None:
            try:
                core.run(self._receive)
            except BaseException as e:      # noqa: BLE001 - reported, then the thread ends
                logger.exception("the engine thread died")
                emit(("dead", f"the engine thread died: {type(e).__name__}: {e}"))

        self._thread = threading.Thread(target=run, name="rung-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout_s)

    def _receive(self, timeout: float | None) -> Command | None:
        try:
            return (self._commands.get_nowait() if timeout == 0
                    else self._commands.get(timeout=timeout))
        except queue.Empty:
            return None


# --- the event-loop side -----------------------------------------------------------------------
class RequestStream:
    """The outputs of one HTTP request's engine requests (several prompts, or one), as the
    owner delivers them: DELTA outputs, then an exception if the request failed.

    NOTE: bounded whatever the client does: outputs that arrive before the reader takes
    them wait per sequence and merge into one every ``MAX_PENDING_DELTAS`` (`put`) and
    when the reader takes them, so a client that does not read holds at most its
    request's own output (at most max_tokens tokens per sequence) in fewer than
    ``MAX_PENDING_DELTAS`` objects, never one object per engine step. Merging k deltas at
    once costs one merge, not k: a reader that falls behind by many steps (many streams
    of a fast model) does not pay per step for having fallen behind."""

    def __init__(self, loop: EngineLoop, request_ids: list[str], num_seqs: int) -> None:
        self._loop = loop
        self.request_ids = request_ids
        self.num_seqs = num_seqs
        self._pending: dict[tuple[str, int], list[RequestOutput]] = {}
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
            if pending is None:
                self._pending[key] = [item]
            else:
                pending.append(item)
                if len(pending) >= MAX_PENDING_DELTAS:
                    self._pending[key] = [_merge(pending)]
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in order per sequence; what piled up while the reader was busy comes
        merged, so a slow client gets fewer, larger deltas instead of falling behind. An
        error is raised after the outputs that came before it."""
        try:
            while self._unfinished:
                await self._ready.wait()
                self._ready.clear()
                pending, self._pending = list(self._pending.values()), {}
                for deltas in pending:
                    item = deltas[0] if len(deltas) == 1 else _merge(deltas)
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


def _merge(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive DELTA outputs of one sequence as one."""
    last = deltas[-1]
    completions = [d.outputs[0] for d in deltas]
    c = dataclasses.replace(
        completions[-1], token_ids=[t for x in completions for t in x.token_ids],
        logprobs=None if completions[-1].logprobs is None
        else [lp for x in completions for lp in x.logprobs or []])
    c.text = "".join(x.text for x in completions)
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
    return dataclasses.replace(last, outputs=[c], prompt_logprobs=prompt_logprobs)


class EngineLoop:
    """The event loop's handle on the engine owner, whichever transport carries it."""

    def __init__(self, transport: Any, max_queue: int | None = None) -> None:
        self.transport = transport
        self.info: EngineInfo = transport.info
        self.max_queue = max_queue
        self.max_num_seqs = self.info.max_num_seqs
        self._streams: set[RequestStream] = set()
        self._owners: dict[str, RequestStream] = {}       # engine request id -> stream
        self._replies: dict[int, asyncio.Future] = {}     # token -> what waits for it
        self._ids = itertools.count()
        self._tokens = itertools.count()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.num_seqs_in_flight = 0
        self.dead: str | None = None                      # why the owner is gone
        self.on_dead: Callable[[str], None] | None = None

    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self.transport.start(self._event_loop, self._on_event)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.transport.stop(timeout_s)

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._streams)

    async def submit(self, prompts: list[Prompt], params: SamplingParams,
                     prefix: str = "req") -> RequestStream:
        """Queue one engine request per prompt; raises ValueError (bad input, nothing
        queued), QueueFull or EngineDead. Outputs come as DELTAs on the returned stream."""
        self._check_alive()
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
        try:
            await self._ask("add", list(zip(ids, prompts)), params)
        except BaseException:
            self._forget(stream)
            raise
        return stream

    async def stats(self) -> dict[str, Any]:
        """``engine.stats()``, read by the owner between two steps."""
        return await self._ask("stats")

    async def abort_all(self) -> None:
        """Cut every request in flight: each stream ends with RequestAborted."""
        await self._ask("abort_all")

    async def _ask(self, kind: str, *args: Any) -> Any:
        self._check_alive()
        token = next(self._tokens)
        future = self._replies[token] = self._event_loop.create_future()
        self._send((kind, token, *args))
        try:
            return await future
        finally:
            self._replies.pop(token, None)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)

    def _send(self, command: Command) -> None:
        if self.dead is None:
            self.transport.send(command)

    def _forget(self, stream: RequestStream) -> None:
        if stream in self._streams:
            self._streams.discard(stream)
            self.num_seqs_in_flight -= stream.num_seqs
        for rid in stream.request_ids:
            self._owners.pop(rid, None)

    def _on_event(self, event: Event) -> None:
        kind = event[0]
        if kind == "outputs":
            for rid, item in event[1]:
                stream = self._owners.get(rid)
                if stream is not None:
                    stream.put(item)
        elif kind == "reply":
            future = self._replies.get(event[1])
            if future is not None and not future.done():
                value = event[2]
                if isinstance(value, BaseException):
                    future.set_exception(value)
                else:
                    future.set_result(value)
        elif kind == "dead":
            self._on_dead(event[1])

    def _on_dead(self, message: str) -> None:
        """Every request in flight and every question asked fails with EngineDead."""
        if self.dead is not None:
            return
        self.dead = message
        logger.error("%s: failing %d request(s) in flight", message, len(self._streams))
        for stream in list(self._streams):
            stream.put(EngineDead(message))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineDead(message))
        if self.on_dead is not None:
            self.on_dead(message)
