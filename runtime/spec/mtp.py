"""MTP proposer: a drafter (e.g. the Gemma 4 assistant) that reads the target's KV.

Every draft round runs one query per REAL request of the target step, at the position of
the request's last token, against the target's KV of the earlier positions through the
block table of the KV cache group the drafter's layer reads. The drafter writes no KV.
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
from rung.graphs.dispatcher import Dispatcher
from rung.graphs.ladder import draft_capture_sizes
from rung.graphs.manager import CaptureRecord, GraphManager
from rung.models.loader import DRAFT_WEIGHT_SEED, load_model
from rung.models.registry import DraftModel
from rung.runtime.config import EngineConfig
from rung.runtime.sched.request import Request
from rung.runtime.spec.proposer import Proposer, check_draft_rows
from rung.runtime.worker.attention_groups import build_attention_groups, build_layer_metadata
from rung.runtime.worker.input_batch import PaddedBatch
from rung.runtime.worker.model_runner import ModelRunner, ModelRunnerOutput, find_attention_layers

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

    def fill(self, reqs: list[Request], target_block_tables: list[np.ndarray],
             desc: BatchExecutionDescriptor) -> None:
        """Real rows from the requests, then the contract's pad values (`pad`)."""
        n = desc.num_reqs
        self.input_ids.np[:n] = [r.token_ids[-1] for r in reqs]
        # NOTE: the last token is not in the KV yet; the drafter sees positions < seq_len
        self.positions.np[:n] = [r.num_tokens - 1 for r in reqs]
        self.seq_lens.np[:n] = [r.num_computed_tokens for r in reqs]
        self.query_start_loc.np[:n + 1] = np.arange(n + 1)       # one query per request
        for bt, sm, target in zip(self.block_tables, self.slot_mappings, target_block_tables):
            bt.np[:n] = target[:n]
            sm.np[:n] = PAD_SLOT_ID
        self._num_reqs, self._num_tokens = n, desc.num_tokens
        self.pad(desc)

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
        if graphs.mode == CUDAGraphMode.NONE:
            return
        if self.runner.backend.graph_support < GraphSupport.UNIFORM_BATCH:
            return
        self.graphs = graphs
        comp = self.config.compilation
        sizes = draft_capture_sizes(comp.cudagraph_capture_sizes, self.runner.max_num_reqs,
                                    comp.max_cudagraph_capture_size,
                                    short=self.runner.device.type == "cpu")
        self.dispatcher = Dispatcher(CUDAGraphMode.FULL_DECODE_ONLY, sizes,
                                     self.runner.max_num_reqs)
        # NOTE: captured under the very descriptors dispatch() returns for a draft step
        # (FULL, one query per request, uniform_query_len 1), so replay finds its graph by
        # the drafter's own descriptor, whatever the target's decode query length.
        self.captured = self.dispatcher.capture_descriptors()
        with torch.inference_mode():
            for desc in self.captured:
                self.batch.fill([], self._target_block_tables(), desc)
                with forward_context(self._context(desc)):
                    graphs.capture_graph(_DRAFT, desc, self._draft_rounds,
                                         self.batch.graph_inputs(desc), self._poison_pads,
                                         progress)
                self.dispatcher.go_live(desc)

    def _poison_pads(self, desc: BatchExecutionDescriptor, generator: torch.Generator) -> None:
        self.batch.poison_pads(desc, generator, self.runner.vocab_size,
                               self.runner.max_model_len)

    def _target_block_tables(self) -> list[np.ndarray]:
        return [bt.np for bt in self.runner.input_batch.block_tables]

    # --- one draft step -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, desc: BatchExecutionDescriptor, reqs: list[Request],
                result: ModelRunnerOutput,
                num_tokens_across_dp: tuple[int, ...] | None = None) -> list[list[int]]:
        check_draft_rows(desc, reqs)
        if not reqs:
            return []
        # NOTE: request rows (metadata, block tables) follow the real requests of
        # for_drafting(); only token rows pad to the data-parallel size (failure class 3).
        draft_desc = self.dispatcher.dispatch(desc.num_reqs, desc.num_reqs, 1,
                                              num_tokens_across_dp)
        return self._run(draft_desc, reqs, result)[:desc.num_reqs].tolist()

    @torch.inference_mode()
    def propose_dummy(self, num_tokens_across_dp: tuple[int, ...]) -> None:
        """Data parallel: no request here while other ranks draft; run their size on pads."""
        draft_desc = self.dispatcher.dispatch(0, 0, 1, num_tokens_across_dp)
        if draft_desc.mode == CUDAGraphMode.NONE:
            draft_desc = BatchExecutionDescriptor.dp_dummy(num_tokens_across_dp)
        self._run(draft_desc, [], None)

    def _run(self, draft_desc: BatchExecutionDescriptor, reqs: list[Request],
             result: ModelRunnerOutput | None) -> torch.Tensor:
        """k draft rounds -> drafts [num_tokens_padded, k]; real rows first."""
        self.graph_replays[f"{draft_desc.mode.name}:{draft_desc.num_reqs_padded}"] += 1
        if self.config.debug_padding:
            self.batch.poison(self._poison_rng, self.runner.vocab_size, self.runner.num_blocks)
        self.batch.fill(reqs, self._target_block_tables(), draft_desc)
        self._gather_hidden(reqs, result, draft_desc)
        inputs = self.batch.graph_inputs(draft_desc)
        with forward_context(self._context(draft_desc)):
            if draft_desc.mode == CUDAGraphMode.FULL:
                return self.graphs.replay(_DRAFT, self.dispatcher.graph_key(draft_desc),
                                          inputs)
            return self._draft_rounds(*inputs)

    def _gather_hidden(self, reqs: list[Request], result: ModelRunnerOutput | None,
                       desc: BatchExecutionDescriptor) -> None:
        """Target hidden state of each request's last sampled token (its logits row)."""
        n = desc.num_reqs
        if n:
            rows = [result.hidden_rows.get(r.request_id, 0) for r in reqs]
            self.batch.hidden[:n].copy_(result.hidden[rows])               # [num_reqs, H]
        self.batch.hidden[n:desc.num_tokens_padded].zero_()

    def _context(self, desc: BatchExecutionDescriptor) -> ForwardContext:
        full = desc.mode == CUDAGraphMode.FULL
        real_max = int(self.batch.seq_lens.np[:desc.num_reqs].max(initial=0))
        max_seq_len = self.runner.max_model_len if full else max(real_max, 1)
        commons = self.batch.metadata_views(desc, 1, max_seq_len)
        per_layer = build_layer_metadata(self.attn_groups, commons, self.config.debug_padding)
        return ForwardContext(desc, per_layer, self.layers)

    def _draft_rounds(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor, *metadata: torch.Tensor) -> torch.Tensor:
        """k greedy rounds at a constant position -> drafts [num_reqs_padded, k]."""
        drafts = []
        for _ in range(self.num_spec_tokens):
            last_hidden, hidden = self.drafter(input_ids, hidden, positions)
            input_ids = self.drafter.compute_logits(last_hidden).argmax(dim=-1)
            drafts.append(input_ids)
        return torch.stack(drafts, dim=1)
