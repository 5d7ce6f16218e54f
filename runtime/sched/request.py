"""A request's state, and the transitions that are the only writers of it.

```
WAITING ──start──► RUNNING ──commit(tokens, num_computed)──► RUNNING … ──finish──► FINISHED
   ▲   take_cached_prefix  │  └─set_drafts / drop_drafts
   └──────preempt──────────┘  (PREEMPTED waits at the front of the queue, as WAITING)
```

NOTE: every field of a Request, its outputs included (logprobs, stop reason, what a stream
has sent, the error), changes only through these methods; the rest are fixed at
construction (tests/test_request_state.py holds the whole library to it, field by field).
``commit`` puts a step's tokens in BEFORE it counts them computed and lets the KV cache hash
the blocks now full, so a block is only ever hashed over its full, verified tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

from rung.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from rung.runtime.outputs import Logprob
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
    # NOTE: slotted: every field is declared here, and the step's reads of them are a
    # slot's, not a dict lookup's
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "num_prompt_tokens", "params",
                 "processes_logits", "argmax_only", "eos_token_id", "arrival", "max_model_len",
                 "token_ids", "num_tokens", "num_output_tokens", "num_computed_tokens",
                 "spec_token_ids", "block_hashes", "status", "is_finished", "finish_reason",
                 "stop_reason", "error", "decode_token", "detokenizer", "num_sent_tokens",
                 "num_sent_chars", "logprobs", "cumulative_logprob", "prompt_logprobs",
                 "num_preemptions", "num_cached_tokens", "grammar")

    def __init__(self, request_id: RequestId, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_id: int | None, arrival: int,
                 tokenizer=None, max_model_len: int | None = None) -> None:
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
        self.max_model_len = max_model_len  # a length limit of its own (None: none)
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
        self.decode_token = decode          # a logprob entry's decoded_token (None: none)
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
        # vLLM's prompt_logprobs: None for the first prompt token, then one dict per token
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
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
               logprobs: list[dict[int, Logprob]] | None = None) -> tuple[int, str | None]:
        """A step's result: the KV of ``num_computed`` more tokens is written and verified
        (rejected drafts are not counted: the next step overwrites their slots), and
        ``tokens`` (accepted drafts, then the sampled token) go in one at a time until one
        ends the request (`_stop_reason`, asked once each is in), with its entry of
        ``logprobs`` (one per token) when the request asked for them. The drafts are
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
            if logprobs is not None and self.logprobs is not None:
                self.logprobs.append(self._decoded(logprobs[num_kept]))
                self.cumulative_logprob += logprobs[num_kept][token].logprob
            num_kept += 1
            reason = self._stop_reason(token)
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

    def _stop_reason(self, token: int) -> str | None:
        """Why ``token`` (just appended) ends the request, or None. A stop token or string
        wins over a length limit the same token reaches; a stop token or string is kept as
        ``stop_reason``."""
        p = self.params
        n_out = self.num_output_tokens
        if n_out >= p.min_tokens:
            if token == self.eos_token_id and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                self.stop_reason = token
                return "stop"
        if p.stop and self._hits_stop_string():
            return "stop"
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length"
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _hits_stop_string(self) -> bool:
        """Whether the text the last token added completes a stop string; if so, the text
        is cut where it ends. Costs one short decode, not a decode of the whole output."""
        p, detok = self.params, self.detokenizer
        num_new_chars = detok.update(self.num_output_tokens)
        if self.num_output_tokens < p.min_tokens:
            return False
        hit = find_stop_string(detok.text, num_new_chars, p.stop, p.include_stop_str_in_output)
        if hit is None:
            return False
        self.stop_reason, text_end = hit
        detok.truncate(text_end)
        return True

    def add_prompt_logprobs(self, first: int, logprobs: list[dict[int, Logprob]]) -> None:
        """Prompt logprob entries from prompt position ``first`` on; a recomputed prefix
        (preemption) adds nothing new."""
        for position, entry in enumerate(logprobs, start=first):
            if position == len(self.prompt_logprobs):
                self.prompt_logprobs.append(self._decoded(entry))

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.decode_token is None:
            return entry
        return {t: dataclasses.replace(lp, decoded_token=self.decode_token([t]))
                for t, lp in entry.items()}

    def mark_sent(self, num_tokens: int, num_chars: int) -> None:
        """A DELTA stream has sent the first ``num_tokens`` output ids and ``num_chars``
        characters of the text."""
        self.num_sent_tokens, self.num_sent_chars = num_tokens, num_chars

    def hash_blocks(self, num_blocks: int, block_size: int,
                    hash_block: Callable[[bytes | None, list[int]], bytes]) -> list[bytes]:
        """The chained hashes of its first ``num_blocks`` full blocks, each computed once
        (its tokens never change, preemption included)."""
        for i in range(len(self.block_hashes), num_blocks):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(
                hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return self.block_hashes[:num_blocks]

    def constrain(self, grammar: RequestGrammar) -> None:
        """Waiting: its tokens follow ``grammar`` (structured outputs)."""
        self._require(RequestStatus.WAITING)
        self.grammar = grammar

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

    def finish(self, reason: str, error: str | None = None) -> None:
        """-> finished (its blocks were freed); ``error``: why, for reason "error". A reason
        set earlier is kept."""
        self.status = RequestStatus.FINISHED
        self.is_finished = True
        self.spec_token_ids = []
        self.finish_reason = self.finish_reason or reason
        self.error = error

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


class Commit(NamedTuple):
    """What one step produced for one request (`Request.commit`'s arguments)."""

    request: Request
    tokens: list[int]                       # accepted drafts, then the sampled token
    num_computed: int                       # tokens whose KV the step wrote and verified
    logprobs: list[dict[int, Logprob]] | None = None


def commit_step(commits: list[Commit], kv: KVCacheManager) -> list[tuple[int, str | None]]:
    """A step's results for its requests, in order, each through its own `Request.commit`:
    (tokens kept, why it ends or None) per request."""
    return [c.request.commit(c.tokens, c.num_computed, kv, c.logprobs) for c in commits]
