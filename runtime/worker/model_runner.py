"""ModelRunner: scheduler output -> descriptor -> padded inputs and metadata -> forward ->
sampled tokens -> the step's one host copy, read into its ModelRunnerOutput."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext, forward_context
from rung.core.graph_mode import CUDAGraphMode
from rung.core.kv_cache_spec import KVCacheGroup, group_layers_by_spec
from rung.graphs.capture import ForwardOutput
from rung.graphs.dispatcher import Dispatcher
from rung.kernels.attention import Attention
from rung.kernels.backend import AttentionBackend, allocate_kv_cache
from rung.kernels.selector import select_backend
from rung.models.loader import LoadedModel
from rung.runtime.config import EngineConfig, cpu_kvcache_space_bytes
from rung.runtime.sched.scheduler import SchedulerOutput
from rung.runtime.worker.attention_groups import build_attention_groups, build_layer_metadata
from rung.runtime.worker.input_batch import InputBatch, StepInputs
from rung.runtime.worker.rejection_sampler import num_accepted
from rung.runtime.worker.sampler import Sampler, to_device, token_logprobs
from rung.runtime.worker.step_output import (
    HostCopy,
    ModelRunnerOutput,
    PromptRows,
    StepCopy,
    prompt_rows,
)

if TYPE_CHECKING:
    from rung.graphs.manager import GraphManager

# (descriptor, num_tokens_across_dp) -> the descriptor the step runs
DescriptorHook = Callable[[BatchExecutionDescriptor, "tuple[int, ...] | None"],
                          BatchExecutionDescriptor]


@dataclasses.dataclass
class SampledOnDevice:
    """A step's verified tokens while only the device has them: what a drafter reads to
    start from each request's last token without a host round trip."""

    tokens: torch.Tensor          # [num_logits] int64, the sampler's token per logits row
    accepted: torch.Tensor        # [num_sampling] int64, drafts kept per sampling request
    req_rows: torch.Tensor        # [num_sampling] int64, its row in the scheduler output
    starts: torch.Tensor          # [num_sampling] int64, its first logits row
    logits_indices: torch.Tensor  # [num_logits] int64, the token row of each logits row

    def last_rows(self) -> torch.Tensor:
        """[num_sampling] the logits row of each sampling request's last emitted token."""
        return self.starts + self.accepted


class DeviceDrafter(Protocol):
    """A proposer whose drafts are computed inside the target step, on the device, before
    the step's one host copy (MTP): they come back in that copy, as ``out.drafts``."""

    def draft(self, desc: BatchExecutionDescriptor, sched: SchedulerOutput,
              hidden: torch.Tensor, sampled: SampledOnDevice | None,
              num_tokens_across_dp: tuple[int, ...] | None) -> torch.Tensor:
        """``desc``: the step's ``for_drafting()``; ``hidden`` [num_tokens_padded, H] the
        target's; ``sampled`` None when no request sampled (data parallel still drafts, for
        the collectives). -> drafts [desc.num_reqs, k] int64 on the device."""
        ...


