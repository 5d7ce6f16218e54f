"""LLMEngine: the step API (add_request / step / abort_request / stats)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import sys
import time
from typing import Any, Callable

from tqdm import tqdm

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.backends import resolve_graph_backend
from rung.graphs.builder import GraphBuilder
from rung.graphs.ladder import capture_sizes
from rung.graphs.manager import TARGET, CaptureRecord, GraphManager, artifact_cache
from rung.kernels.triton.variants import KERNEL_VARIANTS
from rung.models.loader import LoadedModel, load_model
from rung.models.moe import shard_experts
from rung.runtime.config import EngineConfig
from rung.runtime.data_parallel import DataParallelGroup, DPStep, init_data_parallel
from rung.runtime.detokenizer import find_stop_string
from rung.runtime.kernel_warmup import sweep_attention_shapes
from rung.runtime.kv_cache_manager import KVCacheManager
from rung.runtime.log import configure_logging
from rung.runtime.model_runner import ModelRunner, ModelRunnerOutput
from rung.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from rung.runtime.parallel_sampling import ParentRequest
from rung.runtime.request import Request
from rung.runtime.request_ids import RequestId, check_request_id
from rung.runtime.sampling_params import RequestOutputKind, SamplingParams
from rung.runtime.scheduler import Scheduler, SchedulerOutput
from rung.runtime.spec_decode import SpecStats, make_proposer

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
    _warn_if_batches_run_eagerly(sizes, config)
    return GraphManager(runner, comp.cudagraph_mode, sizes, 1 + config.num_spec_tokens,
                        comp.backend, comp.graph_backend, config.debug_padding, cache)


def _warn_if_batches_run_eagerly(sizes: list[int], config: EngineConfig) -> None:
    """User-given capture sizes below the largest batch the scheduler builds: say which
    batches run eagerly (the default ladder says so itself)."""
    if config.compilation.cudagraph_capture_sizes is None or not sizes:
        return
    step = 1 + config.num_spec_tokens
    schedulable = min(config.max_num_seqs * step, config.max_num_batched_tokens)
    if max(sizes) < schedulable:
        logger.warning("cudagraph capture sizes %s stop at %d tokens: batches of %d to %d "
                       "tokens (max_num_seqs=%d x %d) run eagerly", sizes, max(sizes),
                       max(sizes) + 1, schedulable, config.max_num_seqs, step)


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 capture_progress: Callable[[CaptureRecord], None] | None = None) -> None:
        configure_logging()
        # NOTE: the engine's own copy: it settles fields (the data-parallel device) and
        # reads others every step; the caller's object is never written nor read again
        self.config = config = copy.deepcopy(config)
        self.dp: DataParallelGroup | None = None
        self.all_ranks_idle = False      # data parallel: the last step's sync found no work
        self.num_finished_outputs = 0    # finished outputs step() has returned
        self.dp_num_finished = 0         # data parallel: the same, all ranks, at the last sync
        if config.data_parallel_size > 1:
            self.dp, config.device = init_data_parallel(
                config.data_parallel_size, config.device, config.data_parallel_timeout_s)
        self.loaded: LoadedModel = load_model(config.model, config.dtype, str(config.device),
                                              config.load_format,
                                              quantization=config.quantization)
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
        self.requests: dict[RequestId, Request] = {}
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
        self._prompt_logprobs: dict[RequestId, list] = {}   # request id -> prompt_logprobs so far
        self._parents: dict[RequestId, ParentRequest] = {}
        self._child_index: dict[RequestId, tuple[ParentRequest, int]] = {}
        self._requeued: list[RequestOutput] = []     # returned first by the next step()
        self.graph_builder: GraphBuilder | None = None
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
        sizes = graphs.dispatcher.sizes
        logger.info("cudagraph mode %s, %s graphs: %d capture sizes %s", graphs.mode.name,
                    graphs.capture_backend.name, len(sizes), _short(sizes))
        total = graphs.num_graphs_to_capture
        self._graph_bar = tqdm(total=total, desc="Graphs live", unit="graph", leave=False,
                               file=sys.stderr,
                               disable=total == 0 or not logger.isEnabledFor(logging.INFO))

        def progress(record: CaptureRecord) -> None:
            self._graph_bar.update(1)
            if capture_progress is not None:
                capture_progress(record)

        after = None
        if self.proposer is not None:
            after = functools.partial(self.proposer.capture_all, graphs, progress)
        background = self._graph_startup(graphs) == "background"
        prefetch = None
        if background and getattr(graphs.capture_backend, "cache", None) is not None:
            from rung.runtime.warmup import start_prefetch

            prefetch = start_prefetch(self.config, self.max_model_len)
        self.graph_builder = GraphBuilder(graphs, after, progress, prefetch)
        if background:
            logger.info("serving eagerly from the first step; %d graphs go live as they are "
                        "built (%s); llm.wait_for_graphs() waits for them", total,
                        "compiling in a subprocess" if prefetch else "between steps")
            return
        start = time.perf_counter()
        self.wait_for_graphs()
        draft = [r for r in graphs.records if r.graph != TARGET]
        logger.info("captured %d graphs%s in %.1f s (one-time tracing %.1f s), %.1f MiB",
                    len(graphs.records) - len(draft),
                    f" + {len(draft)} draft graphs" if draft else "",
                    time.perf_counter() - start, graphs.trace_seconds,
                    graphs.pool_bytes / 2**20)

    def _graph_startup(self, graphs: GraphManager) -> str:
        startup = self.config.compilation.graph_startup
        if startup != "auto":
            return startup
        if self.dp is not None or graphs.capture_backend.name == "emulated":
            return "blocking"
        return "background"

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Bring every graph live now (at most ``timeout`` seconds); True when all are."""
        if self.graph_builder is None:
            return True
        done = self.graph_builder.wait(timeout)
        if done:
            self._graph_bar.close()
        return done

    def _advance_graphs(self) -> None:
        """Between two steps: at most one more graph goes live (see GraphBuilder)."""
        builder = self.graph_builder
        if builder is not None and not builder.done:
            builder.advance()
            if builder.done:
                self._graph_bar.close()

    # --- requests -------------------------------------------------------------------------
    def add_request(self, request_id: RequestId, prompt: Prompt,
                    params: SamplingParams | None = None) -> None:
        """Validate and queue one request (every sample of an ``n > 1`` one, or none). Bad
        input raises ValueError and leaves the engine untouched. The engine keeps its own
        copy of ``params``: changing the caller's object later changes nothing here."""
        check_request_id(request_id)
        params = (params or SamplingParams()).clone()
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
        # NOTE: every sample is built (seeded) before any is queued: all or none
        children = [Request(child_id, text, token_ids, parent.child_params(params, index),
                            eos, self._arrivals + index, self.tokenizer)
                    for index, child_id in enumerate(parent.child_ids)]
        self._parents[request_id] = parent
        for index, child in enumerate(children):
            self._child_index[child.request_id] = (parent, index)
            self._add(child)

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
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary "
                             f"size {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop} need a tokenizer; model "
                             f"{self.config.model!r} has none: use stop_token_ids")

    def abort_request(self, request_id: RequestId) -> None:
        """Finish a request (every sample of an ``n > 1`` one) as "abort"; an id that names
        no running request is ignored. One sample alone cannot be aborted."""
        check_request_id(request_id)
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child_id in parent.child_ids:
                self._child_index.pop(child_id, None)
                self._abort(child_id)
            return
        self._abort(request_id)

    def _abort(self, request_id: RequestId) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish(req, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (e.g. between benchmark runs); False while requests
        still hold blocks."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or outputs still to be returned by step()."""
        return self.scheduler.has_unfinished() or bool(self._requeued)

    # --- data parallel ----------------------------------------------------------------------
    def _dp_fingerprint(self) -> dict[str, Any]:
        """What every data-parallel rank must agree on (model, ladder, spec config)."""
        c = self.config
        spec = c.speculative
        return {"model": c.model, "dtype": str(c.dtype), "load_format": c.load_format,
                "quantization": c.quantization,
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
        step = self.dp.sync(sched.num_reqs, sched.num_tokens, self.scheduler.has_unfinished(),
                            padded, drafts.padded_size if drafts is not None else None,
                            self.num_finished_outputs)
        self.all_ranks_idle = step.all_idle
        self.dp_num_finished = sum(step.num_finished)
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
        if self._child_index:
            outputs = [g for g in map(self._gather, outputs) if g is not None]
        if self._requeued:
            outputs, self._requeued = self._requeued + outputs, []
        self.num_finished_outputs += sum(out.finished for out in outputs)
        return outputs

    def requeue_outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs a caller took from ``step()`` but does not own (``LLM.generate`` stepping
        beside requests added directly): the next ``step()`` returns them first, in order."""
        self._requeued += outputs
        self.num_finished_outputs -= sum(out.finished for out in outputs)   # counted again

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
        self._advance_graphs()
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
            if s.num_spec_tokens and new:
                self.spec_stats.record(s.num_spec_tokens, num_accepted)
            if req.request_id in result.prompt_logprobs:
                self._add_prompt_logprobs(req, *result.prompt_logprobs[req.request_id])
            num_computed = s.num_new_tokens - s.num_spec_tokens + num_accepted
            num_kept, reason = req.commit(new, num_computed, self.kv,
                                          functools.partial(self._stop_reason, req))
            out = self._output_after(req, new[:num_kept], result.logprobs.get(req.request_id),
                                     reason) if new else None
            if out is not None:
                outputs.append(out)
        return outputs

    def _add_prompt_logprobs(self, req: Request, first: int, logprobs: list) -> None:
        """Entries from prompt position ``first`` on; a recomputed prefix (preemption)
        adds nothing new."""
        store = self._prompt_logprobs.setdefault(req.request_id, [None])
        for position, entry in enumerate(logprobs, start=first):
            if position == len(store):
                store.append(self._decoded(entry))

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
            req.set_drafts(req_drafts[:max(room, 0)])

    def _count_step(self, desc: BatchExecutionDescriptor) -> None:
        if desc.mode == CUDAGraphMode.NONE:
            self._stats["eager_steps"] += 1
        else:
            self.graph_replays[f"{desc.mode.name}:{desc.num_tokens_padded}"] += 1

    def _never_fits(self, req: Request) -> str:
        """Why ``req`` failed: alone in the KV cache, it still did not fit."""
        why = f"request {req.request_id!r}: {self.kv.shortage(req.num_tokens)}"
        if req.num_output_tokens == 0:
            return (f"{why}: it can never run (shorten the prompt or give the KV cache more "
                    "blocks)")
        return (f"{why}: it ran out of KV cache after {req.num_output_tokens} output tokens "
                "(lower max_tokens or give the KV cache more blocks)")

    def _output_after(self, req: Request, tokens: list[int], logprobs: list | None,
                      reason: str | None) -> RequestOutput | None:
        """The output once ``tokens`` went in: their logprobs recorded, and the request
        finished if one of them ended it."""
        if logprobs is not None and req.logprobs is not None:
            for i, token in enumerate(tokens):
                req.logprobs.append(self._decoded(logprobs[i]))
                req.cumulative_logprob += logprobs[i][token].logprob
        if reason is not None:
            return self._finish(req, reason)
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
        """Why ``token`` (just appended) ends the request, or None. A stop token or string
        wins over a length limit the same token reaches. Sets ``req.stop_reason``."""
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if p.stop and self._hits_stop_string(req):
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
        prompt_lps = (self._prompt_logprobs.get(req.request_id, [None])
                      if req.params.prompt_logprobs is not None else None)
        if req.is_finished:
            self._prompt_logprobs.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.is_finished, prompt_lps)

    def stats(self) -> dict[str, Any]:
        s = {"kv_free_blocks": self.kv.num_free_blocks,
             "kv_total_blocks": self.kv.num_total_blocks,
             **self._kv_stats(),
             "eager_steps": self._stats["eager_steps"],
             "graphs_captured": (len(self.runner.graphs.records)
                                 if self.runner.graphs is not None else 0),
             "graphs": (self.graph_builder.status() if self.graph_builder is not None
                        else {"live": [], "pending": [], "done": True}),
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
        """Counts per KV cache group (every group has a pool of kv_total_blocks; free and
        used are those of the fullest group; kv_groups has each): cached-free blocks are
        among the free ones (they are evictable), so
        kv_free_blocks + kv_used_blocks == kv_total_blocks."""
        kv, prefix = self.kv, self.kv.prefix_stats
        held = [0] * len(kv.groups)
        for rid in kv.req_blocks:
            held = [a + b for a, b in zip(held, kv.blocks_held(rid))]
        return {"kv_cached_free_blocks": kv.num_cached_free_blocks,
                "kv_used_blocks": kv.num_used_blocks,
                "kv_blocks_held_per_group": held,
                "kv_groups": kv.group_stats(),
                "prefix_cache": {"enabled": kv.enable_prefix_caching,
                                 "queries": prefix.num_requests,
                                 "query_tokens": prefix.num_query_tokens,
                                 "hit_tokens": prefix.num_hit_tokens,
                                 "hit_rate": prefix.hit_rate,
                                 "evicted_blocks": sum(p.num_evicted for p in kv.pools)}}


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _short(sizes: list[int]) -> str:
    """[1, 2, 4, 8, 16, 24, 32] -> '[1, 2, 4, ..., 24, 32]' past 8 sizes."""
    if len(sizes) <= 8:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:3]))}, ..., {', '.join(map(str, sizes[-2:]))}]"
