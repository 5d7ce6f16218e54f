"""LLMEngine: the step loop (add_request / step / abort_request / stats).

One step: schedule -> (data parallel: sync) -> execute -> commit -> outputs -> propose.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
from typing import Any, Callable

from rung.graphs.backends import resolve_graph_backend
from rung.graphs.manager import CaptureRecord
from rung.runtime.config import EngineConfig
from rung.runtime.dist.data_parallel import DataParallelGroup, DPStep, init_data_parallel
from rung.runtime.engine.dp_sync import EngineDataParallel
from rung.runtime.engine.output_processor import make_output, make_outputs
from rung.runtime.engine.parallel_sampling import ParallelSampling, ParentRequest
from rung.runtime.engine.processor import InputProcessor, Prompt
from rung.runtime.engine.startup import GraphStartup, load_target, log_setup, make_proposer
from rung.runtime.engine.stats import EngineStats
from rung.runtime.log import configure_logging
from rung.runtime.outputs import RequestOutput
from rung.runtime.request_ids import RequestId, check_request_id
from rung.runtime.sampling_params import SamplingParams
from rung.runtime.sched.kv_cache_manager import KVCacheManager
from rung.runtime.sched.request import Commit, Request, commit_step
from rung.runtime.sched.scheduler import Scheduler, SchedulerOutput
from rung.runtime.spec.proposer import SpecStats
from rung.runtime.structured import GrammarCompiler
from rung.runtime.thread_policy import apply_thread_policy
from rung.runtime.worker.kernel_warmup import sweep_attention_shapes
from rung.runtime.worker.model_runner import ModelRunner
from rung.runtime.worker.step_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


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
        self.num_generated_tokens = 0    # output tokens committed, every request's
        self.dp_num_finished = 0         # data parallel: the same, all ranks, at the last sync
        if config.data_parallel_size > 1:
            self.dp, config.device = init_data_parallel(
                config.data_parallel_size, config.device, config.data_parallel_timeout_s)
        if config.device.type == "cpu":
            apply_thread_policy()
        self.loaded, self.max_model_len = load_target(config)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(config, self.loaded, self.max_model_len)
        log_setup(config, self.loaded, self.runner, self.max_model_len)
        self.kv = KVCacheManager(self.runner.kv_groups, self.runner.num_blocks,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[RequestId, Request] = {}
        self._arrivals = 0
        self._stats = EngineStats()
        self._step_listeners: list[Callable[[ModelRunnerOutput], None]] = []
        self.inputs = InputProcessor(config.model, self.tokenizer, self.loaded.config,
                                     self.loaded.generation_stop_ids, self.runner.vocab_size,
                                     self.max_model_len)
        self._parallel = ParallelSampling()
        self._requeued: list[RequestOutput] = []     # returned first by the next step()
        # structured outputs: requests held out of the scheduler until their grammar compiles
        self.grammars = GrammarCompiler(
            self.tokenizer, self.runner.vocab_size,
            [t for t in [self.inputs.eos_token_id, *self.loaded.generation_stop_ids]
             if t is not None])
        self._compiling: list[Request] = []
        self.proposer = make_proposer(config, self.runner) if config.speculative else None
        self.spec_stats = SpecStats(config.num_spec_tokens) if config.speculative else None
        self._dp_engine = (EngineDataParallel(self.dp, config, self.runner, self.proposer,
                                              self.max_model_len)
                           if self.dp is not None else None)
        self.graph_startup: GraphStartup | None = None
        if config.batch_invariant and not config.enforce_eager and resolve_graph_backend(
                config.compilation.graph_backend, config.device) == "compiled":
            # NOTE: inductor's kernels reduce in their own order, chosen per compiled size
            logger.warning("batch_invariant: compiled CPU graphs are not batch-invariant; "
                           "every step runs eagerly")
            config.enforce_eager = True
        if config.enforce_eager:
            logger.info("enforce_eager: no graphs, every step runs eagerly")
        else:
            self.graph_startup = GraphStartup(self.runner, self.proposer, config,
                                              capture_progress, self.dp is not None,
                                              self.max_model_len)
        self.graph_builder = self.graph_startup.builder if self.graph_startup else None
        sweep_attention_shapes(self.runner)
        self._stats.warmed_up()

    # --- requests -------------------------------------------------------------------------
    def add_request(self, request_id: RequestId, prompt: Prompt,
                    params: SamplingParams | None = None) -> None:
        """Validate and queue one request (every sample of an ``n > 1`` one, or none). Bad
        input raises ValueError and leaves the engine untouched. The engine keeps its own
        copy of ``params``: changing the caller's object later changes nothing here."""
        check_request_id(request_id)
        params = (params or SamplingParams()).clone()
        if request_id in self.requests or request_id in self._parallel:
            raise ValueError(f"request_id {request_id!r} is already in use")
        got = self.inputs.process(prompt, params)
        spec = got.params.structured_outputs
        if spec is not None and self.tokenizer is None:
            raise ValueError(f"structured_outputs need a tokenizer; model {self.config.model!r} "
                             "has none")
        parent = ParentRequest(request_id, got.params) if params.n > 1 else None
        samples = ([(request_id, got.params)] if parent is None else
                   [(cid, parent.child_params(got.params, i))
                    for i, cid in enumerate(parent.child_ids)])
        # NOTE: every sample is built (seeded) before any is queued: all or none
        reqs = [Request(rid, got.prompt, got.token_ids, sample_params, got.eos_token_id,
                        self._arrivals + i, self.tokenizer, self.max_model_len)
                for i, (rid, sample_params) in enumerate(samples)]
        if parent is not None:
            self._parallel.add(parent)
        for req in reqs:
            self._arrivals += 1
            self.requests[req.request_id] = req
            if spec is None:
                self.scheduler.add_request(req)
            else:
                req.constrain(self.grammars.request_grammar(spec))
                self._compiling.append(req)

    def abort_request(self, request_id: RequestId) -> None:
        """Finish a request (every sample of an ``n > 1`` one) as "abort"; an id that names
        no running request is ignored. One sample alone cannot be aborted."""
        check_request_id(request_id)
        for rid in self._parallel.abort(request_id) or [request_id]:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (e.g. between benchmark runs); False while requests
        still hold blocks."""
        return self.kv.reset_prefix_cache()

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Bring every graph live now (at most ``timeout`` seconds); True when all are."""
        return self.graph_startup is None or self.graph_startup.wait(timeout)

    def advance_graphs(self) -> bool:
        """An idle engine's tick: at most one more built graph goes live, as before a step;
        True while graphs are still pending."""
        if self.graph_startup is None:
            return False
        self.graph_startup.advance(stepping=False)
        return not self.graph_startup.all_live

    def detach_graph_compile(self) -> int | None:
        """Let the background compile of this engine's graphs outlive it (a one-shot
        command about to exit), so a later run starts on graphs: its pid, or None when
        none is running."""
        return None if self.graph_startup is None else self.graph_startup.detach_compile()

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or outputs still to be returned by step()."""
        return (self.scheduler.has_unfinished() or bool(self._requeued)
                or bool(self._compiling))

    def requeue_outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs a caller took from ``step()`` but does not own (``LLM.generate`` stepping
        beside requests added directly): the next ``step()`` returns them first, in order."""
        self._requeued += outputs
        self.num_finished_outputs -= sum(out.finished for out in outputs)   # counted again

    def add_step_listener(self, listener: Callable[[ModelRunnerOutput], None]
                          ) -> Callable[[], None]:
        """Call ``listener`` with every step's ModelRunnerOutput (benchmarks, tests, tools);
        its tensors are views valid until the next step. Returns a function that removes
        it."""
        self._step_listeners.append(listener)
        return lambda: self._step_listeners.remove(listener)

    # --- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> (data parallel: sync) -> execute -> commit -> outputs -> propose;
        children of an ``n > 1`` request report as their parent. Under data parallel every
        rank must call it; loop until ``all_ranks_idle``."""
        startup = self.graph_startup
        if startup is not None and not startup.all_live:
            startup.advance()
        outputs = self._admit_compiled() if self._compiling else []
        sched = self.scheduler.schedule()
        outputs += [self._finish(req, "error", self._never_fits(req))
                    for req in sched.errored]
        self._stats.counts["preemptions"] += len(sched.preempted)
        dp_step = None
        if self._dp_engine is not None:
            dp_step = self._dp_engine.sync(sched, self.scheduler.has_unfinished(),
                                           self.num_finished_outputs)
            self.all_ranks_idle = dp_step.all_idle
            self.dp_num_finished = sum(dp_step.num_finished)
        if sched.scheduled:
            if dp_step is None:
                result = self.runner.execute(sched, sched.block_ids)
            else:
                result = self.runner.execute(sched, sched.block_ids,
                                             dp_step.num_tokens_across_dp(),
                                             dp_step.num_draft_tokens_across_dp())
            self._stats.steps[result.desc.mode, result.desc.num_tokens_padded] += 1
            for listener in self._step_listeners:
                listener(result)
            outputs += self._commit(sched, result)
            if self.proposer is not None:
                self._propose(sched, result, dp_step)
        if self._parallel.children:
            outputs = self._parallel.gather(outputs)
        if self._requeued:
            outputs, self._requeued = self._requeued + outputs, []
        self.num_finished_outputs += sum(out.finished for out in outputs)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled (finish those whose grammar failed);
        with nothing else to run, wait a little for one rather than spin."""
        if not self.scheduler.has_unfinished() and not any(r.grammar.ready
                                                           for r in self._compiling):
            concurrent.futures.wait([r.grammar.future for r in self._compiling],
                                    timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        outputs, waiting = [], []
        for req in self._compiling:
            if not req.grammar.ready:
                waiting.append(req)
            elif req.grammar.error is not None:
                outputs.append(self._finish(req, "error", req.grammar.error))
            else:
                req.grammar.start(req.output_token_ids)
                self.scheduler.add_request(req)
        self._compiling = waiting
        return outputs

    def _commit(self, sched: SchedulerOutput, result: ModelRunnerOutput
                ) -> list[RequestOutput]:
        """Advance every scheduled request by the tokens its step produced: one commit
        pass over the requests (`commit_step`), then their outputs in one pass."""
        commits = []
        for s in sched.scheduled:
            req = s.request
            new = result.sampled.get(req.request_id, [])
            # NOTE: KV of rejected drafts is discarded by not counting it as computed;
            # the next step overwrites those slots.
            num_accepted = max(len(new) - 1, 0) if s.num_spec_tokens else 0
            if s.num_spec_tokens and new:
                self.spec_stats.record(s.num_spec_tokens, num_accepted)
            if req.request_id in result.prompt_logprobs:
                req.add_prompt_logprobs(*result.prompt_logprobs[req.request_id])
            commits.append(Commit(req, new, s.num_new_tokens - s.num_spec_tokens + num_accepted,
                                  result.logprobs.get(req.request_id)))
        reported, finished = [], []
        for commit, (num_kept, reason) in zip(commits, commit_step(commits, self.kv)):
            self.num_generated_tokens += num_kept
            if not commit.tokens:
                continue
            if reason is not None:
                self._release(commit.request, reason)
                finished.append(commit.request)
            reported.append(commit.request)
        outputs = make_outputs(reported)
        for req in finished:
            del self.requests[req.request_id]
        return [out for out in outputs if out is not None]

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

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        self._release(req, reason, error)
        out = make_output(req)
        del self.requests[req.request_id]
        return out

    def _release(self, req: Request, reason: str, error: str | None = None) -> None:
        """``req`` finished: out of the scheduler (its KV blocks back) and counted."""
        if req in self._compiling:
            self._compiling.remove(req)
        self.scheduler.finish(req, reason, error)
        self._stats.counts[f"finished_{req.finish_reason}"] += 1

    def _never_fits(self, req: Request) -> str:
        """Why ``req`` failed: alone in the KV cache, it still did not fit."""
        why = f"request {req.request_id!r}: {self.kv.shortage(req.num_tokens)}"
        if req.num_output_tokens == 0:
            return (f"{why}: it can never run (shorten the prompt or give the KV cache more "
                    "blocks)")
        return (f"{why}: it ran out of KV cache after {req.num_output_tokens} output tokens "
                "(lower max_tokens or give the KV cache more blocks)")

    def stats(self) -> dict[str, Any]:
        return self._stats.as_dict(self)