def find_attention_layers(model: torch.nn.Module) -> dict[str, Attention]:
    return {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> None:
        self.config = config
        self.model = loaded.model
        self.device = config.device
        self.max_model_len = max_model_len
        self.max_num_reqs = config.max_num_seqs
        self.vocab_size = loaded.config["vocab_size"]
        self.layers = find_attention_layers(self.model)
        self.backend = select_backend(config.attention_backend, config.device,
                                      self._check_layers)
        self._init_kv_groups()
        self.num_blocks = self._num_blocks()
        self._bind_kv_caches()
        max_num_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.input_batch = self._new_input_batch(max_num_tokens)
        # a capture batch of its own for graphs built off the serving thread (dummy_batch)
        self._scratch_batch: InputBatch | None = None
        self.sampler = Sampler()
        self.host_copy = HostCopy(config.device)
        self.graphs: GraphManager | None = None      # see use_graphs; None runs eagerly
        # NOTE: without graphs, a dispatcher with no graph: every batch dispatches eager
        self.dispatcher = Dispatcher(CUDAGraphMode.NONE, [], config.max_num_seqs,
                                     1 + config.num_spec_tokens)
        self.drafter: DeviceDrafter | None = None     # see use_drafter
        self._descriptor_hooks: list[DescriptorHook] = []
        self._poison_rng = np.random.default_rng(config.seed)

    # --- set-up -----------------------------------------------------------------------
    def _check_layers(self, backend: type[AttentionBackend]) -> None:
        """ValueError if ``backend`` cannot run one of the model's layers."""
        cfg = self.config
        for layer in self.layers.values():
            backend.validate_layer(layer.spec, layer.kv_spec(cfg.block_size, cfg.dtype))

    def _init_kv_groups(self) -> None:
        cfg = self.config
        self._check_layers(self.backend)
        own = {n: layer.kv_spec(cfg.block_size, cfg.dtype)
               for n, layer in self.layers.items() if layer.kv_sharing_target is None}
        self.kv_groups: list[KVCacheGroup] = group_layers_by_spec(own)
        self.layer_kv_group = {n: g.group_id for g in self.kv_groups for n in g.layer_names}
        for name, layer in self.layers.items():
            if layer.kv_sharing_target is not None:
                self.layer_kv_group[name] = self.layer_kv_group[layer.kv_sharing_target]
        specs = {g.group_id: g.spec for g in self.kv_groups}
        self.attn_groups = build_attention_groups(self.layers, self.layer_kv_group, specs,
                                                  self.backend, self.device)

    def _num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            if self.config.num_gpu_blocks_override < 1:
                raise ValueError(f"num_gpu_blocks_override="
                                 f"{self.config.num_gpu_blocks_override} must be >= 1")
            return self.config.num_gpu_blocks_override + 1
        per_seq = math.ceil(self.max_model_len / self.config.block_size)
        wanted = self.config.max_num_seqs * per_seq
        bytes_per_block = sum(g.spec.page_size_bytes * len(g.layer_names) for g in self.kv_groups)
        return max(min(wanted, self._kv_budget_bytes() // bytes_per_block), per_seq) + 1

    def _kv_budget_bytes(self) -> int:
        """The most memory the KV cache may take: ``gpu_memory_utilization`` (default half)
        of the free device memory (weights already loaded) on CUDA; on CPU
        $RUNG_CPU_KVCACHE_SPACE (see `cpu_kvcache_space_bytes`)."""
        if self.device.type == "cuda":
            share = self.config.gpu_memory_utilization
            return int(torch.cuda.mem_get_info(self.device)[0] * (share or 0.5))
        return cpu_kvcache_space_bytes()

    def _bind_kv_caches(self) -> None:
        self.kv_caches: dict[str, torch.Tensor] = {}
        for group in self.kv_groups:
            for name in group.layer_names:
                self.kv_caches[name] = allocate_kv_cache(group.spec, self.num_blocks,
                                                         self.device)
        for name, layer in self.layers.items():
            layer.bind(self.backend, self.kv_caches[layer.kv_sharing_target or name])

    def use_graphs(self, graphs: GraphManager) -> None:
        """Dispatch and run every later step through ``graphs`` (captured or capturing)."""
        self.graphs = graphs
        self.dispatcher = graphs.dispatcher

    def use_drafter(self, drafter: DeviceDrafter) -> None:
        """Every later step runs ``drafter`` after its sampler and packs the drafts into its
        one host copy."""
        self.drafter = drafter

    def add_descriptor_hook(self, hook: DescriptorHook) -> Callable[[], None]:
        """Every step's descriptor goes through ``hook(desc, num_tokens_across_dp)``, which
        returns the one the step runs (a tool that pads to another captured size, e.g.
        `rung verify`). Returns a function that removes it."""
        self._descriptor_hooks.append(hook)
        return lambda: self._descriptor_hooks.remove(hook)

    # --- one step -----------------------------------------------------------------------
    # dispatch (+ hooks) -> prepare (inputs + metadata) -> forward (graph or eager) -> logits
    # -> sample -> the one host copy
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: list[list[list[int]]],
                num_tokens_across_dp: tuple[int, ...] | None = None,
                num_draft_tokens_across_dp: tuple[int, ...] | None = None
                ) -> ModelRunnerOutput:
        """``num_tokens_across_dp`` / ``num_draft_tokens_across_dp``: data parallel only,
        the target / draft sizes the DP sync agreed on."""
        if self.config.debug_padding:
            self.input_batch.poison(self._poison_rng, self.vocab_size, self.num_blocks)
        desc = self._dispatch(sched, num_tokens_across_dp)
        inputs = self.input_batch.prepare(sched, block_ids, desc, self.max_model_len)
        if self.config.debug_padding:
            self.input_batch.check_block_rows(block_ids)
        hidden, logits = self.forward(desc, inputs)               # [num_tokens_padded, H]
        if logits is None:      # NOTE: a forward that does not end in the lm head
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_logits, V]
        out = ModelRunnerOutput(desc, {s.request.request_id: [] for s in sched.scheduled},
                                {}, hidden, logits)
        self._sample(sched, inputs, logits, out, num_draft_tokens_across_dp)
        return out

    def _dispatch(self, sched: SchedulerOutput,
                  num_tokens_across_dp: tuple[int, ...] | None) -> BatchExecutionDescriptor:
        """The descriptor the step runs: the dispatcher's for its real counts, then every
        descriptor hook's."""
        desc = self.dispatcher.dispatch(len(sched.scheduled), sched.num_tokens,
                                        sched.uniform_query_len, num_tokens_across_dp)
        for hook in self._descriptor_hooks:
            desc = hook(desc, num_tokens_across_dp)
        return desc

    @torch.inference_mode()
    def execute_dummy(self, num_tokens_across_dp: tuple[int, ...]) -> None:
        """A data-parallel rank with no work while others work: run the agreed size on
        pads only, so the model's collectives match the other ranks'."""
        desc = BatchExecutionDescriptor.dp_dummy(num_tokens_across_dp)
        if self.config.debug_padding:
            self.input_batch.poison(self._poison_rng, self.vocab_size, self.num_blocks)
        layout = self.input_batch.prepare_empty()
        self.input_batch.pad(desc)
        self.forward(desc, self.input_batch.inputs(desc, layout, self.max_model_len))

    def forward(self, desc: BatchExecutionDescriptor, inputs: StepInputs) -> ForwardOutput:
        """Run the target model on the prepared, padded batch -> hidden [num_tokens_padded,
        H] and, where a graph ends in the lm head (per-layer compiled FULL graphs), the
        logits of its sampled rows (``inputs.logits_indices``)."""
        ids, positions, ctx = self.forward_args(desc, inputs)
        if self.graphs is not None:
            return self.graphs.run(desc, ids, positions, ctx,     # enters ctx where read
                                   inputs.logits_indices)
        with forward_context(ctx):
            return ForwardOutput(self.model(ids, positions), None)

    def _new_input_batch(self, max_num_tokens: int) -> InputBatch:
        config = self.config
        return InputBatch(config.max_num_seqs, max_num_tokens,
                          math.ceil(self.max_model_len / config.block_size),
                          len(self.kv_groups), config.block_size, config.device,
                          decode_query_len=1 + config.num_spec_tokens)

    def forward_args(self, desc: BatchExecutionDescriptor, inputs: StepInputs,
                     check: bool = True) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """(input ids, positions, forward context) of a padded batch: every layer's
        attention metadata built on ``inputs``' views (checked in debug mode, unless not
        ``check``)."""
        attn_metadata = build_layer_metadata(self.attn_groups, inputs.commons,
                                             self.config.debug_padding and check)
        return inputs.input_ids, inputs.positions, ForwardContext(
            desc, attn_metadata, self.layers, commons=inputs.commons)

    def poison_pads(self, desc: BatchExecutionDescriptor, generator: torch.Generator) -> None:
        """Garbage into the pad input rows a replay of ``desc`` reads (debug_padding)."""
        self.input_batch.poison_pads(desc, generator, self.vocab_size, self.max_model_len)

    def dummy_batch(self, desc: BatchExecutionDescriptor, scratch: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Inputs of a capture batch: every row a pad. ``scratch``: in input buffers of
        their own, which no step reads or writes (a graph built off the serving thread)."""
        batch = self.input_batch
        if scratch:
            if self._scratch_batch is None:
                self._scratch_batch = self._new_input_batch(self.input_batch.max_num_tokens)
            batch = self._scratch_batch
        layout = batch.prepare_empty()
        batch.pad(desc)
        return self.forward_args(desc, batch.inputs(desc, layout, self.max_model_len))

    def input_views(self, desc: BatchExecutionDescriptor
                    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """The serving input buffers as a FULL step of ``desc`` hands them to its graph,
        made without writing (or checking) them: what a graph built on a scratch batch
        binds to, while steps run."""
        if desc.mode != CUDAGraphMode.FULL:
            raise ValueError(f"input_views of a {desc.mode.name} batch: FULL graphs only")
        inputs = self.input_batch.inputs(desc, self.input_batch.prepare_empty_layout(),
                                         self.max_model_len)
        return self.forward_args(desc, inputs, check=False)

    def _sample(self, sched: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor,
                out: ModelRunnerOutput,
                num_draft_tokens_across_dp: tuple[int, ...] | None = None) -> None:
        """Sampled tokens (and logprobs, prompt logprobs, a device drafter's drafts) of every
        request into ``out``: one batched pass on the device (sampler, verification of
        drafts, the drafter), then ONE device-to-host copy (`StepCopy`)."""
        reqs, drafts, req_rows, wants_prompt = [], [], [], False
        for i, (s, n) in enumerate(zip(sched.scheduled, inputs.layout.num_logits_per_req)):
            if n:                    # NOTE: request order = logits row order, 1 + k rows each
                reqs.append(s.request)
                drafts.append(s.request.spec_token_ids[:n - 1])
                req_rows.append(i)
            wants_prompt |= s.request.params.prompt_logprobs is not None
        prompt = prompt_rows(sched) if wants_prompt else []
        drafting = self.drafter is not None and (
            bool(reqs) or num_draft_tokens_across_dp is not None)
        if not reqs and not prompt and not drafting:
            return
        starts = tokens = accepted = lps = prompt_lps = proposed = sampled = None
        if reqs:
            result = self.sampler.sample(logits, reqs, drafts, self.config.seed,
                                         self.vocab_size, self.device)
            batch, tokens, lps = result.batch, result.tokens, result.logprobs
            starts = batch.starts
            if batch.num_drafts or drafting:
                accepted = num_accepted(tokens, batch)            # [num_reqs] int64
            if drafting:
                sampled = SampledOnDevice(
                    tokens, accepted, to_device(self.device, np.asarray(req_rows)),
                    to_device(self.device, starts), inputs.logits_indices)
            if not batch.num_drafts:
                accepted = None                                   # NOTE: not copied
        if prompt:
            prompt_lps = self._prompt_logprobs(out.hidden, prompt)
        if drafting:
            # NOTE: queued behind the sampler, before the copy: no host round trip between
            proposed = self.drafter.draft(out.desc.for_drafting(), sched, out.hidden,
                                          sampled, num_draft_tokens_across_dp)
            if not reqs:
                proposed = None                                   # NOTE: not copied
        if reqs or prompt:                                        # NOTE: the step's one copy
            self.host_copy.fetch(StepCopy(reqs, starts, tokens, accepted, lps, prompt,
                                          prompt_lps, proposed), out)

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt: list[PromptRows]) -> torch.Tensor:
        """Row t: the logprob of prompt token t + 1. -> [num_rows, 2 + 2 * num_top]."""
        rows = np.concatenate([np.arange(r, r + n) for _, r, _, n in prompt])
        nexts = np.concatenate([np.asarray(req.prompt_token_ids[p + 1:p + 1 + n])
                                for req, _, p, n in prompt])
        num_top = max(req.params.prompt_logprobs for req, *_ in prompt)
        logits = self.model.compute_logits(hidden[to_device(self.device, rows)])
        return token_logprobs(logits, to_device(self.device, nexts), num_top)
