"""Request preparation, off the event loop: a body's bytes -> the engine prompts and the
``SamplingParams`` to submit.

Everything whose cost grows with a request runs here, in a worker thread of `Preparer`'s
pool, never on the event loop: JSON parsing and validation, the operator limits, the chat
template (a request's own one in a sandbox process, under a deadline) and tokenizing. The
engine only receives prompts already tokenized and checked against ``max_model_len``;
detokenizing happens in the engine's own step, in the engine's process. It needs only
the engine's `EngineInfo` (tokenizer, limits), so it runs in the HTTP process whether the
engine shares it or not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any

import pydantic_core
from pydantic import BaseModel, ValidationError

from rung.runtime import (
    SamplingParams,
    StructuredOutputsParams,
    TooManyTokens,
    apply_chat_template,
    context_overflow,
    encode_within,
)
from rung.server import limits as limits_mod
from rung.server.engine_loop import EngineInfo
from rung.server.limits import ServerLimits
from rung.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
    completion_prompts,
    sampling_params,
)
from rung.server.streaming import HTTPError
from rung.server.template_sandbox import TemplateRenderer, TemplateTimeout
from rung.server.tools import ToolPlan, plan


@dataclasses.dataclass
class Prepared:
    req: Any                          # CompletionRequest | ChatCompletionRequest
    prompts: list[dict]               # {"prompt", "prompt_token_ids"} each
    params: SamplingParams
    num_top: int = 0                  # chat: top_logprobs per token
    echo_only: bool = False           # completions: echo with max_tokens=0 (prompt only)
    tools: ToolPlan | None = None     # chat: what tool calls the answer may hold


class Preparer:
    """Parses, checks, templates and tokenizes requests in a small thread pool."""

    def __init__(self, info: EngineInfo, model_name: str, chat_template: str | None,
                 limits: ServerLimits, num_workers: int = 2) -> None:
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.model_path = info.model_path
        self.model_name = model_name
        self.chat_template = chat_template
        self.limits = limits
        self.grammars = info.grammars
        self.pool = concurrent.futures.ThreadPoolExecutor(num_workers,
                                                          thread_name_prefix="rung-prepare")
        # NOTE: requests with their own template wait here, one at a time (the renderer
        # is one child), so they never hold the workers every other request needs
        self.template_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="rung-template")
        self.renderer = TemplateRenderer(limits.chat_template_timeout_s)

    async def completion(self, body: bytes) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self._completion, body)

    async def chat(self, body: bytes) -> Prepared:
        loop = asyncio.get_running_loop()
        req = await loop.run_in_executor(self.pool, self._parse_chat, body)
        executor = self.pool if req.chat_template is None else self.template_pool
        return await loop.run_in_executor(executor, self._chat, req)

    async def tokenize(self, body: bytes) -> dict:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self._tokenize_body, body)

    async def detokenize(self, body: bytes) -> dict:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self._detokenize_body, body)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.template_pool.shutdown(wait=False, cancel_futures=True)
        self.renderer.close()

    # --- worker threads ---------------------------------------------------------------------
    def _completion(self, body: bytes) -> Prepared:
        req = _parse(CompletionRequest, body, self.limits)
        self._check(req)
        prompts = [self._tokenize(p, "prompt") for p in completion_prompts(req)]
        echo_only = req.echo and req.max_tokens == 0
        if req.echo and req.stream:
            raise BadRequest("echo=true with stream=true is not supported", "echo")
        # NOTE: vLLM's way: echo without generation runs one step and drops its token
        params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = req.logprobs
        self._check_length(prompts, params, "prompt")
        self._compile_grammar(req, params)
        return Prepared(req, prompts, params, echo_only=echo_only)

    def _tokenize_body(self, body: bytes) -> dict:
        """vLLM's /tokenize answer: count, max_model_len, tokens (and token_strs)."""
        req = _parse(TokenizeRequest, body, self.limits)
        self._check_model(req.model)
        tok = self._need_tokenizer("prompt" if req.messages is None else "messages")
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("send exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            chat = ChatCompletionRequest(messages=req.messages)
            try:
                ids = apply_chat_template(tok, chat_messages(chat), self.chat_template,
                                          req.add_generation_prompt,
                                          self.model_path)["prompt_token_ids"]
            except BadRequest:
                raise
            except Exception as e:  # noqa: BLE001 - the template's error is the client's
                raise BadRequest(f"chat template failed: {type(e).__name__}: {e}",
                                 "messages") from None
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs if req.return_token_strs else None}

    def _detokenize_body(self, body: bytes) -> dict:
        req = _parse(DetokenizeRequest, body, self.limits)
        self._check_model(req.model)
        tok = self._need_tokenizer("tokens")
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of the vocabulary [0, "
                             f"{self.vocab_size})", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    def _need_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise BadRequest(f"model {self.model_path!r} has no tokenizer", field)
        return self.tokenizer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"The model `{model}` does not exist; this server "
                            f"serves `{self.model_name}`", "model")

    def _parse_chat(self, body: bytes) -> ChatCompletionRequest:
        req = _parse(ChatCompletionRequest, body, self.limits)
        self._check(req)
        return req

    def _chat(self, req: ChatCompletionRequest) -> Prepared:
        messages = chat_messages(req)
        tools = plan(req.tools, req.tool_choice)
        try:
            if req.chat_template is not None:
                prompt = self._render_request_template(req.chat_template, messages,
                                                       req.add_generation_prompt)
            else:
                prompt = apply_chat_template(
                    self.tokenizer, messages, self.chat_template, req.add_generation_prompt,
                    self.model_path, tools=req.tools,
                    encode=lambda text: self._encode(text, "messages",
                                                     add_special_tokens=False))
        except TemplateTimeout:
            raise BadRequest(f"chat_template did not render within "
                             f"{self.limits.chat_template_timeout_s} s "
                             "(--chat-template-timeout)", "chat_template") from None
        except BadRequest:
            raise
        except Exception as e:      # noqa: BLE001 - a template's own error is the client's
            field = "chat_template" if req.chat_template is not None else "messages"
            raise BadRequest(f"chat template failed: {type(e).__name__}: {e}", field) from None
        if req.max_completion_tokens is not None:
            max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = req.max_tokens, "max_tokens"
        num_top = req.top_logprobs or 0
        try:
            params = sampling_params(req, max_tokens, num_top if req.logprobs else None)
        except BadRequest as e:
            if e.param == "max_tokens":
                e.param = field
            raise
        self._check_length([prompt], params, "messages")
        field = None
        if tools is not None and tools.mode == "forced":
            if params.structured_outputs is not None:
                raise BadRequest("tool_choice forces a tool call: response_format / "
                                 "structured_outputs cannot constrain the same output",
                                 "tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=tools.schema)
            field = "tools"
        self._compile_grammar(req, params, field)
        return Prepared(req, [prompt], params, num_top, tools=tools)

    def _compile_grammar(self, req: Any, params: SamplingParams, field: str | None = None
                         ) -> None:
        """A bad schema / regex / grammar is the client's 400, found here (the compile is
        cached: an engine in this process finds it done; one in its own process compiles
        it again)."""
        spec = params.structured_outputs
        if spec is None:
            return
        field = field or ("response_format" if (req.model_extra or {}).get("response_format")
                          is not None else "structured_outputs")
        if self.tokenizer is None:
            raise BadRequest(f"{field} needs a tokenizer; model {self.model_path!r} has none",
                             field)
        try:
            self.grammars.compile(spec)
        except ValueError as e:
            raise BadRequest(str(e).replace("structured_outputs", field, 1), field) from None

    def _render_request_template(self, template: str, messages: list[dict],
                                 add_generation_prompt: bool) -> dict:
        """A client's template renders in the sandbox process (rung.server.
        template_sandbox); the server's own renders here, as LLM.chat does."""
        tok = self.tokenizer
        if tok is None:
            raise BadRequest(f"model {self.model_path!r} has no tokenizer to apply a chat "
                             "template with", "messages")
        text = self.renderer.render(template, messages, add_generation_prompt,
                                    tok.id_to_token(tok.bos_token_id),
                                    tok.id_to_token(tok.eos_token_id))
        # NOTE: as apply_chat_template: the template writes the special tokens it wants
        return {"prompt": text,
                "prompt_token_ids": self._encode(text, "messages", add_special_tokens=False)}

    def _check(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(req.model)
        limits_mod.check(req, self.limits)

    def _tokenize(self, prompt: str | dict, field: str) -> dict:
        """``{"prompt", "prompt_token_ids"}``, so usage and the length check are known
        before the engine sees the request (it tokenizes text the same way)."""
        if isinstance(prompt, dict):
            return prompt
        if not prompt:
            raise BadRequest(f"{field} is empty: it must hold at least 1 token", field)
        if self.tokenizer is None:
            raise BadRequest(f"model {self.model_path!r} has no tokenizer: send token ids",
                             field)
        return {"prompt": prompt, "prompt_token_ids": self._encode(prompt, field)}

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, or a 400 as soon as a prefix of it is over max_model_len:
        a prompt far over it costs a few max_model_len tokens of work, not its size's."""
        try:
            return encode_within(self.tokenizer, text, self.max_model_len, add_special_tokens)
        except TooManyTokens as e:
            raise BadRequest(f"{field} has {e}, longer than max_model_len="
                             f"{self.max_model_len}", field) from None

    def _check_length(self, prompts: list[dict], params: SamplingParams, field: str) -> None:
        for p in prompts:
            num = len(p["prompt_token_ids"])
            if num > self.max_model_len:
                raise BadRequest(f"{field} has {num} tokens, longer than max_model_len="
                                 f"{self.max_model_len}", field)
            overflow = context_overflow(num, params.max_tokens, self.max_model_len)
            if overflow is not None:
                raise BadRequest(overflow, "max_tokens")


def _parse(model: type[BaseModel], body: bytes, limits: ServerLimits) -> Any:
    """The validated request, or a 400 naming the first bad field (malformed JSON and
    lone surrogates included: the JSON parser refuses both). NOTE: parsed first and
    validated after the list limits: validating JSON directly into the prompt's union
    type is much slower, and a list's cost is only bounded once its length is checked."""
    try:
        data = pydantic_core.from_json(body)
    except ValueError as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(data).__name__}")
    limits_mod.check_sizes(data, limits)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ())]
        raise BadRequest(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}",
                         loc[0] if loc else None) from None
