"""MTP proposer: a drafter (e.g. the Gemma 4 assistant) that reads the target's KV.

Every draft round runs one query per REAL request of the target step, at the position of
the request's last token, against the target's KV of the earlier positions through the
block table of the KV cache group the drafter's layer reads. The drafter writes no KV.

The drafter runs inside the target step (the runner's `DeviceDrafter` hook), between the
sampler and the step's one host copy, and its drafts come back in that copy: where each
request's last token is depends on how many drafts it accepted, which only the device knows
then, so the draft batch is written from the request's state before the step and moved
past its accepted drafts on the device (`DraftBatch.advance`). The request state machine
is untouched: the engine still sets the drafts after the commit (``Request.set_drafts``).
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import torch

from rung.core.attention_metadata import PAD_SLOT_ID
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext, forward_context
from rung.core.graph_mode import CUDAGraphMode, GraphSupport
from rung.graphs.cpu_compiled.draft_rounds import DraftRounds
from rung.graphs.dispatcher import Dispatcher
from rung.graphs.ladder import draft_capture_sizes
from rung.graphs.manager import CaptureRecord, GraphManager
from rung.models.loader import DRAFT_WEIGHT_SEED, load_model
from rung.models.registry import DraftModel
from rung.runtime.config import EngineConfig
from rung.runtime.sched.request import Request
from rung.runtime.sched.scheduler import ScheduledRequest, SchedulerOutput
from rung.runtime.spec.proposer import Proposer, check_draft_rows
from rung.runtime.worker.attention_groups import build_attention_groups, build_layer_metadata
from rung.runtime.worker.input_batch import PaddedBatch
from rung.runtime.worker.model_runner import ModelRunner, SampledOnDevice, find_attention_layers
from rung.runtime.worker.step_output import ModelRunnerOutput

_DRAFT = "draft"           # the drafter's graphs in the graph manager (records: DRAFT_FULL)


class DraftBatch(PaddedBatch):
    """Persistent draft inputs: one query per request, so token rows are request rows.

    The pad values, the poisoning and the attention metadata views are InputBatch's
    (PaddedBatch); every slot is PAD_SLOT_ID, real rows included: a drafter writes no KV.
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, num_kv_groups: int,
                 block_size: int, backbone_hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(max_num_reqs, max_num_reqs, max_blocks_per_req, num_kv_groups,
                         block_size, device)
        self.hidden = torch.zeros(max_num_reqs, backbone_hidden, dtype=dtype,
                                  device=device)                   # [max_num_reqs, backbone]

    def fill(self, scheduled: list[ScheduledRequest], target_block_tables: list[np.ndarray],
             desc: BatchExecutionDescriptor) -> int:
        """Real rows from the target step's requests, as they were before it, then the
        contract's pad values (`pad`). Returns a host bound of every real row's seq_len
        once `advance` has run (the eager KV width, read without a sync).

        A request that samples this step gets ``accepted + 1`` tokens: its query sits at
        ``num_tokens + accepted`` and sees ``num_computed + own tokens + accepted`` keys;
        `advance` adds the ``accepted`` on the device. A prefill chunk that samples nothing
        keeps its last token (its drafts are never used).
        """
        n = desc.num_reqs
        # NOTE: the last token is not in the KV yet; the drafter sees positions < seq_len
        self.input_ids.np[:n] = [s.request.token_ids[-1] for s in scheduled]
        self.positions.np[:n] = [s.request.num_tokens - 1 + s.samples for s in scheduled]
        seq_lens = [s.request.num_computed_tokens + s.num_new_tokens - s.num_spec_tokens
                    for s in scheduled]
        self.seq_lens.np[:n] = seq_lens
        self.query_start_loc.np[:n + 1] = np.arange(n + 1)       # one query per request
        for bt, sm, target in zip(self.block_tables, self.slot_mappings, target_block_tables):
            bt.np[:n] = target[:n]
            sm.np[:n] = PAD_SLOT_ID
        self._num_reqs, self._num_tokens = n, desc.num_tokens
        self.pad(desc)
        return max((seq + s.num_spec_tokens for seq, s in zip(seq_lens, scheduled)),
                   default=0)

    def advance(self, sampled: SampledOnDevice | None, hidden: torch.Tensor | None,
                desc: BatchExecutionDescriptor) -> None:
        """On the device: each sampling request's row moves past its accepted drafts (last
        token, position, seq_len), and every real row takes the target's hidden state at
        the token row whose logits gave its last token (row 0 for one that sampled
        nothing)."""
        n = desc.num_reqs
        if n:
            hidden_rows = torch.zeros(n, dtype=torch.int64, device=self.hidden.device)
            if sampled is not None:
                rows, accepted, last = sampled.req_rows, sampled.accepted, sampled.last_rows()
                self.input_ids.gpu[rows] = sampled.tokens[last]
                self.positions.gpu[rows] += accepted
                self.seq_lens.gpu[rows] += accepted.to(self.seq_lens.gpu.dtype)
                hidden_rows[rows] = sampled.logits_indices[last]
            self.hidden[:n].copy_(hidden[hidden_rows])                 # [num_reqs, H]
        self.hidden[n:desc.num_tokens_padded].zero_()

    def poison_pads(self, desc: BatchExecutionDescriptor, generator: torch.Generator,
                    vocab_size: int, max_position: int) -> None:
        super().poison_pads(desc, generator, vocab_size, max_position)
        t, t_pad = desc.num_tokens, desc.num_tokens_padded
        self.hidden[t:t_pad] = torch.randn(t_pad - t, self.hidden.shape[1],
                                           generator=generator).to(self.hidden)

    def graph_inputs(self, desc: BatchExecutionDescriptor) -> list[torch.Tensor]:
        """The drafter's inputs, views sliced by ``desc`` (static across replays).

        NOTE: token rows (ids, hidden, positions) run to ``num_tokens_padded``, which data
        parallel may raise above ``num_reqs_padded``; request rows never do (class 3).
        """
        n_pad, t_pad = desc.num_reqs_padded, desc.num_tokens_padded
        return [self.input_ids.gpu[:t_pad], self.hidden[:t_pad], self.positions.gpu[:t_pad],
                self.query_start_loc.gpu[:n_pad + 1], self.seq_lens.gpu[:n_pad]] + [
                    bt.gpu[:n_pad] for bt in self.block_tables]


