"""SamplingParams, vLLM's names and defaults."""

from __future__ import annotations

import copy
import dataclasses
import enum
import math

from rung.runtime.structured import StructuredOutputsParams

# torch.Generator.manual_seed accepts any seed in this range
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0      # every step: all output tokens and text so far
    DELTA = 1           # every step: only the tokens and text new since the last output
    FINAL_ONLY = 2      # one output, when the request finishes (`LLM.generate`)


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0        # 0 -> greedy
    top_k: int = 0                  # 0 or -1 -> all tokens
    top_p: float = 1.0
    seed: int | None = None         # per-request generator, independent of the batch
    max_tokens: int | None = 16     # None -> up to max_model_len
    min_tokens: int = 0             # EOS and stop tokens are masked before this many
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # top-N logprobs per sampled token (plus the sampled one)
    n: int = 1                      # parallel samples of the prompt, one CompletionOutput each
    # strings that end the output, matched on the detokenized text; the output is trimmed
    # before the match unless include_stop_str_in_output
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # of `LLMEngine.step`
    # vLLM's penalties: repetition (> 1 discourages) over prompt and output tokens,
    # presence / frequency (> 0 discourage) over output tokens
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0              # drop tokens below min_p x the most likely one's probability
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token (plus the actual one)
    skip_special_tokens: bool = True            # special tokens (EOS, BOS) left out of text
    spaces_between_special_tokens: bool = True  # kept special tokens set apart by a space
    # vLLM names that vLLM itself dropped: refused unless left at their no-op values
    # constrain the output to a JSON schema, regex, choice or grammar (vLLM's shape; a dict
    # with one of those keys is taken as StructuredOutputsParams)
    structured_outputs: StructuredOutputsParams | None = None
    best_of: int | None = None      # None or n only (vLLM V1 removed best_of)
    use_beam_search: bool = False   # False only (vLLM moved beam search to LLM.beam_search)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self.stop = _as_list("stop", [self.stop] if isinstance(self.stop, str) else self.stop)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._check()

    def clone(self) -> SamplingParams:
        """A deep copy: the engine keeps its own, so changing the caller's object later
        changes no queued request (as vLLM does)."""
        return copy.deepcopy(self)

    def _check(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of!r} is unsupported: vLLM's V1 engine "
                             "dropped best_of from SamplingParams; ask for n samples (with "
                             "logprobs) and pick by cumulative logprob")
        if self.use_beam_search is not False:
            raise ValueError(f"use_beam_search={self.use_beam_search!r} is unsupported: vLLM "
                             "removed it from SamplingParams (beam search is its own "
                             "LLM.beam_search there), and rung has no beam search")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "min_p"):
            value = getattr(self, name)
            _require(_is_number(value) and math.isfinite(value), name, value,
                     "a finite number")
        for name in ("top_k", "min_tokens", "n"):
            _require(_is_int(getattr(self, name)), name, getattr(self, name), "an integer")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, value, "an integer or None")
        _require(self.n >= 1, "n", self.n, ">= 1")
        _require(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids",
                 self.stop_token_ids, "a list of integers")
        if self.seed is not None:
            # NOTE: sample i of an n > 1 request is seeded with seed + i
            _require(MIN_SEED <= self.seed and self.seed + self.n - 1 <= MAX_SEED, "seed",
                     self.seed, "in torch's range [-2**63, 2**64 - 1]"
                     + (f" with seed + n - 1 (n={self.n}) too" if self.n > 1 else ""))
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name),
                     "True or False")
        _require(isinstance(self.output_kind, RequestOutputKind), "output_kind",
                 self.output_kind, "a RequestOutputKind")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                 "non-empty strings")
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _require(self.top_k >= 0, "top_k", self.top_k, ">= 0 (or -1 for all)")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
            _require(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                     f"<= max_tokens ({self.max_tokens})")
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.logprobs is not None:
            _require(self.logprobs >= 0, "logprobs", self.logprobs, ">= 0")
        if self.prompt_logprobs is not None:
            _require(self.prompt_logprobs >= 0, "prompt_logprobs", self.prompt_logprobs, ">= 0")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
                 "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, getattr(self, name), "in [-2, 2]")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _require(self.structured_outputs is None
                 or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", self.structured_outputs,
                 "a StructuredOutputsParams, a dict of its fields, or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def context_overflow(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int
                     ) -> str | None:
    """Why ``max_tokens`` more tokens cannot follow a prompt within ``max_model_len`` (the
    message the server's 400 and `rung generate` give), or None when they fit. The offline
    `LLM` stops such a request at the context instead, as vLLM's does."""
    if max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"max_tokens={max_tokens} plus the {num_prompt_tokens} prompt tokens is more than "
            f"max_model_len={max_model_len}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_list(name: str, value: object) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be a list")
    return list(value)


def _require(ok: bool, name: str, value: object, limit: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {limit}")
