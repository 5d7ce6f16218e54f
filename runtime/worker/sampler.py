"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from rung.runtime.outputs import Logprob
from rung.runtime.sched.request import Request


def apply_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Mask EOS and stop tokens for requests below min_tokens. logits [N, V]."""
    for row, req in enumerate(reqs):
        p = req.params
        if req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids)
            if req.eos_token_id is not None and not p.ignore_eos:
                banned.append(req.eos_token_id)
            if banned:
                logits[row, banned] = float("-inf")
    return logits


def sampling_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row. logits [N, V] fp32."""
    temps = torch.tensor([max(r.params.temperature, 1e-5) for r in reqs],
                         device=logits.device).unsqueeze(1)
    logits = logits / temps
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if any(top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)    # [N, V]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)
    drop = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs                         # mass strictly before
    p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    drop |= before >= p                                           # NOTE: rank 0 always kept
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


def draw(probs: torch.Tensor, reqs: list[Request], generator: torch.Generator) -> torch.Tensor:
    """One token per row by the exponential race argmax(p / E), E ~ Exp(1).

    Seeded requests draw E from their own generator, so their tokens do not depend on
    which other requests share the batch.
    """
    noise = torch.empty_like(probs)
    for row, req in enumerate(reqs):
        noise[row].exponential_(generator=req.generator or generator)
    return (probs / noise).argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """logits [N, V] fp32 (one row per sampled position) -> tokens [N] int64."""
        if any(r.num_output_tokens < r.params.min_tokens for r in reqs):
            logits = apply_min_tokens(logits.clone(), reqs)
        greedy = torch.tensor([r.params.greedy for r in reqs], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = draw(sampling_probs(logits.cpu(), reqs), reqs, self.generator)
            tokens = torch.where(greedy, tokens, sampled.to(tokens.device))
        return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   num_top: list[int | None]) -> list[dict[int, Logprob] | None]:
    """Raw-model logprobs of each sampled token plus the row's top-N. logits [N, V] fp32."""
    if all(n is None for n in num_top):
        return [None] * len(num_top)
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    tokens = tokens.cpu()
    out: list[dict[int, Logprob] | None] = []
    for row, n in enumerate(num_top):
        if n is None:
            out.append(None)
            continue
        lp = logprobs[row]
        token = int(tokens[row])
        entry = {token: Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1)}
        if n:
            top_vals, top_ids = lp.topk(n)
            for rank, (v, t) in enumerate(zip(top_vals.tolist(), top_ids.tolist()), start=1):
                entry.setdefault(t, Logprob(v, rank))
        out.append(entry)
    return out
