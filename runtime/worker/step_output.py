"""A step's output and the step's one device-to-host copy that carries it: `StepCopy`
packs what the host reads of a step on the device (one float64 tensor, offsets computed
here alone) and unpacks the copied values on the host into the `ModelRunnerOutput` the
engine and a proposer read (tokens per request, vLLM's ``{token id: Logprob}`` dicts for
sampled tokens and prompt positions, a device drafter's drafts)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.runtime.outputs import Logprob
from rung.runtime.sched.request import Request
from rung.runtime.sched.scheduler import SchedulerOutput
from rung.runtime.worker.input_batch import HostCopyFence

# (request, first token row, first prompt position, count): prompt positions whose next
# prompt token's logprob a step computes
PromptRows = tuple[Request, int, int, int]


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


@dataclasses.dataclass
class StepCopy:
    """What the host reads of one step, on the device until `HostCopy.fetch` copies it.

    Packed in this order into one float64 tensor, each section only when present (a token
    id or a count is exact in float64):
      tokens          [num_rows] the sampler's token per logits row; request j owns rows
                      [starts[j], starts[j] + 1 + k_j)
      accepted        [num_sampling] drafts kept per sampling request
      logprobs        [num_rows, 2 + 2 * num_top] `token_logprobs` rows
      prompt_logprobs [num_prompt_rows, 2 + 2 * num_top_prompt] `token_logprobs` rows of
                      the ``prompt`` positions
      drafts          [num_reqs, k] a device drafter's drafts, per scheduled request
    """

    reqs: list[Request]                      # host: the sampling requests, in row order
    starts: np.ndarray | None                # host [num_sampling] int64: first row of each
    tokens: torch.Tensor | None
    accepted: torch.Tensor | None
    logprobs: torch.Tensor | None
    prompt: list[PromptRows]
    prompt_logprobs: torch.Tensor | None
    drafts: torch.Tensor | None

    def pack(self) -> tuple[torch.Tensor, list[torch.Size | None] | None]:
        """Device side: every section, flattened, in one float64 tensor; and the sections'
        shapes, in order (None where absent), that `unpack` cuts the copy back by (None:
        the tokens alone)."""
        sections = (self.tokens, self.accepted, self.logprobs, self.prompt_logprobs,
                    self.drafts)
        if self.accepted is None and self.logprobs is None and self.prompt_logprobs is None \
                and self.drafts is None:           # NOTE: the common step: tokens alone
            return self.tokens.double(), None
        parts = [t.double().reshape(-1) for t in sections if t is not None]
        return torch.cat(parts), [None if t is None else t.shape for t in sections]

    def unpack(self, host: np.ndarray, shapes: list | None, out: ModelRunnerOutput) -> None:
        """Host side: ``host`` (the packed values, cut by ``shapes`` from `pack`) ->
        ``out``'s sampled tokens, logprobs, prompt logprobs and drafts."""
        if shapes is None:
            views = [host, None, None, None, None]
        else:
            views, end = [], 0
            for shape in shapes:
                if shape is None:
                    views.append(None)
                    continue
                n = int(np.prod(shape))
                views.append(host[end:end + n].reshape(shape))
                end += n
        tokens, accepted, lps, prompt_lps, drafts = views
        if tokens is not None:
            self._unpack_sampled(tokens, accepted, lps, out)
        if prompt_lps is not None:
            self._unpack_prompt(prompt_lps, out)
        if drafts is not None:
            out.drafts = drafts.astype(np.int64).tolist()

    def _unpack_sampled(self, tokens: np.ndarray, accepted: np.ndarray | None,
                        lps: np.ndarray | None, out: ModelRunnerOutput) -> None:
        tokens = tokens.astype(np.int64)
        accepted = (accepted.astype(np.int64).tolist() if accepted is not None
                    else [0] * len(self.reqs))
        for req, start, n_acc in zip(self.reqs, self.starts.tolist(), accepted):
            out.sampled[req.request_id] = tokens[start:start + n_acc + 1].tolist()
            if req.params.logprobs is not None:
                out.logprobs[req.request_id] = [
                    logprob_dict(int(tokens[r]), lps[r], req.params.logprobs)
                    for r in range(start, start + n_acc + 1)]

    def _unpack_prompt(self, lps: np.ndarray, out: ModelRunnerOutput) -> None:
        row = 0
        for req, _, first, n in self.prompt:
            ids = req.prompt_token_ids[first + 1:first + 1 + n]
            out.prompt_logprobs[req.request_id] = (first + 1, [
                logprob_dict(t, lps[row + i], req.params.prompt_logprobs)
                for i, t in enumerate(ids)])
            row += n


class HostCopy:
    """Pinned staging of the step's one device-to-host copy, behind a HostCopyFence.

    NOTE: the copy is non_blocking into pinned memory, then the fence waits on its event:
    the one host sync of a step on CUDA. On CPU the device tensor is host memory, read in
    place.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fence = HostCopyFence(device)
        self._pinned: torch.Tensor | None = None        # [capacity] float64, grown on demand

    def fetch(self, step: StepCopy, out: ModelRunnerOutput) -> None:
        """Pack ``step`` on the device, copy it to the host, unpack it into ``out``."""
        packed, shapes = step.pack()                    # [n] float64 on the device
        if self.device.type == "cpu":
            step.unpack(packed.numpy(), shapes, out)
            return
        n = packed.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 4096), dtype=torch.float64, pin_memory=True)
        host = self._pinned[:n]
        host.copy_(packed, non_blocking=True)
        self.fence.record()
        self.fence.wait()
        step.unpack(host.numpy(), shapes, out)


def prompt_rows(sched: SchedulerOutput) -> list[PromptRows]:
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


def logprob_dict(token: int, row: np.ndarray, num_top: int) -> dict[int, Logprob]:
    """row: [lp, rank, top lps..., top ids...] (`token_logprobs`) -> vLLM's dict: the
    sampled token first, then the top ``num_top`` (the sampled one may be among them)."""
    width = (len(row) - 2) // 2
    entry = {token: Logprob(float(row[0]), int(row[1]))}
    for i in range(num_top):
        entry.setdefault(int(row[2 + width + i]), Logprob(float(row[2 + i]), i + 1))
    return entry
