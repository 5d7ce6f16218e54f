"""LLMEngine: the step API (add_request / step / abort_request / stats)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import sys
import time
from typing import Any, Callable

from tqdm import tqdm

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.capture import resolve_graph_backend
from rung.graphs.ladder import capture_sizes
from rung.graphs.manager import TARGET, CaptureRecord, GraphManager, artifact_cache
from rung.kernels.triton.variants import KERNEL_VARIANTS
from rung.models.loader import LoadedModel, load_model
from rung.models.moe import shard_experts
from rung.runtime.config import EngineConfig
from rung.runtime.detokenizer import find_stop_string
from rung.runtime.dist.data_parallel import DataParallelGroup, DPStep, init_data_parallel
from rung.runtime.engine.parallel_sampling import ParentRequest
from rung.runtime.log import configure_logging
from rung.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from rung.runtime.sampling_params import RequestOutputKind, SamplingParams
from rung.runtime.sched.kv_cache_manager import KVCacheManager
from rung.runtime.sched.request import Request
from rung.runtime.sched.scheduler import Scheduler, SchedulerOutput
from rung.runtime.spec.proposer import SpecStats, make_proposer
from rung.runtime.worker.kernel_warmup import sweep_attention_shapes
from rung.runtime.worker.model_runner import ModelRunner, ModelRunnerOutput

Prompt = str | dict

logger = logging.getLogger(__name__)


def make_graph_manager(runner: ModelRunner, config: EngineConfig) -> GraphManager:
    """The graph manager of ``config.compilation`` for ``runner`` (nothing captured yet)."""
    comp = config.compilation
    sizes = capture_sizes(comp.cudagraph_capture_sizes, config.max_num_seqs,
                          config.num_spec_tokens, config.max_num_batched_tokens,
                          comp.max_cudagraph_capture_size, short=runner.device.type == "cpu")
    compiled = resolve_graph_backend(comp.graph_backend, runner.device) == "compiled"
    cache = artifact_cache(runner, config) if compiled else None
    return GraphManager(runner, comp.cudagraph_mode, sizes, 1 + config.num_spec_tokens,
                        comp.backend, comp.graph_backend, config.debug_padding, cache)


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 capture_progress: Callable[[CaptureRecord], None] | None = None) -> None:
        configure_logging()
        self.config = config
        self.dp: DataParallelGroup | None = None
        self.all_ranks_idle = False      # data parallel: the last step's sync found no work
        if config.data_parallel_size > 1:
            self.dp, config.device = init_data_parallel(
                config.data_parallel_size, config.device, config.data_parallel_timeout_s)
        self.loaded: LoadedModel = load_model(config.model, config.dtype, str(config.device),
                                              config.load_format)
        if hasattr(self.loaded.model, "bind_target"):
            raise ValueError(f"model {config.model!r} is an MTP drafter, not a model to serve: "
                             "pass it as speculative_config={'method': 'mtp', 'model': "
                             f"{config.model!r}, ...}} next to a Gemma 4 target")
        self.tokenizer = self.loaded.tokenizer
        model_max = int(self.loaded.config.get("max_position_embeddings", 2048))
        self.max_model_len = config.max_model_len if config.max_model_len is not None else (
            model_max)
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max}")
        self.runner = ModelRunner(config, self.loaded, self.max_model_len)
        self._log_setup()
        self.kv = KVCacheManager(self.runner.kv_groups, self.runner.num_blocks,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._stats: collections.Counter = collections.Counter()
        self.graph_replays: collections.Counter = collections.Counter()
        self._step_listeners: list[Callable[[ModelRunnerOutput], None]] = []
        self.proposer = make_proposer(config, self.runner) if config.speculative else None
        self.spec_stats = SpecStats(config.num_spec_tokens) if config.speculative else None
        if self.dp is not None:
            # NOTE: before capture: capture runs the model's collectives on every rank
            self.dp.check_same_config(self._dp_fingerprint())
            self._shard_experts()
        self._parents: dict[str, ParentRequest] = {}
        self._child_index: dict[str, tuple[ParentRequest, int]] = {}
        if config.enforce_eager:
            logger.info("enforce_eager: no graphs, every step runs eagerly")
        else:
            self._capture_graphs(capture_progress)
        sweep_attention_shapes(self.runner)
        self._jit_variants_at_warmup = KERNEL_VARIANTS.count()

    # --- start-up -------------------------------------------------------------------------
    def _log_setup(self) -> None:
        cfg, runner = self.config, self.runner
        weights = "random weights" if self.loaded.random_weights else "weights loaded"
        logger.info("model %s (%s, %s): %s on %s, max_model_len %d, max_num_seqs %d",
                    cfg.model, self.loaded.config.get("model_type"), weights,
                    str(cfg.dtype).removeprefix("torch."), cfg.device, self.max_model_len,
                    cfg.max_num_seqs)
        kv_bytes = sum(t.nbytes for t in {id(t): t for t in runner.kv_caches.values()}.values())
        logger.info("attention backend %s; KV cache: %d blocks of %d tokens in %d group(s), "
                    "%.1f MiB", runner.backend.name, runner.num_blocks, cfg.block_size,
                    len(runner.kv_groups), kv_bytes / 2**20)

    def _capture_graphs(self, capture_progress: Callable[[CaptureRecord], None] | None
                        ) -> None:
        graphs = make_graph_manager(self.runner, self.config)
        self.runner.use_graphs(graphs)
        total = graphs.num_graphs_to_capture
        sizes = graphs.dispatcher.sizes
        logger.info("cudagraph mode %s, %s graphs: %d capture sizes %s", graphs.mode.name,
                    graphs.capture_backend.name, len(sizes), _short(sizes))
        start = time.perf_counter()
        bar = tqdm(total=total, desc="Capturing graphs", unit="graph", leave=False,
                   file=sys.stderr, disable=total == 0 or not logger.isEnabledFor(logging.INFO))

        def progress(record: CaptureRecord) -> None:
            bar.update(1)
            if capture_progress is not None:
                capture_progress(record)

        try:
            graphs.capture_all(progress)
            if self.proposer is not None:
                self.proposer.capture_all(graphs, progress)
        finally:
            bar.close()
        draft = [r for r in graphs.records if r.graph != TARGET]
        logger.info("captured %d graphs%s in %.1f s (one-time tracing %.1f s), %.1f MiB",
                    len(graphs.records) - len(draft),
                    f" + {len(draft)} draft graphs" if draft else "",
                    time.perf_counter() - start, graphs.trace_seconds,
                    graphs.pool_bytes / 2**20)

    # --- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
                    ) -> None:
        """Validate and queue one request. Bad input raises ValueError and leaves the
        engine untouched."""
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = self.loaded.config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        self._check_params(params)
        params = self._with_generation_stops(params, eos)
        if params.n == 1:
            self._add(Request(request_id, text, token_ids, params, eos, self._arrivals,
                              self.tokenizer))
            return
        parent = ParentRequest(request_id, params)
        self._parents[request_id] = parent
        for index, child_id in enumerate(parent.child_ids):
            self._child_index[child_id] = (parent, index)
            self._add(Request(child_id, text, token_ids, parent.child_params(params, index),
                              eos, self._arrivals, self.tokenizer))

    def _with_generation_stops(self, params: SamplingParams, eos: int | None) -> SamplingParams:
        """The model's other end-of-generation ids (a chat model's end of turn) stop the request
        too, unless ``ignore_eos``; as vLLM does with generation_config. The caller's params
        are left as they were."""
        vocab = self.runner.vocab_size
        extra = [t for t in self.loaded.generation_stop_ids
                 if t != eos and t not in params.stop_token_ids and 0 <= t < vocab]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

    def _add(self, req: Request) -> None:
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must hold at least 1 token")
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer.json: pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got "
                         f"{type(prompt).__name__}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least 1 token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, longer than "
                             f"max_model_len={self.max_model_len}")
        vocab = self.runner.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")

    def _check_params(self, params: SamplingParams) -> None:
        params._check()
        vocab = self.runner.vocab_size
        for t in params.stop_token_ids:
            if not 0 <= t < vocab:
                raise ValueError(f"stop token id {t} is out of the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop} need a tokenizer; model "
                             f"{self.config.model!r} has none: use stop_token_ids")

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child_id in parent.child_ids:
                self._child_index.pop(child_id, None)
                self.abort_request(child_id)
            return
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish(req, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (e.g. between benchmark runs); False while requests
        still hold blocks."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- data parallel ----------------------------------------------------------------------
    def _dp_fingerprint(self) -> dict[str, Any]:
        """What every data-parallel rank must agree on (model, ladder, spec config)."""
        c = self.config
        spec = c.speculative
        return {"model": c.model, "dtype": str(c.dtype), "load_format": c.load_format,
                "max_model_len": self.max_model_len, "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": c.max_num_batched_tokens,
                "block_size": c.block_size, "enforce_eager": c.enforce_eager,
                "cudagraph_mode": c.compilation.cudagraph_mode.name,
                "cudagraph_capture_sizes": c.compilation.cudagraph_capture_sizes,
                "graph_backend": c.compilation.graph_backend,
                "attention_backend": self.runner.backend.name,
                "speculative": None if spec is None else (spec.method, spec.model,
                                                          spec.num_speculative_tokens)}

    def _shard_experts(self) -> None:
        """Expert parallel: each rank keeps its slice of every MoE layer's experts."""
        rank, size = self.dp.rank, self.dp.world_size
        shard_experts(self.loaded.model, rank, size)
        drafter = getattr(self.proposer, "drafter", None)
        if drafter is not None:
            shard_experts(drafter, rank, size)

    def _dp_sync(self, sched: SchedulerOutput) -> DPStep:
        graphs = self.runner.graphs
        no_graph = lambda n: None  # noqa: E731
        padded = (graphs.dispatcher.padded_size
                  if graphs is not None and graphs.mode != CUDAGraphMode.NONE else no_graph)
        drafts = getattr(self.proposer, "dispatcher", None)
        step = self.dp.sync(sched.num_reqs, sched.num_tokens, self.has_unfinished_requests(),
                            padded, drafts.padded_size if drafts is not None else None)
        self.all_ranks_idle = step.all_idle
        return step

    def _dummy_step(self, step: DPStep) -> None:
        """No request here while another rank has some: run its sizes on pads only."""
        self.runner.execute_dummy(step.num_tokens_across_dp())
        if self.proposer is not None:
            self.proposer.propose_dummy(step.num_draft_tokens_across_dp())

    def add_step_listener(self, listener: Callable[[ModelRunnerOutput], None]
                          ) -> Callable[[], None]:
        """Call ``listener`` with every step's ModelRunnerOutput (benchmarks, tests); its
        tensors are views valid until the next step. Returns a function that removes it."""
        self._step_listeners.append(listener)
        return lambda: self._step_listeners.remove(listener)

    # --- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (`_step`); children of an ``n > 1`` request report as their parent.
        Under data parallel every rank must call it; loop until ``all_ranks_idle``."""
        outputs = self._step()
        if not self._child_index:
            return outputs
        return [g for g in map(self._gather, outputs) if g is not None]

    def _gather(self, out: RequestOutput) -> RequestOutput | None:
        """A child of an ``n > 1`` request reports as its parent."""
        parent, index = self._child_index.get(out.request_id, (None, 0))
        if parent is None:
            return out
        gathered = parent.gather(index, out)
        if out.finished:
            del self._child_index[out.request_id]
        if gathered is not None and gathered.finished:
            del self._parents[parent.request_id]
        return gathered

    def _step(self) -> list[RequestOutput]:
        """schedule -> (data parallel: sync) -> execute (descriptor, metadata, forward,
        sample) -> update -> draft."""
        sched = self.scheduler.schedule()
        outputs = [self._finish(req, "error", self._never_fits(req)) for req in sched.errored]
        self._stats["preemptions"] += len(sched.preempted)
        dp_step = self._dp_sync(sched) if self.dp is not None else None
        if dp_step is not None and dp_step.any_work and not sched.scheduled:
            self._dummy_step(dp_step)
        if not sched.scheduled:
            return outputs
        block_ids = [self.kv.block_ids(s.request.request_id) for s in sched.scheduled]
        if dp_step is None:
            result = self.runner.execute(sched, block_ids)
        else:
            result = self.runner.execute(sched, block_ids, dp_step.num_tokens_across_dp())
        self._count_step(result.desc)
        for listener in self._step_listeners:
            listener(result)
        outputs += self._update(sched, result)
        if self.proposer is not None:
            self._propose(sched, result, dp_step)
        return outputs

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput
                ) -> list[RequestOutput]:
        """Advance every scheduled request by the tokens its step produced."""
        outputs = []
        for s in sched.scheduled:
            req = s.request
            new = result.sampled.get(req.request_id, [])
            # NOTE: KV of rejected drafts is discarded by not counting it as computed;
            # the next step overwrites those slots.
            num_accepted = max(len(new) - 1, 0) if s.num_spec_tokens else 0
            req.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens + num_accepted
            req.spec_token_ids = []
            self.kv.advance(req)      # hash blocks now full, free blocks out of the window
            if s.num_spec_tokens and new:
                self.spec_stats.record(s.num_spec_tokens, num_accepted)
            out = self._append(req, new, result.logprobs.get(req.request_id)) if new else None
            if out is not None:
                outputs.append(out)
        return outputs

    def _propose(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                 dp_step: DPStep | None) -> None:
        """Drafts for every request that got a token this step and is still running.

        NOTE: the draft descriptor is one query per REAL request (for_drafting); under
        data parallel only the drafter's inputs pad to what the ranks agreed on.
        """
        reqs = [s.request for s in sched.scheduled]
        across = dp_step.num_draft_tokens_across_dp() if dp_step is not None else None
        drafts = self.proposer.propose(result.desc.for_drafting(), reqs, result,
                                       num_tokens_across_dp=across)
        for req, req_drafts in zip(reqs, drafts):
            if req.is_finished or not result.sampled.get(req.request_id):
                continue
            room = self.max_model_len - req.num_tokens
            req.spec_token_ids = list(req_drafts[:max(room, 0)])

    def _count_step(self, desc: BatchExecutionDescriptor) -> None:
        if desc.mode == CUDAGraphMode.NONE:
            self._stats["eager_steps"] += 1
        else:
            self.graph_replays[f"{desc.mode.name}:{desc.num_tokens_padded}"] += 1

    def _never_fits(self, req: Request) -> str:
        return (f"request {req.request_id!r} needs KV cache for {req.num_tokens} tokens but "
                f"the whole cache holds {self.kv.num_total_blocks} blocks of "
                f"{self.config.block_size} tokens: it can never run (shorten the prompt or "
                "give the KV cache more blocks)")

    def _append(self, req: Request, new: list[int], logprobs: list | None
                ) -> RequestOutput | None:
        for i, token in enumerate(new):
            req.token_ids.append(token)
            if logprobs is not None and req.logprobs is not None:
                req.logprobs.append(self._decoded(logprobs[i]))
                req.cumulative_logprob += logprobs[i][token].logprob
            reason = self._stop_reason(req, token)
            if reason is None and req.params.stop and self._hits_stop_string(req):
                reason = "stop"
            if reason is not None:
                req.finish_reason = reason
                if reason == "stop" and token != req.eos_token_id and req.stop_reason is None:
                    req.stop_reason = token
                break
        if req.finish_reason is not None:
            return self._finish(req, req.finish_reason)
        return self._output(req)

    def _decoded(self, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        if self.tokenizer is None:
            return logprobs
        decode = self.tokenizer.decode
        return {t: dataclasses.replace(lp, decoded_token=decode([t]))
                for t, lp in logprobs.items()}

    def _hits_stop_string(self, req: Request) -> bool:
        """Whether the text the last token added completes a stop string; if so, the text
        is cut where it ends. Costs one short decode, not a decode of the whole output."""
        p, detok = req.params, req.detokenizer
        num_new_chars = detok.update(req.num_output_tokens)
        if req.num_output_tokens < p.min_tokens:
            return False
        hit = find_stop_string(detok.text, num_new_chars, p.stop, p.include_stop_str_in_output)
        if hit is None:
            return False
        req.stop_reason, text_end = hit
        detok.truncate(text_end)
        return True

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                return "stop"
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        req.error = error
        self.scheduler.finish(req, reason)
        self._stats[f"finished_{req.finish_reason}"] += 1
        out = self._output(req)
        del self.requests[req.request_id]
        return out

    def _output(self, req: Request) -> RequestOutput | None:
        """The request's output as its ``output_kind`` asks (None: nothing to report yet)."""
        kind = req.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not req.is_finished:
            return None
        first = req.num_sent_tokens if kind == RequestOutputKind.DELTA else 0
        # NOTE: the slice is the output's own copy of the ids
        token_ids = req.token_ids[req.num_prompt_tokens + first:]
        completion = CompletionOutput(0, token_ids,
                                      req.cumulative_logprob if req.logprobs is not None
                                      else None,
                                      req.logprobs[first:] if req.logprobs is not None else None,
                                      req.finish_reason, req.stop_reason, error=req.error)
        detok = req.detokenizer
        if kind == RequestOutputKind.DELTA:
            text = detok.text_at(req.num_output_tokens, req.is_finished) if detok else ""
            completion.text = text[req.num_sent_chars:]
            req.num_sent_tokens, req.num_sent_chars = req.num_output_tokens, len(text)
        elif detok is not None:
            completion.detokenize = functools.partial(detok.text_at, req.num_output_tokens,
                                                      req.is_finished)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.is_finished)

    def stats(self) -> dict[str, Any]:
        s = {"kv_free_blocks": self.kv.num_free_blocks,
             "kv_total_blocks": self.kv.num_total_blocks,
             **self._kv_stats(),
             "eager_steps": self._stats["eager_steps"],
             "graphs_captured": (len(self.runner.graphs.records)
                                 if self.runner.graphs is not None else 0),
             "graph_replays": dict(self.graph_replays),
             "preemptions": self._stats["preemptions"],
             "num_running": len(self.scheduler.running),
             "num_waiting": len(self.scheduler.waiting),
             # kernel variants JIT-compiled after warm-up: 0 in a healthy serving run
             "triton_compiles_after_warmup":
                 KERNEL_VARIANTS.count() - self._jit_variants_at_warmup}
        if self.spec_stats is not None:
            s["spec"] = self.spec_stats.as_dict()
        if self.dp is not None:
            s["data_parallel"] = {"rank": self.dp.rank, "world_size": self.dp.world_size,
                                  **self.dp.stats.as_dict()}
        return s

    def _kv_stats(self) -> dict[str, Any]:
        """Cached-free blocks are among the free ones (they are evictable), so
        kv_free_blocks + kv_used_blocks == kv_total_blocks."""
        kv, prefix = self.kv, self.kv.prefix_stats
        held = [0] * len(kv.groups)
        for rid in kv.req_blocks:
            held = [a + b for a, b in zip(held, kv.blocks_held(rid))]
        return {"kv_cached_free_blocks": kv.num_cached_free_blocks,
                "kv_used_blocks": kv.num_used_blocks,
                "kv_blocks_held_per_group": held,
                "prefix_cache": {"enabled": kv.enable_prefix_caching,
                                 "queries": prefix.num_requests,
                                 "query_tokens": prefix.num_query_tokens,
                                 "hit_tokens": prefix.num_hit_tokens,
                                 "hit_rate": prefix.hit_rate,
                                 "evicted_blocks": sum(p.num_evicted for p in kv.pools)}}


def _short(sizes: list[int]) -> str:
    """[1, 2, 4, 8, 16, 24, 32] -> '[1, 2, 4, ..., 24, 32]' past 8 sizes."""
    if len(sizes) <= 8:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:3]))}, ..., {', '.join(map(str, sizes[-2:]))}]"
