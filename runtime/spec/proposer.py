"""Speculative decoding: the proposer interface, the n-gram proposer, acceptance stats."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import numpy as np

from rung.core.descriptor import BatchExecutionDescriptor
from rung.runtime.config import EngineConfig
from rung.runtime.sched.request import Request

if TYPE_CHECKING:
    from rung.graphs.manager import CaptureRecord, GraphManager
    from rung.runtime.worker.model_runner import ModelRunner, ModelRunnerOutput


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


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (between
    ``min_n`` and ``max_n`` tokens) and propose the tokens that followed it."""

    def __init__(self, num_spec_tokens: int, min_n: int, max_n: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, desc: BatchExecutionDescriptor, reqs: list[Request],
                result: ModelRunnerOutput | None = None,
                num_tokens_across_dp: tuple[int, ...] | None = None) -> list[list[int]]:
        # NOTE: host-only drafts: nothing to pad under data parallel
        check_draft_rows(desc, reqs)
        return [self.propose_one(r.token_ids) for r in reqs]

    def propose_one(self, token_ids: list[int]) -> list[int]:
        tokens = np.asarray(token_ids)
        k = self.num_spec_tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n
                follow = tokens[start:start + k].tolist()
                return _pad(follow, k, token_ids[-1])
        # NOTE: always k drafts, so verify batches stay uniform (and FULL-graph eligible);
        # a filler draft is simply rejected.
        return [token_ids[-1]] * k


def _pad(drafts: list[int], k: int, filler: int) -> list[int]:
    return drafts + [drafts[-1] if drafts else filler] * (k - len(drafts))


def check_draft_rows(desc: BatchExecutionDescriptor, reqs: list[Request]) -> None:
    """Failure class 3: a draft step runs one query per REAL request, never padded rows."""
    if len(reqs) != desc.num_reqs or desc.num_tokens != desc.num_reqs:
        raise RuntimeError(f"draft step for {len(reqs)} requests got a descriptor of "
                           f"{desc.num_reqs} requests / {desc.num_tokens} tokens: drafting "
                           "runs one query per real request")


def make_proposer(config: EngineConfig, runner: ModelRunner) -> Proposer:
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    from rung.runtime.spec.mtp import MtpProposer

    return MtpProposer.build(config, runner)
