"""The HTTP side of `rung serve`: FastAPI routes, SSE streaming, errors, auth, shutdown.

Handlers never touch the engine: they parse a request, tokenize it (the tokenizer is
read-only), hand it to the engine owner through `EngineLoop` and turn the DELTA outputs
it delivers into OpenAI response bodies or server-sent events. The owner runs in a
process of its own (rung.server.engine_process) or, with ``--engine-in-process``, on a
thread of this one; if it dies, every request in flight gets a 500, /health a 503, and
the server exits non-zero so that whoever runs it restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rung.runtime import SamplingParams
from rung.server.engine_loop import EngineDead, EngineLoop, QueueFull, RequestStream
from rung.server.limits import ServerLimits, read_body
from rung.server.metrics import ServerMetrics
from rung.server.prepare import Preparer
from rung.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    echo_logprobs,
    error_body,
    now,
    param_of,
)
from rung.server.streaming import (
    Choice,
    HTTPError,
    Tracker,
    chat_events,
    chat_logprobs_of,
    collect,
    completion_events,
    completion_logprobs_of,
    until_done_or_hangup,
)
from rung.server.tools import ToolPlan, parse

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = None           # sequences waiting beyond max_num_seqs; None: any
    chat_template: str | None = None       # overrides the model's
    shutdown_timeout_s: float = 30.0       # SIGTERM: running requests get this long
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)


class _Server:
    """What the routes share: the engine owner, the request preparer, the config, the
    metrics."""

    def __init__(self, transport: Any, config: ServerConfig) -> None:
        self.engine_loop = EngineLoop(transport, config.max_queue)
        info = self.engine_loop.info
        self.preparer = Preparer(info, config.model_name, config.chat_template,
                                 config.limits)
        self.max_model_len = info.max_model_len
        self.model_path = info.model_path
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        self.draining = False

    async def submit(self, prompts: list[dict], params: SamplingParams, prefix: str
                     ) -> RequestStream:
        if self.draining:
            raise HTTPError(503, "the server is shutting down")
        try:
            return await self.engine_loop.submit(prompts, params, prefix)
        except QueueFull as e:
            raise HTTPError(503, f"server busy: {e}") from None
        except EngineDead as e:
            raise HTTPError(503, f"{e}; the server is exiting") from None
        except ValueError as e:
            raise BadRequest(str(e), param_of(str(e))) from None


# --- app ----------------------------------------------------------------------------------------
def build_app(transport: Any, config: ServerConfig) -> FastAPI:
    """``transport``: the engine owner's (rung.server.engine_loop.ThreadTransport or
    rung.server.engine_process.EngineProcess, ready)."""
    server = _Server(transport, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_loop.start()
        yield
        server.engine_loop.stop()
        server.preparer.shutdown()

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

    @app.exception_handler(StarletteHTTPException)
    async def not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(HTTPError(exc.status_code, str(exc.detail)), exc.headers)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(HTTPError(400, str(exc), exc.param))

    @app.get("/health", responses={503: {"model": dict,
                                         "description": "shutting down, or the engine died"}})
    async def health() -> JSONResponse:
        try:
            stats = await server.engine_loop.stats()
        except EngineDead as e:
            return JSONResponse({"status": "engine_dead", "error": str(e)}, status_code=503)
        body = {"status": "draining" if server.draining else "ok",
                "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                "kv_free_blocks": stats["kv_free_blocks"],
                "kv_total_blocks": stats["kv_total_blocks"],
                "kv_used_blocks": stats["kv_used_blocks"]}
        return JSONResponse(body, status_code=503 if server.draining else 200)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}},
                              "description": "Prometheus text format"}})
    async def metrics() -> Response:
        try:
            stats = await server.engine_loop.stats()
        except EngineDead as e:
            raise HTTPError(503, str(e)) from None
        return Response(server.metrics.render(stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=_errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": now(), "owned_by": "rung",
             "root": server.model_path, "max_model_len": server.max_model_len}]}

    defs: dict[str, Any] = {}           # the request bodies' schema definitions

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest, defs),
              responses=_errors(400, 401, 404, 500, 503, streams=True))
    async def completions(raw: Request):
        prepared = await server.preparer.completion(await read_body(raw, config.limits))
        req, prompts, params = prepared.req, prepared.prompts, prepared.params
        stream = await server.submit(prompts, params, "cmpl")
        tracker = Tracker(server.metrics, stream, prompts, params.n)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": now(), "model": config.model_name}
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(completion_events(stream, tracker, head, include_usage))
        await until_done_or_hangup(raw, collect(stream, tracker, completion_logprobs_of))
        if req.echo:
            _echo(server.preparer.tokenizer, tracker, prompts, prepared.echo_only,
                  req.logprobs is not None)
        answer = {**head, "choices": [
            {"index": c.index, "text": c.text, "logprobs": c.logprobs,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
             **_prompt_logprobs(tracker, c, params)}
            for c in tracker.choices], "usage": tracker.usage()}
        if prepared.echo_only:
            answer["usage"] = {**tracker.usage(), "completion_tokens": 0,
                               "total_tokens": tracker.num_prompt_tokens}
        return answer

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest, defs),
              responses=_errors(400, 401, 404, 500, 503, streams=True))
    async def chat_completions(raw: Request):
        prepared = await server.preparer.chat(await read_body(raw, config.limits))
        req, prompt, params = prepared.req, prepared.prompts[0], prepared.params
        stream = await server.submit([prompt], params, "chatcmpl")
        tracker = Tracker(server.metrics, stream, [prompt], params.n)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": now(), "model": config.model_name}
        num_top = prepared.num_top
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(chat_events(stream, tracker, head, include_usage, num_top,
                                    prepared.tools))
        await until_done_or_hangup(raw, collect(stream, tracker, chat_logprobs_of(num_top)))
        return {**head, "object": "chat.completion", "choices": [
            {"index": c.index, **_message(c, prepared.tools), "logprobs": c.logprobs,
             "stop_reason": c.stop_reason} for c in tracker.choices],
            "usage": tracker.usage(),
            **(_prompt_logprobs(tracker, tracker.choices[0], params) if tracker.choices
               else {})}

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest, defs),
              responses=_errors(400, 401, 404))
    async def tokenize(raw: Request) -> dict:
        return await server.preparer.tokenize(await read_body(raw, config.limits))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest, defs),
              responses=_errors(400, 401, 404))
    async def detokenize(raw: Request) -> dict:
        return await server.preparer.detokenize(await read_body(raw, config.limits))

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = default_openapi()
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs)
        return app.openapi_schema

    app.openapi = openapi
    return app


class _AuthAndCount:
    """ASGI middleware: the Bearer token on /v1 (when --api-key is set), and a count of
    every answer by route and status. NOTE: plain ASGI, not Starlette's BaseHTTPMiddleware,
    which relays every streamed chunk through an extra task and queue."""

    def __init__(self, app, server: _Server) -> None:
        self.app, self.server = app, server
        key = server.config.api_key
        self.expected = None if key is None else f"Bearer {key}".encode()
        self.routes: set[str] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.routes is None:
            self.routes = {r.path for r in scope["app"].routes}
        # NOTE: the label is the route, never the raw path: unknown paths share one
        # label, so a client cannot grow /metrics with the paths it makes up
        path = scope["path"]
        label = path if path in self.routes else "unmatched"
        if self.expected is not None and path.startswith("/v1") and not hmac.compare_digest(
                dict(scope["headers"]).get(b"authorization", b""), self.expected):
            self._count(label, 401)
            await _error(HTTPError(401, "missing or wrong API key: send 'Authorization: "
                                   "Bearer <key>'"))(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self._count(label, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _count(self, label: str, status: int) -> None:
        m = self.server.metrics
        m.requests.labels(m.model_name, label, str(status)).inc()


def _error(exc: HTTPError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.code, exc.param), status_code=exc.code,
                        headers=headers)


def _message(c: Choice, tools: ToolPlan | None) -> dict:
    """A chat choice's message and finish_reason; tool calls read out of its text."""
    if tools is None:
        return {"message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason}
    content, calls = parse(tools, c.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    return {"message": message, "finish_reason": finish}


def _echo(tokenizer: Any, tracker: Tracker, prompts: list[dict], echo_only: bool,
          with_logprobs: bool) -> None:
    """Each choice's text and logprobs with its prompt's in front (``echo``); with
    ``echo_only`` (max_tokens=0) the prompt's alone."""
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    for c in tracker.choices:
        index = c.index // tracker.n
        ids = prompts[index]["prompt_token_ids"]
        text = prompts[index].get("prompt")
        if text is None:
            text = tokenizer.decode(ids) if tokenizer is not None else ""
        lp = (echo_logprobs(ids, tracker.prompt_logprobs.get(index), decode)
              if with_logprobs else None)
        if echo_only:
            c.text, c.logprobs = text, lp
            continue
        if lp is not None and c.logprobs is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                lp[key] += c.logprobs[key]
            lp["text_offset"] += [o + len(text) for o in c.logprobs["text_offset"]]
        c.text, c.logprobs = text + c.text, lp


def _prompt_logprobs(tracker: Tracker, choice: Choice, params: SamplingParams) -> dict:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one
    ``{token_id: {"logprob", "rank", "decoded_token"}}``; nothing unless asked for."""
    if params.prompt_logprobs is None:
        return {}
    entries = tracker.prompt_logprobs.get(choice.index // tracker.n)
    return {"prompt_logprobs": None if entries is None else [
        None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                         "decoded_token": lp.decoded_token}
                                for t, lp in e.items()} for e in entries]}


_ERROR_WHEN = {400: "a bad request: the body names the field (and the limit)",
               401: "missing or wrong API key", 404: "no such model",
               500: "the engine failed this request", 503: "queue full or shutting down"}


def _errors(*codes: int, streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """The documented answers: OpenAI's error body for each of ``codes``; with
    ``streams``, a 200 that is JSON or server-sent events (``"stream": true``)."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse, "description": _ERROR_WHEN[code]} for code in codes}
    if streams:
        out[200] = {"description": "the completion, or its events when stream is true",
                    "content": {"application/json": {}, "text/event-stream": {}}}
    return out


def _body_schema(model: type[BaseModel], defs: dict[str, Any]) -> dict:
    """The OpenAPI request body of a route that reads its own body (so that parsing runs
    off the event loop); its definitions are added to the document's components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


GIL_SWITCH_INTERVAL_S = 0.0005
_CLOSE_GRACE_S = 1.0      # after the drain: cut streams get this long to reach their client
_DEAD_HEALTH_S = 0.5      # the engine died: /health answers 503 at least this long

# --- running ------------------------------------------------------------------------------------
class _GracefulServer(uvicorn.Server):
    """SIGTERM / SIGINT: refuse new requests, let running ones finish for
    ``shutdown_timeout_s``, cut the rest (finish_reason "abort"), then exit. A second
    signal exits at once. And a header timeout, which uvicorn has not: a connection that
    has not sent a whole request head within ``request_header_timeout_s`` is closed."""

    def __init__(self, config: uvicorn.Config, server: _Server) -> None:
        super().__init__(config)
        self.rung = server
        self._drain_started = False
        self._waiting_since: dict[Any, float] = {}     # connection -> waiting for a head

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self._sweeper = asyncio.ensure_future(self._sweep_slow_heads())
        engine_loop = self.rung.engine_loop
        engine_loop.on_dead = lambda _: asyncio.ensure_future(self._exit_dead())
        if engine_loop.dead is not None:        # it died while the server started
            asyncio.ensure_future(self._exit_dead())

    async def _exit_dead(self) -> None:
        """The engine died: the requests in flight have their 500 (give it the grace to
        reach their clients), then exit; run_server returns non-zero."""
        self.rung.draining = True
        start = time.monotonic()
        # NOTE: at least _DEAD_HEALTH_S, so a health probe sees the 503 before the exit
        while time.monotonic() - start < _CLOSE_GRACE_S and (
                self._answering() or time.monotonic() - start < _DEAD_HEALTH_S):
            await asyncio.sleep(0.02)
        for connection in self._answering():
            connection.transport.abort()
        self.should_exit = True

    async def _sweep_slow_heads(self) -> None:
        timeout_s = self.rung.config.limits.request_header_timeout_s
        while not self.should_exit:
            await asyncio.sleep(min(timeout_s / 4, 1.0))
            now_s, seen = time.monotonic(), {}
            for c in self.server_state.connections:
                cycle = getattr(c, "cycle", None)
                # NOTE: an idle keep-alive connection has uvicorn's own timer running
                if (cycle is None or cycle.response_complete) and getattr(
                        c, "timeout_keep_alive_task", None) is None:
                    seen[c] = self._waiting_since.get(c, now_s)
                    if now_s - seen[c] > timeout_s and c.transport is not None:
                        c.transport.abort()
            self._waiting_since = seen

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
            with contextlib.suppress(EngineDead):     # then they have their 500 already
                await engine_loop.abort_all()
            logger.warning("shutdown: cut %d request(s) still running (finish_reason "
                           "'abort')", cut)
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while self._answering() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # NOTE: a client that does not read holds its answer in a blocked send; dropping
        # its connection ends the send, so the exit is not held past the grace
        stuck = self._answering()
        if stuck:
            logger.warning("shutdown: dropping %d connection(s) whose client does not "
                           "read", len(stuck))
        for connection in stuck:
            connection.transport.abort()
        self.should_exit = True

    def _answering(self) -> list:
        """Connections with an answer not fully sent."""
        return [c for c in self.server_state.connections
                if getattr(c, "transport", None) is not None
                and getattr(c, "cycle", None) is not None
                and not getattr(c.cycle, "response_complete", True)]


def run_server(transport: Any, config: ServerConfig, host: str, port: int,
               log_level: str = "info", limit_concurrency: int | None = None,
               timeout_keep_alive: float = 5.0) -> int:
    """Serve until SIGTERM (0) or until the engine dies (1)."""
    app = build_app(transport, config)
    # NOTE: the engine thread gives the GIL up around every torch op and must take it back
    # from whoever holds it (the event loop, a preparing worker); with the default 5 ms
    # interval a busy neighbour makes every step wait that long many times over
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # NOTE: _drain has already given running requests --shutdown-timeout and cut the
    # rest; what uvicorn still waits for is a client that does not read its cut stream
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=_CLOSE_GRACE_S, access_log=False,
                               limit_concurrency=limit_concurrency,
                               timeout_keep_alive=timeout_keep_alive)
    server = _GracefulServer(uv_config, app.state.server)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", config.model_name,
                host, port)
    server.run()
    dead = app.state.server.engine_loop.dead
    if dead is not None:
        logger.error("%s: exiting with status 1", dead)
        return 1
    return 0

