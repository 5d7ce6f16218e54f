"""The HTTP side of `rung serve`: FastAPI routes, SSE streaming, errors, auth, shutdown.

Handlers never touch the engine: they parse a request, tokenize it (the tokenizer is
read-only), hand it to the `EngineLoop` owner and turn the DELTA outputs it delivers into
OpenAI response bodies or server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rung.runtime import LLMEngine, SamplingParams, apply_chat_template
from rung.server.engine_loop import (
    EngineError,
    EngineLoop,
    QueueFull,
    RequestAborted,
    RequestStream,
)
from rung.server.metrics import ServerMetrics
from rung.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    error_body,
    now,
    param_of,
    sampling_params,
    usage,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = None           # sequences waiting beyond max_num_seqs; None: any
    chat_template: str | None = None       # overrides the model's
    shutdown_timeout_s: float = 30.0       # SIGTERM: running requests get this long


class HTTPError(Exception):
    def __init__(self, code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class _Server:
    """What the routes share: the engine owner, the config, the metrics."""

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine_loop = EngineLoop(engine, config.max_queue)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_path = engine.config.model
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        self.draining = False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise HTTPError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{self.config.model_name}`", "model")

    def tokenize(self, prompt: str | dict, field: str) -> dict:
        """``{"prompt", "prompt_token_ids"}``, so usage and the length check are known
        before the engine sees the request (it tokenizes text the same way)."""
        if isinstance(prompt, dict):
            return prompt
        if not prompt:
            raise BadRequest(f"{field} is empty: it must hold at least 1 token", field)
        if self.tokenizer is None:
            raise BadRequest(f"model {self.model_path!r} has no tokenizer: send token ids",
                             field)
        return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}

    def check_length(self, prompts: list[dict], params: SamplingParams, field: str) -> None:
        for p in prompts:
            num = len(p["prompt_token_ids"])
            if num > self.max_model_len:
                raise BadRequest(f"{field} has {num} tokens, longer than max_model_len="
                                 f"{self.max_model_len}", field)
            if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
                raise BadRequest(f"max_tokens={params.max_tokens} plus the {num} prompt "
                                 f"tokens is more than max_model_len={self.max_model_len}",
                                 "max_tokens")

    async def submit(self, prompts: list[dict], params: SamplingParams, prefix: str
                     ) -> RequestStream:
        if self.draining:
            raise HTTPError(503, "the server is shutting down")
        try:
            return await self.engine_loop.submit(prompts, params, prefix)
        except QueueFull as e:
            raise HTTPError(503, f"server busy: {e}") from None
        except ValueError as e:
            raise BadRequest(str(e), param_of(str(e))) from None


@dataclasses.dataclass
class _Choice:
    """One choice being answered: its text so far, token count and timings."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict | None = None
    last_token_time: float | None = None


class _Tracker:
    """Counts tokens and latencies of one HTTP request for /metrics and usage."""

    def __init__(self, server: _Server, stream: RequestStream, prompts: list[dict], n: int):
        self.server = server
        self.arrival = time.perf_counter()
        self.n = n
        self.prompt_index = {rid: i for i, rid in enumerate(stream.request_ids)}
        self.num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        self.choices = [_Choice(i) for i in range(len(prompts) * n)]
        m = server.metrics
        m.prompt_tokens.labels(m.model_name).inc(self.num_prompt_tokens)

    def choice(self, request_id: str, index: int) -> _Choice:
        return self.choices[self.prompt_index[request_id] * self.n + index]

    def record(self, choice: _Choice, num_new_tokens: int) -> None:
        if not num_new_tokens:
            return
        m, t = self.server.metrics, time.perf_counter()
        if choice.last_token_time is None:
            m.ttft.labels(m.model_name).observe(t - self.arrival)
        else:
            m.itl.labels(m.model_name).observe(t - choice.last_token_time)
        choice.last_token_time = t
        choice.num_tokens += num_new_tokens
        m.generation_tokens.labels(m.model_name).inc(num_new_tokens)

    def finish(self, choice: _Choice, reason: str, stop_reason: Any = None) -> None:
        choice.finish_reason, choice.stop_reason = reason, stop_reason
        m = self.server.metrics
        m.finished.labels(m.model_name, reason).inc()
        if reason != "error":
            m.e2e.labels(m.model_name).observe(time.perf_counter() - self.arrival)

    def usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, sum(c.num_tokens for c in self.choices))


