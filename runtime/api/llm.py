"""LLM: the embedded offline API, vLLM conventions."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tqdm import tqdm

from rung.models.chat_template import Conversation, apply_chat_template
from rung.runtime.config import (
    CompilationConfig,
    EngineConfig,
    SpeculativeConfig,
    default_max_num_seqs,
    parse_device,
    parse_dtype,
)
from rung.runtime.dist.data_parallel import ROUTING_POLICIES, route_requests
from rung.runtime.engine import LLMEngine, Prompt
from rung.runtime.outputs import CompletionOutput, RequestOutput
from rung.runtime.request_ids import GenerateId
from rung.runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str, dtype: str | torch.dtype = "auto", device: str = "auto",
                 seed: int = 0, max_num_seqs: int | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 enforce_eager: bool = False,
                 compilation_config: dict[str, Any] | None = None,
                 attention_backend: str = "auto",
                 speculative_config: dict[str, Any] | None = None,
                 load_format: str = "auto", quantization: str | None = "auto",
                 num_gpu_blocks_override: int | None = None,
                 debug_padding: bool | None = None, enable_prefix_caching: bool = True,
                 capture_progress: Callable | None = None,
                 data_parallel_size: int = 1,
                 data_parallel_routing: str = "round_robin",
                 data_parallel_timeout_s: float = 120.0,
                 gpu_memory_utilization: float | None = None,
                 tensor_parallel_size: int = 1, trust_remote_code: bool = False,
                 swap_space: float | None = None,
                 batch_invariant: bool | None = None) -> None:
        """``data_parallel_size`` > 1: this process is one rank (under torchrun, or spawned
        by `rung ... --data-parallel-size N`); every rank builds the same LLM and passes the
        same prompts to `generate`, which runs each rank's share (``data_parallel_routing``:
        round_robin or least_tokens) and returns every output on every rank.

        ``max_num_seqs``: None -> 256 on CUDA, 16 on CPU (a CPU step's cost grows with its
        batch, and each ladder size costs a compile at start-up).
        ``gpu_memory_utilization``: the share of free device memory the KV cache may take on
        CUDA; ignored on CPU (a warning), where the cache holds max_num_seqs sequences of
        max_model_len up to $RUNG_CPU_KVCACHE_SPACE GiB (default 4, at most RAM / 4).
        ``tensor_parallel_size`` > 1 and ``trust_remote_code`` are
        vLLM's names for what rung does not do (ValueError). ``swap_space`` (vLLM's CPU
        swap, GiB) is accepted and unused: a preempted request recomputes its KV, as in
        vLLM's V1 engine.

        ``batch_invariant`` (None: $RUNG_BATCH_INVARIANT == "1"): a request's logits, so its
        greedy and seeded tokens, do not depend on the batch it runs in (docs/ARCHITECTURE.md
        says what is promised, docs/performance.md what it costs)."""
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} is unsupported: "
                             "rung runs a model on one device (data_parallel_size runs "
                             "copies side by side)")
        if trust_remote_code:
            raise ValueError("trust_remote_code=True is unsupported: rung runs only its own "
                             "model code (Llama, Qwen3, Gemma 4), never a folder's")
        if swap_space:
            logger.info("swap_space=%s GiB is not used: rung swaps no KV blocks to CPU memory "
                        "(a preempted request recomputes them, as vLLM's V1 engine does)",
                        swap_space)
        if data_parallel_routing not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing {data_parallel_routing!r} not in "
                             f"{ROUTING_POLICIES}")
        self.data_parallel_routing = data_parallel_routing
        self._num_prompts = 0
        dev = parse_device(device)
        if max_num_seqs is None:
            max_num_seqs = default_max_num_seqs(dev)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs) if isinstance(
                max_num_seqs, int) else 2048
        config = EngineConfig(
            model=model, dtype=parse_dtype(dtype, dev, quantization), device=dev, seed=seed,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            compilation=CompilationConfig.from_dict(compilation_config),
            attention_backend=attention_backend,
            speculative=SpeculativeConfig.from_dict(speculative_config),
            load_format=load_format, quantization=quantization,
            data_parallel_size=data_parallel_size,
            data_parallel_timeout_s=data_parallel_timeout_s,
            enable_prefix_caching=enable_prefix_caching)
        if debug_padding is not None:
            config.debug_padding = debug_padding
        if batch_invariant is not None:
            config.batch_invariant = batch_invariant
        self.engine = LLMEngine(config, capture_progress)

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Block until every graph on the ladder is live (at most ``timeout`` seconds);
        True when they all are. Until then batches of a size without its graph run eagerly,
        with the same tokens."""
        return self.engine.wait_for_graphs(timeout)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block, as vLLM's ``LLM.reset_prefix_cache``; False (and a
        warning) while requests still hold blocks."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 data_parallel_ranks: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A progress bar on
        stderr counts finished prompts unless ``use_tqdm=False``.

        Data parallel: ``data_parallel_ranks[i]`` is the rank that runs prompt i (default:
        the routing policy's choice)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # NOTE: generate returns finished outputs only: the engine makes no others
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in params]
        base = self._num_prompts
        self._num_prompts += len(prompts)
        # NOTE: ids of generate's own namespace: never a request the caller added directly
        ids = [GenerateId(base + i) for i in range(len(prompts))]
        dp = self.engine.dp
        mine = [True] * len(prompts)
        if dp is not None:
            ranks = self._route(prompts, data_parallel_ranks)
            dp.check_same_requests(hashlib.sha256(repr((prompts, ranks, params)).encode())
                                   .hexdigest())
            mine = [r == dp.rank for r in ranks]
        try:
            for rid, prompt, p, here in zip(ids, prompts, params, mine):
                if here:
                    self.engine.add_request(rid, prompt, p)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done = self._run({rid for rid, here in zip(ids, mine) if here},
                         use_tqdm and (dp is None or dp.rank == 0), len(ids))
        if dp is not None:
            done = self._gather_outputs(done)
        return [dataclasses.replace(done[rid], request_id=str(rid)) for rid in ids]

    def _run(self, ids: set[GenerateId], use_tqdm: bool, num_all: int
             ) -> dict[GenerateId, RequestOutput]:
        """Step until the prompts ``ids`` (under data parallel: every rank's) are done.
        Outputs of requests added to the engine directly go back to it, for its next
        ``step()`` to return. The bar counts all ``num_all`` prompts (every rank's, from
        each step's data-parallel sync)."""
        done: dict[GenerateId, RequestOutput] = {}
        num_prompts, dp = len(ids), self.engine.dp
        bar = tqdm(total=num_all, desc="Processed prompts", unit="prompt", file=sys.stderr,
                   disable=not use_tqdm)
        base = self.engine.dp_num_finished
        base_tokens = self.engine.num_generated_tokens
        self.engine.all_ranks_idle = False
        try:
            while self._keep_stepping(len(done) < num_prompts):
                outputs = self.engine.step()
                self.engine.requeue_outputs([o for o in outputs if o.request_id not in ids])
                if dp is not None:    # every rank's finished prompts, as of this step's sync
                    bar.update(min(self.engine.dp_num_finished - base, num_all) - bar.n)
                for out in outputs:
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = out
                        if dp is None:
                            bar.update(1)
                # NOTE: every step, so a long generation shows its tokens move; the bar
                # redraws at most every mininterval (update(0) is the throttled refresh)
                num_tokens = self.engine.num_generated_tokens - base_tokens
                elapsed = bar.format_dict["elapsed"]
                if use_tqdm and elapsed > 0:
                    bar.set_postfix_str(f"output {num_tokens} tok, {num_tokens / elapsed:.1f} "
                                        "tok/s", refresh=False)
                    bar.update(0)
        finally:
            bar.close()
        return done

    def _keep_stepping(self, pending: bool) -> bool:
        if self.engine.dp is None:
            return pending
        # NOTE: every rank steps (and syncs) until a sync finds every rank idle
        return not self.engine.all_ranks_idle

    def _route(self, prompts: list[Prompt], ranks: list[int] | None) -> list[int]:
        world = self.engine.dp.world_size
        if ranks is None:
            lengths = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p)
                       for p in prompts]
            return route_requests(lengths, world, self.data_parallel_routing)
        if len(ranks) != len(prompts):
            raise ValueError(f"{len(ranks)} data_parallel_ranks for {len(prompts)} prompts")
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
        if bad:
            raise ValueError(f"data-parallel rank {bad[0]!r} is not in [0, {world})")
        return list(ranks)

    def _gather_outputs(self, done: dict[str, RequestOutput]) -> dict[str, RequestOutput]:
        """Every rank's finished outputs, on every rank (each text decoded where it ran)."""
        local = {rid: dataclasses.replace(out, outputs=[_with_text(c) for c in out.outputs])
                 for rid, out in done.items()}
        merged: dict[str, RequestOutput] = {}
        for part in self.engine.dp.all_gather_object(local):
            merged.update(part)
        return merged

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` dicts) or a list of them,
        rendered with the model's chat template (or ``chat_template``); one output each."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of "
                             "conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.engine.tokenizer, c, chat_template,
                                       add_generation_prompt, self.engine.config.model)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _with_text(completion: CompletionOutput) -> CompletionOutput:
    """A copy that carries its text itself (it pickles without the detokenizer)."""
    copy = dataclasses.replace(completion, detokenize=None)
    copy.text = completion.text
    return copy
