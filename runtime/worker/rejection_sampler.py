"""Verify drafts against the target: greedy exact, and the lossless accept/resample rule."""

from __future__ import annotations

import torch

from rung.runtime.sched.request import Request
from rung.runtime.worker.sampler import apply_min_tokens, sampling_probs


def mask_min_tokens(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Row i is the position of output token num_output_tokens + i. logits [k + 1, V]."""
    if req.num_output_tokens >= req.params.min_tokens:
        return logits
    return apply_min_tokens(logits.clone(), [_Shifted(req, i) for i in range(logits.shape[0])])


class _Shifted:
    """A request seen ``offset`` tokens later (for per-position min_tokens masking)."""

    def __init__(self, req: Request, offset: int) -> None:
        self.params = req.params
        self.eos_token_id = req.eos_token_id
        self.num_output_tokens = req.num_output_tokens + offset


def rejection_sample(logits: torch.Tensor, drafts: list[int], req: Request,
                     generator: torch.Generator,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """Accepted drafts plus one target token. logits [k + 1, V] fp32 at the k + 1 verified
    positions; ``draft_probs`` [k, V] (None: drafts were proposed deterministically).

    Greedy: drafts are kept while they equal the target's argmax. Sampling: draft d is
    kept with probability min(1, p(d) / q(d)); the first rejection resamples from
    max(p - q, 0), normalised; when every draft is kept a bonus token comes from p.
    Either way the output is distributed exactly as the target's own samples.
    """
    logits = mask_min_tokens(logits, req)
    if req.params.greedy:
        target = logits.argmax(dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if target[i] != d:
                return out + [target[i]]
            out.append(d)
        return out + [target[len(drafts)]]
    gen = req.generator or generator
    probs = sampling_probs(logits.cpu(), [req] * logits.shape[0])     # [k + 1, V]
    out = []
    for i, d in enumerate(drafts):
        p = probs[i]
        q = _one_hot(d, p) if draft_probs is None else draft_probs[i].cpu()
        accept = min(1.0, float(p[d]) / max(float(q[d]), 1e-20))
        if float(torch.rand((), generator=gen)) < accept:
            out.append(d)
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = p
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=gen))]


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