# --- app ----------------------------------------------------------------------------------------
def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    server = _Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_loop.start()
        yield
        server.engine_loop.stop()

    app = FastAPI(title="rung", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_AuthAndCount, server=server)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            return _error(HTTPError(400, f"malformed JSON body: {err.get('msg', '')}"))
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = loc[0] if loc else None
        return _error(HTTPError(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}",
                                field))

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(HTTPError(400, str(exc), exc.param))

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = await server.engine_loop.stats()
        body = {"status": "draining" if server.draining else "ok",
                "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                "kv_free_blocks": stats["kv_free_blocks"],
                "kv_total_blocks": stats["kv_total_blocks"],
                "kv_used_blocks": stats["kv_used_blocks"]}
        return JSONResponse(body, status_code=503 if server.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await server.engine_loop.stats()
        return Response(server.metrics.render(stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": now(), "owned_by": "rung",
             "root": server.model_path, "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        server.check_model(req.model)
        prompts = [server.tokenize(p, "prompt") for p in completion_prompts(req)]
        params = sampling_params(req, req.max_tokens, req.logprobs)
        server.check_length(prompts, params, "prompt")
        stream = await server.submit(prompts, params, "cmpl")
        tracker = _Tracker(server, stream, prompts, params.n)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": now(), "model": config.model_name}
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(_completion_events(stream, tracker, head, include_usage))
        await _until_done_or_hangup(raw, _collect(stream, tracker, completion_logprobs_of))
        return {**head, "choices": [
            {"index": c.index, "text": c.text, "logprobs": c.logprobs,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in tracker.choices], "usage": tracker.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        server.check_model(req.model)
        try:
            prompt = apply_chat_template(server.tokenizer, chat_messages(req),
                                         req.chat_template or config.chat_template,
                                         req.add_generation_prompt, server.model_path)
        except BadRequest:
            raise
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        num_top = req.top_logprobs or 0
        params = sampling_params(req, max_tokens, num_top if req.logprobs else None)
        server.check_length([prompt], params, "messages")
        stream = await server.submit([prompt], params, "chatcmpl")
        tracker = _Tracker(server, stream, [prompt], params.n)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": now(), "model": config.model_name}
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(_chat_events(stream, tracker, head, include_usage, num_top))
        await _until_done_or_hangup(raw, _collect(stream, tracker, chat_logprobs_of(num_top)))
        return {**head, "object": "chat.completion", "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": c.logprobs, "finish_reason": c.finish_reason,
             "stop_reason": c.stop_reason} for c in tracker.choices],
            "usage": tracker.usage()}

    return app


class _AuthAndCount:
    """ASGI middleware: the Bearer token on /v1 (when --api-key is set), and a count of
    every answer by path and status. NOTE: plain ASGI, not Starlette's BaseHTTPMiddleware,
    which relays every streamed chunk through an extra task and queue."""

    def __init__(self, app, server: _Server) -> None:
        self.app, self.server = app, server
        key = server.config.api_key
        self.expected = None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.expected is not None and path.startswith("/v1") and (
                dict(scope["headers"]).get(b"authorization") != self.expected):
            self._count(path, 401)
            await _error(HTTPError(401, "missing or wrong API key: send 'Authorization: "
                                   "Bearer <key>'"))(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self._count(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _count(self, path: str, status: int) -> None:
        m = self.server.metrics
        m.requests.labels(m.model_name, path, str(status)).inc()


def _error(exc: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.code, exc.param), status_code=exc.code)


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# --- collecting and streaming -------------------------------------------------------------------
def completion_logprobs_of(choice: _Choice, c) -> None:
    lp = completion_logprobs(c, len(choice.text))
    if lp is None:
        return
    if choice.logprobs is None:
        choice.logprobs = {k: [] for k in lp}
    for k, v in lp.items():
        choice.logprobs[k] += v


def chat_logprobs_of(num_top: int):
    def add(choice: _Choice, c) -> None:
        lp = chat_logprobs(c, num_top)
        if lp is None:
            return
        if choice.logprobs is None:
            choice.logprobs = {"content": []}
        choice.logprobs["content"] += lp["content"]
    return add


async def _collect(stream: RequestStream, tracker: _Tracker, add_logprobs) -> None:
    """Run a non-streamed request to the end (an engine failure -> 500)."""
    try:
        async for out in stream:
            for c in out.outputs:
                choice = tracker.choice(out.request_id, c.index)
                add_logprobs(choice, c)
                choice.text += c.text
                tracker.record(choice, len(c.token_ids))
                if c.finish_reason == "error":
                    tracker.finish(choice, "error")
                    raise HTTPError(500, c.error or "the engine failed this request")
                if c.finish_reason is not None:
                    tracker.finish(choice, c.finish_reason, c.stop_reason)
    except RequestAborted:
        for choice in tracker.choices:
            if choice.finish_reason is None:
                tracker.finish(choice, "abort")
    except EngineError as e:
        raise HTTPError(500, str(e)) from None


async def _until_done_or_hangup(raw: Request, work) -> None:
    """Await ``work``; a client that hangs up first cancels it (its stream aborts)."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise HTTPError(499, "client disconnected")
    task.result()


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(stream: RequestStream, tracker: _Tracker, head: dict, include_usage: bool,
                  choice_body, announce: bool) -> AsyncIterator[str]:
    """SSE for either endpoint: ``choice_body(choice, c, first)`` shapes one choice;
    ``announce``: each choice's first output is sent even without text (chat's role)."""
    usage_none = {"usage": None} if include_usage else {}
    try:
        async for out in stream:
            choices = []
            for c in out.outputs:
                choice = tracker.choice(out.request_id, c.index)
                first = choice.last_token_time is None and choice.num_tokens == 0
                tracker.record(choice, len(c.token_ids))
                if c.finish_reason == "error":
                    tracker.finish(choice, "error")
                    yield _event(error_body(c.error or "the engine failed this request", 500))
                    return
                if c.finish_reason is not None:
                    tracker.finish(choice, c.finish_reason, c.stop_reason)
                # NOTE: a delta with tokens is sent even when its text is empty (a
                # broken character held back, a token without text), as vLLM does
                if c.token_ids or c.finish_reason is not None or (announce and first):
                    choices.append(choice_body(choice, c, first))
            if choices:
                yield _event({**head, "choices": choices, **usage_none})
    except RequestAborted:
        cut = []
        for choice in tracker.choices:
            if choice.finish_reason is None:
                tracker.finish(choice, "abort")
                cut.append(choice_body(choice, None, False))
        yield _event({**head, "choices": cut, **usage_none})
    except EngineError as e:
        yield _event(error_body(str(e), 500))
        return
    if include_usage:
        yield _event({**head, "choices": [], "usage": tracker.usage()})
    yield "data: [DONE]\n\n"


def _completion_events(stream: RequestStream, tracker: _Tracker, head: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    def body(choice: _Choice, c, first: bool) -> dict:
        text = c.text if c is not None else ""
        lp = completion_logprobs(c, len(choice.text)) if c is not None else None
        choice.text += text
        return {"index": choice.index, "text": text, "logprobs": lp,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    return _events(stream, tracker, head, include_usage, body, announce=False)


def _chat_events(stream: RequestStream, tracker: _Tracker, head: dict, include_usage: bool,
                 num_top: int) -> AsyncIterator[str]:
    def body(choice: _Choice, c, first: bool) -> dict:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = c.text if c is not None else ""
        return {"index": choice.index, "delta": delta,
                "logprobs": chat_logprobs(c, num_top) if c is not None else None,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    return _events(stream, tracker, head, include_usage, body, announce=True)


# --- running ------------------------------------------------------------------------------------
class _GracefulServer(uvicorn.Server):
    """SIGTERM / SIGINT: refuse new requests, let running ones finish for
    ``shutdown_timeout_s``, cut the rest (finish_reason "abort"), then exit. A second
    signal exits at once."""

    def __init__(self, config: uvicorn.Config, server: _Server) -> None:
        super().__init__(config)
        self.rung = server
        self._drain_started = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_started:
            self.force_exit = True
            self.should_exit = True
            return
        self._drain_started = True
        self.rung.draining = True
        logger.info("signal %d: draining %d request(s) for up to %.0f s",
                    sig, self.rung.engine_loop.num_requests_in_flight,
                    self.rung.config.shutdown_timeout_s)
        asyncio.get_event_loop().call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        engine_loop = self.rung.engine_loop
        deadline = time.monotonic() + self.rung.config.shutdown_timeout_s
        while engine_loop.num_requests_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine_loop.num_requests_in_flight:
            cut = engine_loop.num_requests_in_flight
            await engine_loop.abort_all()
            logger.warning("shutdown: cut %d request(s) still running (finish_reason "
                           "'abort')", cut)
            deadline = time.monotonic() + 5.0
            while engine_loop.num_requests_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True


def run_server(engine: LLMEngine, config: ServerConfig, host: str, port: int,
               log_level: str = "info") -> int:
    app = build_app(engine, config)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=5, access_log=False)
    server = _GracefulServer(uv_config, app.state.server)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", config.model_name,
                host, port)
    server.run()
    return 0

