"""``SamplingParams.n > 1``: one child request per sample, gathered into one RequestOutput.

NOTE: each child runs its own prefill of the shared prompt (the children are scheduled
together, so they share no KV blocks); sharing the prompt's blocks is left to prefix caching.
"""

from __future__ import annotations

import dataclasses

from rung.runtime.outputs import CompletionOutput, RequestOutput
from rung.runtime.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """The user's request id, its ``n`` children, and their finished completions."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = params.output_kind
        self.child_ids = [f"{index}_{request_id}" for index in range(params.n)]
        self.finished: dict[int, CompletionOutput] = {}

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        """One sample's params; a seeded request gives each child its own seed."""
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(params, n=1, seed=seed)

    def gather(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """A child's output as the parent's: streamed as it comes (one completion), and
        once every child has finished, all ``n`` completions in one finished output.
        Under ``output_kind=DELTA`` every child's delta is passed on as it comes (by
        ``index``); the last child to finish makes the parent's output finished."""
        completion = out.outputs[0]
        completion.index = index
        if self.output_kind == RequestOutputKind.DELTA:
            if out.finished:
                self.finished[index] = completion
            return dataclasses.replace(out, request_id=self.request_id,
                                       finished=len(self.finished) == self.n)
        if not out.finished:
            return dataclasses.replace(out, request_id=self.request_id)
        self.finished[index] = completion
        if len(self.finished) < self.n:
            return None
        return dataclasses.replace(out, request_id=self.request_id,
                                   outputs=[self.finished[i] for i in range(self.n)])
