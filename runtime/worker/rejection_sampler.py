"""Verify drafts against the target, batched over [num_reqs, k + 1], on the device.

Deterministic drafts (n-gram, MTP's greedy rounds): draft i is kept while it equals the
target's own token at its position, which the sampler drew with the request's keyed
uniform there (greedy: the argmax). Every emitted token is then the one the target emits
at that position without speculation, so the output is lossless by construction and a
seeded sampled run is token-identical with and without speculation; the acceptance rate
equals the classic rule's (a draft d is kept with probability p(d) either way).

Drafts with a distribution q (`rejection_sample_with_probs`): the classic rule, keep d
with probability min(1, p(d) / q(d)), on the first rejection resample from
norm(max(p - q, 0)); still lossless, with uniforms keyed by (request, position) too.
"""

from __future__ import annotations

import numpy as np
import torch

from rung.runtime.worker.sampler import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    SamplingBatch,
    inverse_cdf,
    to_device,
)
from rung.runtime.worker.sampler import uniforms as keyed_uniforms


def num_accepted(target: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """target [num_rows] int64, the sampler's tokens -> accepted drafts [num_reqs] int64.

    e.g. drafts [[5, 7, 9]], target at their rows [5, 7, 2, 4] -> [2]: the request emits
    5, 7, 2 (its rows 0..accepted).
    """
    if batch.drafts.shape[1] == 0:
        return torch.zeros(len(batch.starts), dtype=torch.int64, device=target.device)
    at_drafts = target[batch.draft_rows[:, :-1]]                  # [num_reqs, k_max]
    match = at_drafts == batch.drafts                             # NOTE: -1 pads never match
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)


def rejection_sample_with_probs(probs: torch.Tensor, target: torch.Tensor,
                                draft_probs: torch.Tensor, batch: SamplingBatch
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic lossless rule for drafts drawn from ``draft_probs``.

    probs [num_rows, V] the target's sampling distribution per row; target [num_rows] its
    tokens; draft_probs [num_reqs, k_max, V] -> (tokens [num_rows], accepted [num_reqs]):
    request j emits tokens[starts[j] : starts[j] + accepted[j] + 1].
    """
    num_reqs, k_max = batch.drafts.shape
    if k_max == 0 or batch.argmax:      # NOTE: all greedy: the rule keeps matching drafts
        return target, num_accepted(target, batch)
    rows = batch.draft_rows[:, :-1]                                # [num_reqs, k_max]
    valid = batch.drafts >= 0
    drafts = batch.drafts.clamp(min=0)
    p = probs[rows]                                                # [num_reqs, k_max, V]
    p_d = p.gather(2, drafts.unsqueeze(2)).squeeze(2)
    q_d = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
    u_accept = _uniforms(batch, STREAM_ACCEPT, rows, probs.device)
    accept = valid & (u_accept * q_d < p_d)                       # u < min(1, p / q)
    greedy = batch.greedy[rows]
    accept = torch.where(greedy, target[rows] == batch.drafts, accept)
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)   # [num_reqs]
    residual = (p - draft_probs).clamp(min=0)
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    u_residual = _uniforms(batch, STREAM_RESIDUAL, rows, probs.device)
    resampled = inverse_cdf(residual.flatten(0, 1), u_residual.flatten()).view(num_reqs, k_max)
    tokens = target.clone()
    kept = torch.arange(k_max, device=probs.device) < accepted.unsqueeze(1)
    tokens[rows[kept]] = batch.drafts[kept]                        # the kept drafts
    at = accepted.clamp(max=k_max - 1).unsqueeze(1)               # first rejected draft
    rejected = (accepted < k_max) & valid.gather(1, at).squeeze(1)
    first_rejected = rows.gather(1, at).squeeze(1)
    fix = torch.where(greedy[:, 0], tokens[first_rejected], resampled.gather(1, at).squeeze(1))
    tokens[first_rejected] = torch.where(rejected, fix, tokens[first_rejected])
    return tokens, accepted


def _uniforms(batch: SamplingBatch, stream: int, rows: torch.Tensor,
              device: torch.device) -> torch.Tensor:
    """The keyed uniforms of ``stream`` at the draft rows. -> [num_reqs, k_max] fp32."""
    u = keyed_uniforms(batch.keys, batch.positions, stream).astype(np.float32)
    return to_device(device, u)[rows]
