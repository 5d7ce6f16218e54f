"""What one target step hands back (`ModelRunnerOutput`) and how the host reads the logprob
rows of the step's one device-to-host copy into it (vLLM's ``{token id: Logprob}`` dicts,
for sampled tokens and for prompt positions)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.runtime.outputs import Logprob
from rung.runtime.sched.request import Request
from rung.runtime.sched.scheduler import SchedulerOutput


@dataclasses.dataclass
class ModelRunnerOutput:
    """What one target step produced: everything the engine and a proposer read after it.

    NOTE: ``hidden`` and ``logits`` may be views of static graph buffers: they are valid
    until the next step runs, and a caller that keeps them longer clones them.
    """

    desc: BatchExecutionDescriptor                   # how the step ran (real and padded counts)
    sampled: dict[str, list[int]]                    # request id -> new tokens (maybe none)
    logprobs: dict[str, list[dict[int, Logprob]]]    # request id -> one dict per new token
    hidden: torch.Tensor          # [num_tokens_padded, hidden] the target's last hidden states
    logits: torch.Tensor          # [num_logits, vocab] at layout.logits_indices
    # request id -> (position of its first entry, one dict per prompt token from there)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = dataclasses.field(
        default_factory=dict)
    # a device drafter's k drafts per scheduled request (row order), back in the step's one
    # copy; None without one, or when no request sampled
    drafts: list[list[int]] | None = None


def prompt_rows(sched: SchedulerOutput) -> list[tuple[Request, int, int, int]]:
    """(request, first token row, first position, count) of the prompt positions whose
    next prompt token's logprob was asked for (``prompt_logprobs``) in this step."""
    found, row = [], 0
    for s in sched.scheduled:
        req = s.request
        first = req.num_computed_tokens
        last = min(first + s.num_new_tokens, req.num_prompt_tokens - 1)
        if req.params.prompt_logprobs is not None and last > first:
            found.append((req, row, first, last - first))
        row += s.num_new_tokens
    return found


def unpack_prompt_logprobs(host: np.ndarray, prompt: list[tuple[Request, int, int, int]],
                   out: ModelRunnerOutput) -> np.ndarray:
    """host: [num_prompt_rows, 2 + 2 * num_top] (`_prompt_logprobs`) -> out.prompt_logprobs.
    Returns what follows."""
    num_rows = sum(n for *_, n in prompt)
    num_top = max(req.params.prompt_logprobs for req, *_ in prompt)
    end = num_rows * (2 + 2 * num_top)
    lps = host[:end].reshape(num_rows, -1)
    row = 0
    for req, _, first, n in prompt:
        ids = req.prompt_token_ids[first + 1:first + 1 + n]
        out.prompt_logprobs[req.request_id] = (first + 1, [
            logprob_dict(t, lps[row + i], req.params.prompt_logprobs)
            for i, t in enumerate(ids)])
        row += n
    return host[end:]


def logprob_dict(token: int, row: np.ndarray, num_top: int) -> dict[int, Logprob]:
    """row: [lp, rank, top lps..., top ids...] (`token_logprobs`) -> vLLM's dict: the
    sampled token first, then the top ``num_top`` (the sampled one may be among them)."""
    width = (len(row) - 2) // 2
    entry = {token: Logprob(float(row[0]), int(row[1]))}
    for i in range(num_top):
        entry.setdefault(int(row[2 + width + i]), Logprob(float(row[2 + i]), i + 1))
    return entry
