"""N-gram (prompt lookup) proposer: drafts from the request's own tokens, on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rung.core.descriptor import BatchExecutionDescriptor
from rung.runtime.sched.request import Request
from rung.runtime.spec.proposer import Proposer, check_draft_rows

if TYPE_CHECKING:
    from rung.runtime.worker.step_output import ModelRunnerOutput


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
