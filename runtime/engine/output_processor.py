"""The RequestOutput a request reports after a step, as its ``output_kind`` asks. What the
step's tokens mean for the request (stop checks, logprobs) is the request's own
(``Request.commit``)."""

from __future__ import annotations

import functools

from rung.runtime.outputs import CompletionOutput, RequestOutput
from rung.runtime.sampling_params import RequestOutputKind
from rung.runtime.sched.request import Request


def make_output(req: Request) -> RequestOutput | None:
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
        req.mark_sent(req.num_output_tokens, len(text))
    elif detok is not None:
        completion.detokenize = functools.partial(detok.text_at, req.num_output_tokens,
                                                  req.is_finished)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                         req.is_finished, req.prompt_logprobs, req.num_cached_tokens)


def make_outputs(reqs: list[Request]) -> list[RequestOutput | None]:
    """`make_output` of each request of a step, in order."""
    return [make_output(req) for req in reqs]
