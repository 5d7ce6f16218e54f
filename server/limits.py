"""Operator limits of `rung serve`: how much one request may ask for, checked before any of
it reaches the engine.

Each limit is a flag with a safe default (vLLM's name where vLLM has one); a request over
one is a 400 whose body names the field and the limit. The body size is checked while the
body arrives, before it is parsed (`read_body`); list lengths once it is parsed and before
it is validated (`check_sizes`); the rest once it is validated (`check`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

# NOTE: no import of the serve extra at module level: the CLI reads ServerLimits' defaults
# for its flags without fastapi or pydantic installed
if TYPE_CHECKING:
    from fastapi import Request

    from rung.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 8 << 20
    max_n: int = 128                       # OpenAI's own bound on n
    max_prompts_per_request: int = 256
    max_logprobs: int = 20                 # vLLM's --max-logprobs default
    max_stop: int = 64                     # stop strings per request
    max_stop_str_len: int = 1024           # characters per stop string
    max_stop_token_ids: int = 256
    max_messages: int = 4096               # chat messages per request
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 2.0   # a request's (trusted) template renders this long
    request_body_timeout_s: float = 30.0   # a trickled body is cut after this long
    request_header_timeout_s: float = 10.0  # a request head not whole by then: closed


def _over(field: str, value: int, limit: int, flag: str) -> Exception:
    from rung.server.protocol import BadRequest

    return BadRequest(f"{field}={value} is over this server's limit of {limit} (--{flag})",
                      field)


async def read_body(raw: Request, limits: ServerLimits) -> bytes:
    """The request body, refused as soon as it passes ``max_request_body_bytes`` (the
    Content-Length first, then the bytes as they come) or takes longer than
    ``request_body_timeout_s`` to arrive."""
    from rung.server.protocol import BadRequest

    limit = limits.max_request_body_bytes
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body has {int(declared)} bytes, over this server's limit of "
                         f"{limit} (--max-request-body-bytes)")
    deadline = time.monotonic() + limits.request_body_timeout_s
    chunks, size = [], 0
    stream = raw.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(),
                                           max(deadline - time.monotonic(), 0.0))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:   # NOTE: not the builtin TimeoutError before 3.11
            raise BadRequest(f"the body did not arrive within {limits.request_body_timeout_s}"
                             " s (--request-body-timeout)") from None
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the body has more than {limit} bytes, this server's limit "
                             "(--max-request-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def check_sizes(body: dict, limits: ServerLimits) -> None:
    """400 for a list over its limit, read from the parsed JSON before it is validated
    (validating a list costs time in proportion to its length)."""
    from rung.server.protocol import BadRequest

    def length(field: str) -> int:
        value = body.get(field)
        return len(value) if isinstance(value, list) else 0

    prompt = body.get("prompt")
    one_prompt = not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int)
    for field, num, limit, flag in (
            ("prompt", 1 if one_prompt else len(prompt), limits.max_prompts_per_request,
             "max-prompts-per-request"),
            ("messages", length("messages"), limits.max_messages, "max-messages"),
            ("stop", length("stop"), limits.max_stop, "max-stop"),
            ("stop_token_ids", length("stop_token_ids"), limits.max_stop_token_ids,
             "max-stop-token-ids")):
        if num > limit:
            raise BadRequest(f"{field} holds {num} entries, over this server's limit of "
                             f"{limit} (--{flag})", field)


def check(req: CompletionRequest | ChatCompletionRequest, limits: ServerLimits) -> None:
    """400 for the first field over a limit, once ``req`` is validated (list lengths:
    `check_sizes`)."""
    from rung.server.protocol import BadRequest, CompletionRequest

    if req.n > limits.max_n:
        raise _over("n", req.n, limits.max_n, "max-n")
    if isinstance(req, CompletionRequest):
        logprobs = {"logprobs": req.logprobs}
    else:
        logprobs = {"top_logprobs": req.top_logprobs}
        if req.chat_template is not None and not limits.trust_request_chat_template:
            raise BadRequest("chat_template in a request is refused: the server runs only "
                             "its own (start it with --trust-request-chat-template to allow "
                             "request templates)", "chat_template")
    logprobs["prompt_logprobs"] = getattr(req, "prompt_logprobs", None)
    for field, value in logprobs.items():
        if value is not None and value > limits.max_logprobs:
            raise _over(field, value, limits.max_logprobs, "max-logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_str_len:
        raise BadRequest(f"stop holds a string of {longest} characters, over this server's "
                         f"limit of {limits.max_stop_str_len} (--max-stop-str-len)", "stop")
