"""Answering one HTTP request of `rung serve`: its choices, their counts for /metrics, and
the DELTA outputs of its engine stream collected into a body or sent as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from rung.server.engine_loop import EngineError, RequestAborted, RequestStream
from rung.server.metrics import ServerMetrics
from rung.server.protocol import chat_logprobs, completion_logprobs, error_body, usage
from rung.server.tools import ToolPlan, parse


class HTTPError(Exception):
    def __init__(self, code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclasses.dataclass
class Choice:
    """One choice being answered: its text so far, token count and timings."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict | None = None
    last_token_time: float | None = None


class Tracker:
    """Counts tokens and latencies of one HTTP request for /metrics and usage."""

    def __init__(self, metrics: ServerMetrics, stream: RequestStream, prompts: list[dict],
                 n: int) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.n = n
        self.prompt_index = {rid: i for i, rid in enumerate(stream.request_ids)}
        self.num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        self.choices = [Choice(i) for i in range(len(prompts) * n)]
        self.prompt_logprobs: dict[int, list] = {}     # prompt index -> vLLM's entries
        self.num_cached: dict[str, int] = {}            # request id -> prefix-cache hit
        m = metrics
        m.prompt_tokens.labels(m.model_name).inc(self.num_prompt_tokens)

    def choice(self, request_id: str, index: int) -> Choice:
        return self.choices[self.prompt_index[request_id] * self.n + index]

    def seen(self, out) -> None:
        """Note what an output carries for the whole prompt (its prompt_logprobs)."""
        if out.num_cached_tokens is not None:
            self.num_cached[out.request_id] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[self.prompt_index[out.request_id]] = out.prompt_logprobs

    def abort_unfinished(self) -> list[Choice]:
        """The client hung up or the server cut the request: what had not finished is
        counted as aborted."""
        cut = [c for c in self.choices if c.finish_reason is None]
        for choice in cut:
            self.finish(choice, "abort")
        return cut

    def record(self, choice: Choice, num_new_tokens: int) -> None:
        if not num_new_tokens:
            return
        m, t = self.metrics, time.perf_counter()
        if choice.last_token_time is None:
            m.ttft.labels(m.model_name).observe(t - self.arrival)
        else:
            m.itl.labels(m.model_name).observe(t - choice.last_token_time)
        choice.last_token_time = t
        choice.num_tokens += num_new_tokens
        m.generation_tokens.labels(m.model_name).inc(num_new_tokens)

    def finish(self, choice: Choice, reason: str, stop_reason: Any = None) -> None:
        choice.finish_reason, choice.stop_reason = reason, stop_reason
        m = self.metrics
        m.finished.labels(m.model_name, reason).inc()
        if reason != "error":
            m.e2e.labels(m.model_name).observe(time.perf_counter() - self.arrival)

    def usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, sum(c.num_tokens for c in self.choices),
                     sum(self.num_cached.values()))


# --- collecting and streaming -------------------------------------------------------------------
def completion_logprobs_of(choice: Choice, c) -> None:
    lp = completion_logprobs(c, len(choice.text))
    if lp is None:
        return
    if choice.logprobs is None:
        choice.logprobs = {k: [] for k in lp}
    for k, v in lp.items():
        choice.logprobs[k] += v


def chat_logprobs_of(num_top: int):
    def add(choice: Choice, c) -> None:
        lp = chat_logprobs(c, num_top)
        if lp is None:
            return
        if choice.logprobs is None:
            choice.logprobs = {"content": []}
        choice.logprobs["content"] += lp["content"]
    return add


async def collect(stream: RequestStream, tracker: Tracker, add_logprobs) -> None:
    """Run a non-streamed request to the end (an engine failure -> 500)."""
    try:
        async for out in stream:
            tracker.seen(out)
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
    except (RequestAborted, asyncio.CancelledError) as e:
        tracker.abort_unfinished()
        if isinstance(e, asyncio.CancelledError):      # the client hung up
            raise
    except EngineError as e:
        raise HTTPError(500, str(e)) from None


async def until_done_or_hangup(raw: Request, work) -> None:
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


async def _events(stream: RequestStream, tracker: Tracker, head: dict, include_usage: bool,
                  choice_body, announce: bool) -> AsyncIterator[str]:
    """SSE for either endpoint: ``choice_body(choice, c, first)`` shapes one choice;
    ``announce``: each choice's first output is sent even without text (chat's role)."""
    usage_none = {"usage": None} if include_usage else {}
    try:
        async for out in stream:
            tracker.seen(out)
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
        cut = [choice_body(c, None, False) for c in tracker.abort_unfinished()]
        yield _event({**head, "choices": cut, **usage_none})
    except (GeneratorExit, asyncio.CancelledError):     # the client hung up
        tracker.abort_unfinished()
        raise
    except EngineError as e:
        yield _event(error_body(str(e), 500))
        return
    if include_usage:
        yield _event({**head, "choices": [], "usage": tracker.usage()})
    yield "data: [DONE]\n\n"


def completion_events(stream: RequestStream, tracker: Tracker, head: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    def body(choice: Choice, c, first: bool) -> dict:
        text = c.text if c is not None else ""
        lp = completion_logprobs(c, len(choice.text)) if c is not None else None
        choice.text += text
        return {"index": choice.index, "text": text, "logprobs": lp,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    return _events(stream, tracker, head, include_usage, body, announce=False)


def chat_events(stream: RequestStream, tracker: Tracker, head: dict, include_usage: bool,
                 num_top: int, tools: ToolPlan | None = None) -> AsyncIterator[str]:
    """With ``tools`` the text is held and the last delta carries the content or the
    tool calls read out of it (a call is only known once its text has ended)."""
    def body(choice: Choice, c, first: bool) -> dict:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = c.text if c is not None else ""
        finish = choice.finish_reason
        if tools is not None:
            choice.text += delta["content"]
            delta["content"] = ""
            if finish is not None:
                content, calls = parse(tools, choice.text)
                delta["content"] = content
                if calls:
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                    finish = "tool_calls" if finish == "stop" else finish
        return {"index": choice.index, "delta": delta,
                "logprobs": chat_logprobs(c, num_top) if c is not None else None,
                "finish_reason": finish, "stop_reason": choice.stop_reason}
    return _events(stream, tracker, head, include_usage, body, announce=True)
