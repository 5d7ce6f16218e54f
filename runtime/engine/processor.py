"""Input processing: a prompt and its SamplingParams checked and turned into token ids.

Bad input raises ValueError naming the value and the limit, before anything is queued.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rung.runtime.sampling_params import SamplingParams

Prompt = str | dict


@dataclasses.dataclass
class ProcessedInput:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams         # with the model's other end-of-generation ids as stops
    eos_token_id: int | None


class InputProcessor:
    def __init__(self, model: str, tokenizer: Any, model_config: dict[str, Any],
                 generation_stop_ids: list[int], vocab_size: int, max_model_len: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.generation_stop_ids = generation_stop_ids
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = model_config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        if isinstance(eos, int) and not 0 <= eos < vocab_size:
            raise ValueError(f"model {model!r} has eos_token_id {eos}, outside its vocabulary "
                             f"of {vocab_size} tokens (ids 0..{vocab_size - 1})")
        self.eos_token_id: int | None = eos

    def process(self, prompt: Prompt, params: SamplingParams) -> ProcessedInput:
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        self._check_params(params)
        return ProcessedInput(text, token_ids, self._with_generation_stops(params),
                              self.eos_token_id)

    def _with_generation_stops(self, params: SamplingParams) -> SamplingParams:
        """The model's other end-of-generation ids (a chat model's end of turn) stop the request
        too, unless ``ignore_eos``; as vLLM does with generation_config. The caller's params
        are left as they were."""
        eos, vocab = self.eos_token_id, self.vocab_size
        extra = [t for t in self.generation_stop_ids
                 if t != eos and t not in params.stop_token_ids and 0 <= t < vocab]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must hold at least 1 token")
            if self.tokenizer is None:
                raise ValueError(f"model {self.model!r} has no tokenizer.json: pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"prompt_token_ids must be a list of ints, got "
                                 f"{_preview(ids)}")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got "
                         f"{type(prompt).__name__}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least 1 token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, longer than "
                             f"max_model_len={self.max_model_len}")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")

    def _check_params(self, params: SamplingParams) -> None:
        params._check()
        vocab = self.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                raise ValueError(f"stop token id {t} is out of the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary "
                             f"size {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop} need a tokenizer; model "
                             f"{self.model!r} has none: use stop_token_ids")


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
