"""BatchExecutionDescriptor: the real and padded counts of one batch."""

from __future__ import annotations

import dataclasses

from rung.core.errors import ContractError
from rung.core.graph_mode import CUDAGraphMode


@dataclasses.dataclass(frozen=True)
class BatchExecutionDescriptor:
    """What one forward pass runs, real counts beside padded ones.

    Every request-indexed tensor handed to attention has leading size
    ``num_reqs_padded``; every token-indexed tensor ``num_tokens_padded``.
    """

    mode: CUDAGraphMode            # runtime mode: NONE, PIECEWISE or FULL
    num_reqs: int                  # requests scheduled
    num_reqs_padded: int           # rows the graph was captured for
    num_tokens: int                # tokens scheduled
    num_tokens_padded: int         # tokens the graph was captured for
    uniform_query_len: int | None = None         # tokens per request, when all equal
    num_tokens_across_dp: tuple[int, ...] | None = None  # per-rank padded tokens (DP only)

    def __post_init__(self) -> None:
        if self.mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ContractError(f"runtime mode must be NONE, PIECEWISE or FULL, got {self.mode}")
        if not 0 <= self.num_reqs <= self.num_reqs_padded:
            raise ContractError(f"num_reqs {self.num_reqs} > num_reqs_padded "
                                f"{self.num_reqs_padded}")
        if not 0 <= self.num_tokens <= self.num_tokens_padded:
            raise ContractError(f"num_tokens {self.num_tokens} > num_tokens_padded "
                                f"{self.num_tokens_padded}")
        if self.num_reqs > self.num_tokens and self.num_tokens != 0:
            raise ContractError(f"{self.num_reqs} requests cannot share {self.num_tokens} tokens")
        if self.mode == CUDAGraphMode.NONE:
            if self.num_reqs_padded != self.num_reqs:
                raise ContractError("NONE never pads requests")
            if self.num_tokens_padded != self.num_tokens and self.num_tokens_across_dp is None:
                raise ContractError("NONE pads tokens only for DP")
        if (self.uniform_query_len is not None
                and self.num_tokens != self.num_reqs * self.uniform_query_len):
            raise ContractError(f"uniform query len {self.uniform_query_len} x {self.num_reqs} "
                                f"requests != {self.num_tokens} tokens")

    @classmethod
    def eager(cls, num_reqs: int, num_tokens: int, uniform_query_len: int | None = None,
              num_tokens_across_dp: tuple[int, ...] | None = None) -> BatchExecutionDescriptor:
        """No graph. Under data parallel, tokens pad to the size every rank runs."""
        num_tokens_padded = max(num_tokens_across_dp) if num_tokens_across_dp else num_tokens
        return cls(CUDAGraphMode.NONE, num_reqs, num_reqs, num_tokens, num_tokens_padded,
                   uniform_query_len, num_tokens_across_dp)

    @classmethod
    def dp_dummy(cls, num_tokens_across_dp: tuple[int, ...]) -> BatchExecutionDescriptor:
        """A data-parallel rank with no request of its own: all pads, shaped like a
        piecewise capture batch (one pad row keeps attention well-formed)."""
        return cls(CUDAGraphMode.PIECEWISE, 0, 1, 0, max(num_tokens_across_dp), None,
                   num_tokens_across_dp)

    def for_drafting(self, num_query_tokens: int = 1) -> BatchExecutionDescriptor:
        """Descriptor of a draft step: ``num_query_tokens`` per REAL request.

        NOTE: never derived from padded counts: the target's graph padding and data
        parallel padding are both dropped here (failure class 3).
        """
        num_tokens = self.num_reqs * num_query_tokens
        return BatchExecutionDescriptor(CUDAGraphMode.NONE, self.num_reqs, self.num_reqs,
                                        num_tokens, num_tokens, num_query_tokens)
