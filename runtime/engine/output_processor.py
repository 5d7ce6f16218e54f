"""What a step's new tokens mean for a request (stop checks, logprobs) and the
RequestOutput it reports. The tokens themselves go in through ``Request.commit``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from rung.runtime.detokenizer import find_stop_string
from rung.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from rung.runtime.sampling_params import RequestOutputKind
from rung.runtime.sched.request import Request


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._prompt_logprobs: dict[Any, list] = {}    # request id -> prompt_logprobs so far

    def add_prompt_logprobs(self, req: Request, first: int, logprobs: list) -> None:
        """Entries from prompt position ``first`` on; a recomputed prefix (preemption)
        adds nothing new."""
        store = self._prompt_logprobs.setdefault(req.request_id, [None])
        for position, entry in enumerate(logprobs, start=first):
            if position == len(store):
                store.append(self._decoded(entry))

    def record_logprobs(self, req: Request, tokens: list[int], logprobs: list | None
                        ) -> None:
        """Record the logprobs of ``tokens``, the ones that went in this step."""
        if logprobs is not None and req.logprobs is not None:
            for i, token in enumerate(tokens):
                req.logprobs.append(self._decoded(logprobs[i]))
                req.cumulative_logprob += logprobs[i][token].logprob

    def _decoded(self, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return logprobs
        decode = self.tokenizer.decode
        return {t: dataclasses.replace(lp, decoded_token=decode([t]))
                for t, lp in logprobs.items()}

    def _hits_stop_string(self, req: Request) -> bool:
        """Whether the text the last token added completes a stop string; if so, the text
        is cut where it ends. Costs one short decode, not a decode of the whole output."""
        p, detok = req.params, req.detokenizer
        num_new_chars = detok.update(req.num_output_tokens)
        if req.num_output_tokens < p.min_tokens:
            return False
        hit = find_stop_string(detok.text, num_new_chars, p.stop, p.include_stop_str_in_output)
        if hit is None:
            return False
        req.stop_reason, text_end = hit
        detok.truncate(text_end)
        return True

    def stop_reason(self, req: Request, token: int) -> str | None:
        """Why ``token`` (just appended) ends the request, or None. A stop token or string
        wins over a length limit the same token reaches. Sets ``req.stop_reason``."""
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if p.stop and self._hits_stop_string(req):
            return "stop"
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def make_output(self, req: Request) -> RequestOutput | None:
        """The request's output as its ``output_kind`` asks (None: nothing to report yet)."""
        kind = req.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not req.is_finished:
            return None
        first = req.num_sent_tokens if kind == RequestOutputKind.DELTA else 0
        # NOTE: the slice is the output's own copy of the ids
        token_ids = req.token_ids[req.num_prompt_tokens + first:]
        completion = CompletionOutput(0, token_ids,
                                      req.cumulative_logprob if req.logprobs is not None
                                      else None,
                                      req.logprobs[first:] if req.logprobs is not None else None,
                                      req.finish_reason, req.stop_reason, error=req.error)
        detok = req.detokenizer
        if kind == RequestOutputKind.DELTA:
            text = detok.text_at(req.num_output_tokens, req.is_finished) if detok else ""
            completion.text = text[req.num_sent_chars:]
            req.num_sent_tokens, req.num_sent_chars = req.num_output_tokens, len(text)
        elif detok is not None:
            completion.detokenize = functools.partial(detok.text_at, req.num_output_tokens,
                                                      req.is_finished)
        prompt_lps = (self._prompt_logprobs.get(req.request_id, [None])
                      if req.params.prompt_logprobs is not None else None)
        if req.is_finished:
            self._prompt_logprobs.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.is_finished, prompt_lps, req.num_cached_tokens)
