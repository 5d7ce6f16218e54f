"""LLM: the embedded offline API, vLLM conventions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from rung.runtime.config import CompilationConfig, EngineConfig, SpeculativeConfig, parse_dtype
from rung.runtime.engine import LLMEngine, Prompt
from rung.runtime.outputs import RequestOutput
from rung.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, dtype: str | torch.dtype = "auto", device: str = "auto",
                 seed: int = 0, max_num_seqs: int = 256, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 enforce_eager: bool = False,
                 compilation_config: dict[str, Any] | None = None,
                 attention_backend: str = "auto",
                 speculative_config: dict[str, Any] | None = None,
                 load_format: str = "auto", num_gpu_blocks_override: int | None = None,
                 debug_padding: bool | None = None,
                 capture_progress: Callable | None = None) -> None:
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                           if device == "auto" else device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        config = EngineConfig(
            model=model, dtype=parse_dtype(dtype, dev), device=dev, seed=seed,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens or max(2048, max_num_seqs),
            block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override,
            enforce_eager=enforce_eager,
            compilation=CompilationConfig.from_dict(compilation_config),
            attention_backend=attention_backend,
            speculative=SpeculativeConfig.from_dict(speculative_config),
            load_format=load_format)
        if debug_padding is not None:
            config.debug_padding = debug_padding
        self.engine = LLMEngine(config, capture_progress)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        base = self.engine._arrivals
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
