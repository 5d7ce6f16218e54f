"""OpenAI request bodies -> prompts and ``SamplingParams``; outputs -> OpenAI response bodies.

The field names and defaults are OpenAI's (`max_tokens` 16 for completions, up to the
context for chat), plus vLLM's extras (`top_k`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`). A field SamplingParams does not have yet
(`presence_penalty`, ...) passes through when SamplingParams accepts it, is ignored at its
neutral value, and is a 400 naming the field otherwise.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from rung.runtime import CompletionOutput, Logprob, SamplingParams


class BadRequest(ValueError):
    """A 400 whose body names ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    # NOTE: strict: `"max_tokens": "4"` or `prompt: [true]` is a 400, not coerced
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None


class CompletionRequest(_Sampling):
    # NOTE: the constraints are documented in /openapi.json; an empty prompt is a 400
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI's tool calls (rung.server.tools)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    chat_template: str | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a ``prompt`` or chat ``messages`` (rendered by the server's
    chat template)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    # NOTE: as a chat request's: an empty conversation has nothing to render
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


# fields SamplingParams may grow (another wave adds them); the value that changes nothing
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "min_p": 0.0, "logit_bias": None, "tools": None,
            "tool_choice": None, "parallel_tool_calls": None, "length_penalty": 1.0}
_IGNORED = {"user", "metadata", "store", "service_tier"}


def sampling_params(req: _Sampling, max_tokens: int | None, logprobs: int | None
                    ) -> SamplingParams:
    """The request's SamplingParams; ValueError names the field."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "n": req.n, "stop": req.stop,
                              "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens,
                              "stop_token_ids": req.stop_token_ids or [],
                              "include_stop_str_in_output": req.include_stop_str_in_output,
                              "logprobs": logprobs, "seed": req.seed,
                              "prompt_logprobs": req.prompt_logprobs}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    extra = req.model_extra or {}
    response_format = extra.get("response_format")
    if response_format is not None:
        spec = structured_from_response_format(response_format)
        if spec is not None:
            if extra.get("structured_outputs") is not None:
                raise BadRequest("response_format and structured_outputs both constrain the "
                                 "output: send one", "response_format")
            kwargs["structured_outputs"] = spec
    for name, value in extra.items():
        if name in _IGNORED or name == "response_format" or value is None:
            continue
        if name in fields and name != "output_kind":
            kwargs[name] = value
        elif name in _NEUTRAL and value == _NEUTRAL[name]:
            continue
        elif name in _NEUTRAL:
            raise BadRequest(f"{name}={value!r} is not supported by this server yet", name)
        # NOTE: other unknown fields are ignored, as OpenAI-compatible servers do
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise BadRequest(str(e), param_of(str(e))) from None
    except TypeError as e:
        raise BadRequest(str(e)) from None


def structured_from_response_format(value: Any) -> dict | None:
    """OpenAI's ``response_format`` -> vLLM's ``structured_outputs`` (None: free text).
    ``json_schema.strict`` is accepted either way: the output always follows the schema."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequest(f"response_format={value!r} is invalid: must be an object with a "
                         "type of 'text', 'json_object' or 'json_schema'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise BadRequest(f"response_format.type={kind!r} is invalid: must be 'text', "
                         "'json_object' or 'json_schema'", "response_format")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema is missing or not an object: "
                         "send {'type': 'json_schema', 'json_schema': {'name': ..., "
                         "'schema': {...}}}", "response_format")
    return {"json": schema}


def param_of(message: str) -> str | None:
    """The field an engine error names: 'SamplingParams.max_tokens=0 ...' -> max_tokens,
    'prompt has 9 tokens, ...' -> prompt."""
    if message.startswith("stop token id"):
        return "stop_token_ids"
    if message.startswith("structured_outputs"):
        return "structured_outputs"
    m = re.match(r"(?:SamplingParams\.)?(\w+)[= ]", message)
    return m.group(1) if m is not None else None


def completion_prompts(req: CompletionRequest) -> list[str | dict]:
    """OpenAI's four prompt shapes -> one engine prompt each."""
    if req.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    if req.best_of not in (None, req.n):
        raise BadRequest(f"best_of={req.best_of} is not supported (only best_of == n)",
                         "best_of")
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise BadRequest("prompt is empty", "prompt")
    if all(isinstance(t, int) for t in p):
        return [{"prompt_token_ids": list(p)}]
    return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template reads them; content parts other than text -> 400."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                 "messages")
            if not all(isinstance(part.get("text"), str) for part in content):
                raise BadRequest(f"messages[{i}].content: a text part's text must be a "
                                 "string", "messages")
            content = "".join(part["text"] for part in content)
        out.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
    return out


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: every 4xx / 5xx of the server has this shape."""

    error: ErrorInfo


def error_body(message: str, code: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            500: "InternalServerError", 503: "ServiceUnavailableError"}.get(code, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- responses --------------------------------------------------------------------------------
def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion_logprobs(c: CompletionOutput, text_offset: int) -> dict[str, Any] | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, entries in zip(c.token_ids, c.logprobs):
        sampled = entries[token_id]
        text = _token_text(sampled, token_id)
        tokens.append(text)
        token_lps.append(sampled.logprob)
        top: dict[str, float] = {}
        for t, lp in _by_rank(entries):        # NOTE: tokens that decode alike keep the best
            top.setdefault(_token_text(lp, t), lp.logprob)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], entries: list | None,
                  decode: Any) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs (lm-evaluation-harness reads
    it): the first token has none; each later one its logprob and top alternatives."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for i, token_id in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if entry is None:
            text, lp, top = decode(token_id), None, None
        else:
            text, lp = _token_text(entry[token_id], token_id), entry[token_id].logprob
            top = {}
            for t, e in _by_rank(entry):
                top.setdefault(_token_text(e, t), e.logprob)
        tokens.append(text)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, num_top: int) -> dict[str, Any] | None:
    """The chat shape: one entry per token with its top ``num_top`` alternatives."""
    if c.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(c.token_ids, c.logprobs):
        sampled = entries[token_id]
        text = _token_text(sampled, token_id)
        top = [{"token": _token_text(lp, t), "logprob": lp.logprob,
                "bytes": list(_token_text(lp, t).encode())}
               for t, lp in _by_rank(entries) if lp.rank <= num_top][:num_top]
        content.append({"token": text, "logprob": sampled.logprob,
                        "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}


def _by_rank(entries: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entries.items(), key=lambda kv: kv[1].rank)


def _token_text(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def now() -> int:
    return int(time.time())
