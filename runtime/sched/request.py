"""A request's state, and the transitions that are the only writers of it.

```
WAITING ──start──► RUNNING ──commit(tokens, num_computed)──► RUNNING … ──finish──► FINISHED
   ▲   take_cached_prefix  │  └─set_drafts / drop_drafts
   └──────preempt──────────┘  (PREEMPTED waits at the front of the queue, as WAITING)
```

NOTE: ``token_ids``, ``num_computed_tokens``, ``spec_token_ids`` and ``status`` change only
through these methods (tests/test_request_state.py holds runtime/ to it). ``commit`` puts
a step's tokens in BEFORE it counts them computed and lets the KV cache hash the blocks now
full, so a block is only ever hashed over its full, verified tokens.
"""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Callable

from rung.runtime.detokenizer import IncrementalDetokenizer
from rung.runtime.request_ids import RequestId
from rung.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rung.runtime.sched.kv_cache_manager import KVCacheManager
    from rung.runtime.structured import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: RequestId, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_id: int | None, arrival: int,
                 tokenizer=None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)     # fixed: the prompt never changes
        self.params = params
        # NOTE: fixed for its life, so the sampler checks a batch once: logits processing
        # (min_tokens, penalties) only if a request asks; argmax alone if all are greedy
        self.processes_logits = bool(params.min_tokens or params.repetition_penalty != 1
                                     or params.presence_penalty or params.frequency_penalty)
        self.argmax_only = params.greedy and not self.processes_logits
        self.eos_token_id = eos_token_id
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output
        # NOTE: counts of token_ids, plain attributes the step reads per token; kept equal
        # to it by commit, token_ids' one writer
        self.num_tokens = self.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0        # tokens whose KV is in the cache
        self.spec_token_ids: list[int] = []  # drafts to verify next step
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (prefix caching)
        self.status = RequestStatus.WAITING
        self.is_finished = False            # status is FINISHED: set by finish() alone
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None       # why it finished with "error"
        # the output text, grown as tokens arrive (None without a tokenizer)
        decode = tokenizer.decode if tokenizer is not None else None
        if decode is not None and not (params.skip_special_tokens
                                       and params.spaces_between_special_tokens):
            decode = functools.partial(
                decode, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.detokenizer = (IncrementalDetokenizer(decode, self.token_ids,
                                                   len(self.prompt_token_ids),
                                                   _stop_buffer_length(params))
                            if tokenizer is not None else None)
        self.num_sent_tokens = 0            # output_kind DELTA: output ids already sent
        self.num_sent_chars = 0             # output_kind DELTA: text already sent
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None   # prefix-cache hit at first admission
        # structured outputs: the matcher, set by the engine (None: unconstrained)
        self.grammar: RequestGrammar | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    # --- transitions ------------------------------------------------------------------
    def take_cached_prefix(self, num_tokens: int) -> None:
        """Waiting: the prefix cache holds the KV of the first ``num_tokens`` tokens (0 when
        an admission that took a hit failed and gave it back)."""
        self._require(RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if not 0 <= num_tokens < self.num_tokens:
            raise RuntimeError(f"request {self.request_id!r}: a cached prefix of {num_tokens} "
                               f"tokens must leave one of its {self.num_tokens} to compute")
        self.num_computed_tokens = num_tokens

    def start(self) -> None:
        """Admitted: it holds KV blocks for this step's tokens."""
        self._require(RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if self.num_cached_tokens is None:
            self.num_cached_tokens = self.num_computed_tokens
        self.status = RequestStatus.RUNNING

    def commit(self, tokens: list[int], num_computed: int, kv: KVCacheManager,
               stop_reason: Callable[[int], str | None]) -> tuple[int, str | None]:
        """A step's result: the KV of ``num_computed`` more tokens is written and verified
        (rejected drafts are not counted: the next step overwrites their slots), and
        ``tokens`` (accepted drafts, then the sampled token) go in one at a time until
        ``stop_reason(token)``, asked once each is in, ends the request. The drafts are
        consumed. Then ``kv`` hashes the blocks now full and frees those out of the window.
        Returns how many of ``tokens`` went in, and why the request ends (None: it runs on).
        """
        if self.status is not RequestStatus.RUNNING:      # NOTE: once per request per step
            self._require(RequestStatus.RUNNING)
        num_kept, reason = 0, None
        for token in tokens:
            self.token_ids.append(token)
            self.num_tokens += 1
            self.num_output_tokens += 1
            num_kept += 1
            reason = stop_reason(token)
            if self.grammar is not None and self.grammar.accept(token) and reason is None:
                reason = "stop"                  # the grammar has ended
            if reason is not None:
                break
        computed = self.num_computed_tokens + num_computed
        if computed > self.num_tokens and reason is None:
            raise RuntimeError(f"request {self.request_id!r}: {computed} tokens computed but "
                               f"only {self.num_tokens} known")
        # NOTE: tokens past a stop are dropped; so is the KV written for them
        self.num_computed_tokens = min(computed, self.num_tokens)
        self.spec_token_ids = []
        # NOTE: a step inside the last block leaves the KV cache nothing to do
        if self.num_computed_tokens >= kv.advance_at.get(self.request_id, 0):
            kv.advance(self)
        return num_kept, reason

    def set_drafts(self, drafts: list[int]) -> None:
        """Drafts to verify next step (the caller keeps them within max_model_len)."""
        self._require(RequestStatus.RUNNING)
        self.spec_token_ids = list(drafts)

    def drop_drafts(self, num_kept: int = 0) -> None:
        """Keep only the first ``num_kept`` drafts (the budget or the KV cache has no room
        for the rest)."""
        self.spec_token_ids = self.spec_token_ids[:num_kept]

    def preempt(self) -> None:
        """Running -> preempted (its blocks were freed): it recomputes from the start."""
        self._require(RequestStatus.RUNNING)
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.num_preemptions += 1

    def finish(self, reason: str) -> None:
        """-> finished (its blocks were freed). A reason set earlier is kept."""
        self.status = RequestStatus.FINISHED
        self.is_finished = True
        self.spec_token_ids = []
        self.finish_reason = self.finish_reason or reason

    def _require(self, *allowed: RequestStatus) -> None:
        if self.status not in allowed:
            raise RuntimeError(f"request {self.request_id!r} is {self.status.value}; this "
                               f"transition needs {' or '.join(s.value for s in allowed)}")


def _stop_buffer_length(params: SamplingParams) -> int:
    """Trailing characters a stream holds back: they may start a stop string the output
    must not show."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(map(len, params.stop)) - 1
