"""Request outputs, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int                  # 1 = most likely
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None    # "length" | "stop" | "abort" | "error"
    stop_reason: int | str | None = None
    # the text, computed when first read: () -> str (see `text`)
    detokenize: Callable[[], str] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    error: str | None = None            # why, when finish_reason is "error"

    @functools.cached_property
    def text(self) -> str:
        """Computed on first access, so streaming outputs that nobody reads cost nothing;
        the request's incremental detokenizer makes that cheap (no full re-decode).
        Unfinished outputs never end in a broken character (nor in what may start a
        hidden stop string); a finished one is the full decode, cut at a stop string.
        Under ``output_kind=DELTA`` it holds only the text new since the last output."""
        if self.detokenize is None:
            return ""
        return self.detokenize()

    def __repr__(self) -> str:
        fields = [f"index={self.index}", f"text={self.text!r}", f"token_ids={self.token_ids}",
                  f"cumulative_logprob={self.cumulative_logprob}",
                  f"logprobs={self.logprobs}", f"finish_reason={self.finish_reason!r}",
                  f"stop_reason={self.stop_reason!r}"]
        if self.error is not None:
            fields.append(f"error={self.error!r}")
        return f"CompletionOutput({', '.join(fields)})"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # prompt_logprobs: None for the first prompt token, then one dict per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prompt tokens whose KV came from the prefix cache when the request was first admitted
    num_cached_tokens: int | None = None