class MtpProposer(Proposer):
    def __init__(self, config: EngineConfig, runner: ModelRunner,
                 drafter: torch.nn.Module) -> None:
        self.config = config
        self.runner = runner
        self.drafter = drafter
        self.num_spec_tokens = config.num_spec_tokens
        self.layers = find_attention_layers(drafter)
        self._bind_layers()
        backbone = runner.model.config["hidden_size"]
        self.batch = DraftBatch(runner.max_num_reqs,
                                runner.input_batch.block_tables[0].np.shape[1],
                                len(runner.kv_groups), config.block_size, backbone,
                                config.dtype, runner.device)
        self.graphs: GraphManager | None = None      # the target's, once drafts are captured
        # one query per request: FULL on the draft ladder, eager above it (or without graphs)
        self.dispatcher = Dispatcher(CUDAGraphMode.NONE, [], runner.max_num_reqs)
        self.captured: list[BatchExecutionDescriptor] = []   # draft graphs, by descriptor
        self.graph_replays: collections.Counter = collections.Counter()   # "MODE:rows" -> steps
        self._poison_rng = np.random.default_rng(config.seed + 7)
        runner.use_drafter(self)           # drafts inside every target step (`draft`)

    @classmethod
    def build(cls, config: EngineConfig, runner: ModelRunner) -> MtpProposer:
        spec = config.speculative
        target_type = runner.model.config.get("model_type", "")
        if not str(target_type).startswith("gemma4"):
            raise ValueError(f"speculative method 'mtp' with drafter {spec.model!r} requires a "
                             f"Gemma 4 target; model {config.model!r} is {target_type!r} "
                             "(use method 'ngram' for other models)")
        loaded = load_model(spec.model, config.dtype, str(config.device), config.load_format,
                            DRAFT_WEIGHT_SEED)
        drafter = loaded.model
        if not isinstance(drafter, DraftModel):
            raise ValueError(f"speculative model {spec.model!r} ({type(drafter).__name__}) is "
                             "not an MTP drafter (expected e.g. a gemma4_assistant)")
        drafter.bind_target(runner.model)
        return cls(config, runner, drafter)

    def _bind_layers(self) -> None:
        runner = self.runner
        for name, layer in self.layers.items():
            target = layer.kv_sharing_target
            if target not in runner.kv_caches:
                raise ValueError(f"draft layer {name} reads target layer {target!r}, which "
                                 "the target model does not have")
            runner.backend.validate_layer(layer.spec, runner.kv_groups[
                runner.layer_kv_group[target]].spec)
            layer.bind(runner.backend, runner.kv_caches[target])
        self.layer_kv_group = {n: runner.layer_kv_group[layer.kv_sharing_target]
                               for n, layer in self.layers.items()}
        specs = {g.group_id: g.spec for g in runner.kv_groups}
        # NOTE: drafter layers have fewer query heads than the target's: the key
        # (backend, kv_spec, num_heads_q) gives them attention groups of their own.
        self.attn_groups = build_attention_groups(self.layers, self.layer_kv_group, specs,
                                                  runner.backend, runner.device)

    # --- graphs -------------------------------------------------------------------------
    def capture_all(self, graphs: GraphManager,
                    progress: Callable[[CaptureRecord], None] | None = None) -> None:
        """FULL_DECODE_ONLY draft graphs on the draft ladder, through the target's graph
        manager (its capture backend and memory pool; `rung warmup` lists them)."""
        sizes = self._capture_sizes(graphs)
        if not sizes:
            return
        self.graphs = graphs
        self.dispatcher = Dispatcher(CUDAGraphMode.FULL_DECODE_ONLY, sizes,
                                     self.runner.max_num_reqs)
        # compiled CPU graphs: one round's artifact (what its code depends on besides the
        # tensors' shapes and models/' source: the drafter's class and config)
        rounds = DraftRounds(self._draft_round, self.num_spec_tokens, self.drafter,
                             {"drafter": type(self.drafter).__qualname__,
                              "drafter_config": self.drafter.config})
        # NOTE: captured under the very descriptors dispatch() returns for a draft step
        # (FULL, one query per request, uniform_query_len 1), so replay finds its graph by
        # the drafter's own descriptor, whatever the target's decode query length. Sizes
        # of two rows or more first: under compiled CPU graphs they build the one artifact
        # (symbolic batch) that a one-row graph then binds.
        self.captured = sorted(self.dispatcher.capture_descriptors(),
                               key=lambda d: (d.num_reqs_padded < 2, d.num_reqs_padded))
        with torch.inference_mode():
            for desc in self.captured:
                self.batch.fill([], self._target_block_tables(), desc)
                with forward_context(self._context(desc)):
                    graphs.capture_graph(_DRAFT, desc, self._draft_rounds,
                                         self.batch.graph_inputs(desc), self._poison_pads,
                                         progress, rounds)
                self.dispatcher.go_live(desc)

    def _capture_sizes(self, graphs: GraphManager | None) -> list[int]:
        """The draft ladder (request counts) under ``graphs``; [] when it captures none."""
        if (graphs is None or graphs.mode == CUDAGraphMode.NONE
                or self.runner.backend.graph_support < GraphSupport.UNIFORM_BATCH):
            return []
        comp = self.config.compilation
        return draft_capture_sizes(comp.cudagraph_capture_sizes, self.runner.max_num_reqs,
                                   comp.max_cudagraph_capture_size,
                                   short=self.runner.device.type == "cpu")

    def graph_status(self) -> dict:
        """The drafter's graphs (engine.stats()["graphs"]["draft"]): live and pending sizes
        (request rows), how they replay ("compiled": one round's inductor artifact per
        round; "emulated": the eager rounds again; "cuda"), their artifacts, and draft
        steps run per "MODE:rows" (NONE: eagerly)."""
        graphs = self.runner.graphs
        records = [r for r in graphs.records if r.graph == _DRAFT] if graphs else []
        live = sorted(d.num_reqs_padded for d in self.dispatcher.live)
        return {"live": live,
                "pending": [s for s in self._capture_sizes(graphs) if s not in live],
                "replay": graphs.capture_backend.name if graphs else None,
                "artifacts": sorted({r.artifact for r in records if r.artifact}),
                "steps": dict(self.graph_replays)}

    def _poison_pads(self, desc: BatchExecutionDescriptor, generator: torch.Generator) -> None:
        self.batch.poison_pads(desc, generator, self.runner.vocab_size,
                               self.runner.max_model_len)

    def _target_block_tables(self) -> list[np.ndarray]:
        return [bt.np for bt in self.runner.input_batch.block_tables]

    # --- one draft step -------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, desc: BatchExecutionDescriptor, sched: SchedulerOutput,
              hidden: torch.Tensor, sampled: SampledOnDevice | None,
              num_tokens_across_dp: tuple[int, ...] | None = None) -> torch.Tensor:
        """The runner's `DeviceDrafter` hook, inside the target step: drafts
        [num_reqs, k] int64 on the device, nothing read back."""
        check_draft_rows(desc, [s.request for s in sched.scheduled])
        # NOTE: request rows (metadata, block tables) follow the real requests of
        # for_drafting(); only token rows pad to the data-parallel size (failure class 3).
        draft_desc = self.dispatcher.dispatch(desc.num_reqs, desc.num_reqs, 1,
                                              num_tokens_across_dp)
        return self._run(draft_desc, sched.scheduled, hidden, sampled)[:desc.num_reqs]

    def propose(self, desc: BatchExecutionDescriptor, reqs: list[Request],
                result: ModelRunnerOutput,
                num_tokens_across_dp: tuple[int, ...] | None = None) -> list[list[int]]:
        """The drafts `draft` made inside the target step; they came back in its copy."""
        check_draft_rows(desc, reqs)
        return result.drafts if result.drafts is not None else []

    @torch.inference_mode()
    def propose_dummy(self, num_tokens_across_dp: tuple[int, ...]) -> None:
        """Data parallel: no request here while other ranks draft; run their size on pads."""
        draft_desc = self.dispatcher.dispatch(0, 0, 1, num_tokens_across_dp)
        if draft_desc.mode == CUDAGraphMode.NONE:
            draft_desc = BatchExecutionDescriptor.dp_dummy(num_tokens_across_dp)
        self._run(draft_desc, [], None, None)

    def _run(self, draft_desc: BatchExecutionDescriptor, scheduled: list[ScheduledRequest],
             hidden: torch.Tensor | None, sampled: SampledOnDevice | None) -> torch.Tensor:
        """k draft rounds -> drafts [num_tokens_padded, k]; real rows first."""
        self.graph_replays[f"{draft_desc.mode.name}:{draft_desc.num_reqs_padded}"] += 1
        if self.config.debug_padding:
            self.batch.poison(self._poison_rng, self.runner.vocab_size, self.runner.num_blocks)
        max_seq_len = self.batch.fill(scheduled, self._target_block_tables(), draft_desc)
        self.batch.advance(sampled, hidden, draft_desc)
        inputs = self.batch.graph_inputs(draft_desc)
        with forward_context(self._context(draft_desc, max_seq_len)):
            if draft_desc.mode == CUDAGraphMode.FULL:
                return self.graphs.replay(_DRAFT, self.dispatcher.graph_key(draft_desc),
                                          inputs)
            return self._draft_rounds(*inputs)

    def _context(self, desc: BatchExecutionDescriptor, max_seq_len: int = 1
                 ) -> ForwardContext:
        """``max_seq_len``: a host bound of the real rows' seq_lens (eager KV width)."""
        full = desc.mode == CUDAGraphMode.FULL
        max_seq_len = (self.runner.max_model_len if full
                       else min(max(max_seq_len, 1), self.runner.max_model_len))
        commons = self.batch.metadata_views(desc, 1, max_seq_len)
        per_layer = build_layer_metadata(self.attn_groups, commons, self.config.debug_padding)
        return ForwardContext(desc, per_layer, self.layers)

    def _draft_rounds(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor, *metadata: torch.Tensor) -> torch.Tensor:
        """k greedy rounds at a constant position -> drafts [num_reqs_padded, k].

        NOTE: the rounds are the drafter's own: models/, whose source keys a compiled
        artifact (``_draft_round``)."""
        return self.drafter.greedy_drafts(input_ids, hidden, positions, self.num_spec_tokens)

    def _draft_round(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor, *metadata: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy round -> (tokens [num_reqs_padded], hidden [num_reqs_padded, B]): what
        a compiled CPU draft graph compiles and calls k times."""
        return self.drafter.greedy_round(input_ids, hidden, positions)
