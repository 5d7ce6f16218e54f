"""Speculative decoding: the proposer interface and acceptance stats."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from rung.core.descriptor import BatchExecutionDescriptor
from rung.runtime.sched.request import Request

if TYPE_CHECKING:
    from rung.graphs.manager import CaptureRecord, GraphManager
    from rung.runtime.worker.step_output import ModelRunnerOutput


@dataclasses.dataclass
class SpecStats:
    num_spec_tokens: int
    num_drafts: int = 0               # verification rounds
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0       # accepted + bonus
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_spec_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        drafts = max(self.num_drafts, 1)
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "mean_tokens_per_step": self.num_emitted_tokens / drafts,
                "acceptance_per_position": [a / drafts for a in self.accepted_per_position]}


class Proposer:
    """Proposes ``k`` draft tokens per real request of a step.

    ``desc`` is the target step's ``for_drafting()`` descriptor: one query per REAL
    request, never the target's graph padding nor data-parallel padding.
    """

    num_spec_tokens: int

    def capture_all(self, graphs: GraphManager,
                    progress: Callable[[CaptureRecord], None] | None = None) -> None:
        """Capture the proposer's graphs into ``graphs`` (nothing for a host-side one)."""

    def graph_status(self) -> dict | None:
        """The proposer's graphs for engine.stats() (None for a host-side one)."""
        return None

    def propose_dummy(self, num_tokens_across_dp: tuple[int, ...]) -> None:
        """Data parallel: no request on this rank while others draft; run their size on
        pads (nothing for a host-side proposer)."""

    def propose(self, desc: BatchExecutionDescriptor, reqs: list[Request],
                result: ModelRunnerOutput,
                num_tokens_across_dp: tuple[int, ...] | None = None) -> list[list[int]]:
        """``reqs``: the step's real requests in row order; ``result``: the target step's
        output (sampled tokens, hidden states and rows). Returns [num_reqs][k] drafts.
        ``num_tokens_across_dp``: data parallel only, the draft size every rank runs (a
        drafter with collectives pads its inputs, never its attention metadata, to it)."""
        raise NotImplementedError


def check_draft_rows(desc: BatchExecutionDescriptor, reqs: list[Request]) -> None:
    """Failure class 3: a draft step runs one query per REAL request, never padded rows."""
    if len(reqs) != desc.num_reqs or desc.num_tokens != desc.num_reqs:
        raise RuntimeError(f"draft step for {len(reqs)} requests got a descriptor of "
                           f"{desc.num_reqs} requests / {desc.num_tokens} tokens: drafting "
                           "runs one query per real request")
