"""A request's state as the scheduler sees it."""

from __future__ import annotations

import enum

import torch

from rung.runtime.detokenizer import IncrementalDetokenizer
from rung.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_id: int | None, arrival: int,
                 tokenizer=None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output
        self.num_computed_tokens = 0        # tokens whose KV is in the cache
        self.spec_token_ids: list[int] = []  # drafts to verify next step
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (prefix caching)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None       # why it finished with "error"
        # the output text, grown as tokens arrive (None without a tokenizer)
        self.detokenizer = (IncrementalDetokenizer(tokenizer.decode, self.token_ids,
                                                   len(self.prompt_token_ids),
                                                   _stop_buffer_length(params))
                            if tokenizer is not None else None)
        self.num_sent_tokens = 0            # output_kind DELTA: output ids already sent
        self.num_sent_chars = 0             # output_kind DELTA: text already sent
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.generator = (torch.Generator().manual_seed(params.seed)
                          if params.seed is not None else None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


def _stop_buffer_length(params: SamplingParams) -> int:
    """Trailing characters a stream holds back: they may start a stop string the output
    must not show."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(map(len, params.stop)) - 1
