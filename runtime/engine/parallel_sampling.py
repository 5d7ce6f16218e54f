"""``SamplingParams.n > 1``: one child request per sample, gathered into one RequestOutput.

NOTE: each child runs its own prefill of the shared prompt (the children are scheduled
together, so they share no KV blocks); sharing the prompt's blocks is left to prefix caching.
"""

from __future__ import annotations

import dataclasses

from rung.runtime.outputs import CompletionOutput, RequestOutput
from rung.runtime.request_ids import RequestId, SampleId
from rung.runtime.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """The user's request id, its ``n`` children, and their finished completions."""

    def __init__(self, request_id: RequestId, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = params.output_kind
        # NOTE: ids of their own type: no user id can alias a sample (request_ids.py)
        self.child_ids = [SampleId(request_id, index) for index in range(params.n)]
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


class ParallelSampling:
    """The ``n > 1`` requests the engine holds: which child belongs to which parent."""

    def __init__(self) -> None:
        self._parents: dict[RequestId, ParentRequest] = {}
        # sample id -> (its parent, its index); empty while no n > 1 request runs
        self.children: dict[RequestId, tuple[ParentRequest, int]] = {}

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._parents

    def add(self, parent: ParentRequest) -> None:
        self._parents[parent.request_id] = parent
        for index, child_id in enumerate(parent.child_ids):
            self.children[child_id] = (parent, index)

    def abort(self, request_id: RequestId) -> list[SampleId] | None:
        """The children of parent ``request_id`` (forgotten here), or None: not a parent."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child_id in parent.child_ids:
            self.children.pop(child_id, None)
        return parent.child_ids

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A child of an ``n > 1`` request reports as its parent."""
        return [g for g in map(self._gather_one, outputs) if g is not None]

    def _gather_one(self, out: RequestOutput) -> RequestOutput | None:
        parent, index = self.children.get(out.request_id, (None, 0))
        if parent is None:
            return out
        gathered = parent.gather(index, out)
        if out.finished:
            del self.children[out.request_id]
        if gathered is not None and gathered.finished:
            del self._parents[parent.request_id]
        return gathered
