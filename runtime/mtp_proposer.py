"""MTP proposer: a drafter (e.g. the Gemma 4 assistant) that reads the target's KV.

Every draft round runs one query per REAL request of the target step, at the position of
the request's last token, against the target's KV of the earlier positions through the
block table of the KV cache group the drafter's layer reads. The drafter writes no KV.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from rung.core.attention_metadata import CommonAttentionMetadata
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext, forward_context
from rung.core.graph_mode import CUDAGraphMode, GraphSupport
from rung.graphs.capture import CapturedGraph
from rung.graphs.dispatcher import Dispatcher
from rung.graphs.ladder import draft_capture_sizes
from rung.models.loader import load_model
from rung.runtime.attention_groups import build_attention_groups, build_layer_metadata
from rung.runtime.input_batch import HostDevicePair
from rung.runtime.kv_cache_manager import NULL_BLOCK
from rung.runtime.model_runner import find_attention_layers
from rung.runtime.request import Request
from rung.runtime.spec_decode import Proposer


class DraftBatch:
    """Persistent draft inputs, allocated once for max_num_reqs rows."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, num_kv_groups: int,
                 backbone_hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        def pair(shape, dt):
            return HostDevicePair(shape, dt, device)

        self.input_ids = pair((max_num_reqs,), np.int64)           # [max_num_reqs] last token
        self.positions = pair((max_num_reqs,), np.int64)           # [max_num_reqs]
        self.query_start_loc = pair((max_num_reqs + 1,), np.int32)  # one query per request
        self.seq_lens = pair((max_num_reqs,), np.int32)            # target KV visible, 0 pads
        self.slot_mapping = pair((max_num_reqs,), np.int64)        # always -1: no KV writes
        self.block_tables = [pair((max_num_reqs, max_blocks_per_req), np.int32)
                             for _ in range(num_kv_groups)]
        self.hidden = torch.zeros(max_num_reqs, backbone_hidden, dtype=dtype,
                                  device=device)                   # [max_num_reqs, backbone]

    def poison(self, rng: np.random.Generator, num_blocks: int) -> None:
        """Garbage everywhere, so a pad value `fill()` forgets shows up (debug_padding)."""
        for pair in (self.input_ids, self.positions, self.query_start_loc, self.seq_lens,
                     self.slot_mapping):
            pair.np[:] = rng.integers(1, 1 << 20, pair.np.shape)
        for bt in self.block_tables:
            bt.np[:] = rng.integers(1, max(num_blocks, 2), bt.np.shape)

    def fill(self, reqs: list[Request], target_block_tables: list[np.ndarray],
             desc: BatchExecutionDescriptor) -> None:
        """Real rows from the requests; pad rows get the contract's safe values.

        Token-indexed rows (ids, positions, slots) pad to ``num_tokens_padded``, which data
        parallel may raise above ``num_reqs_padded``; request-indexed ones never do.
        """
        n, n_pad, t_pad = desc.num_reqs, desc.num_reqs_padded, desc.num_tokens_padded
        self.input_ids.np[:n] = [r.token_ids[-1] for r in reqs]
        # NOTE: the last token is not in the KV yet; the drafter sees positions < seq_len
        seq_lens = [r.num_computed_tokens for r in reqs]
        self.positions.np[:n] = [r.num_tokens - 1 for r in reqs]
        self.seq_lens.np[:n] = seq_lens
        self.query_start_loc.np[:n + 1] = np.arange(n + 1)
        self.query_start_loc.np[n + 1:n_pad + 1] = n
        self.seq_lens.np[n:n_pad] = 0
        self.input_ids.np[n:t_pad] = 0
        self.positions.np[n:t_pad] = 0
        self.slot_mapping.np[:t_pad] = -1
        for bt, target in zip(self.block_tables, target_block_tables):
            bt.np[:n] = target[:n]
            bt.np[n:n_pad] = NULL_BLOCK
        for pair in (self.input_ids, self.positions, self.slot_mapping):
            pair.sync(t_pad)
        self.seq_lens.sync(n_pad)
        self.query_start_loc.sync(n_pad + 1)
        for bt in self.block_tables:
            bt.sync(n_pad)

    def common_metadata(self, desc: BatchExecutionDescriptor, block_size: int,
                        max_seq_len: int) -> list[CommonAttentionMetadata]:
        n_pad, t_pad = desc.num_reqs_padded, desc.num_tokens_padded
        return [CommonAttentionMetadata(desc, self.query_start_loc.gpu[:n_pad + 1],
                                        self.seq_lens.gpu[:n_pad], bt.gpu[:n_pad],
                                        self.slot_mapping.gpu[:t_pad], block_size, 1,
                                        max_seq_len)
                for bt in self.block_tables]


class MtpProposer(Proposer):
    def __init__(self, config: Any, runner: Any, drafter: torch.nn.Module) -> None:
        self.config = config
        self.runner = runner
        self.drafter = drafter
        self.num_spec_tokens = config.num_spec_tokens
        self.layers = find_attention_layers(drafter)
        self._bind_layers()
        backbone = runner.model.config["hidden_size"]
        self.batch = DraftBatch(runner.input_batch.max_num_reqs,
                                runner.input_batch.block_tables[0].np.shape[1],
                                len(runner.kv_groups), backbone, config.dtype, runner.device)
        self.graphs: dict[int, CapturedGraph] = {}
        # one query per request: FULL on the draft ladder, eager above it (or without graphs)
        self.dispatcher = Dispatcher(CUDAGraphMode.NONE, [], runner.input_batch.max_num_reqs)
        self.records: list[dict] = []
        self._poison_rng = np.random.default_rng(config.seed + 7)

    @classmethod
    def build(cls, config: Any, engine: Any) -> "MtpProposer":
        spec = config.speculative
        target_type = engine.loaded.config.get("model_type", "")
        if not str(target_type).startswith("gemma4"):
            raise ValueError(f"speculative method 'mtp' with drafter {spec.model!r} requires a "
                             f"Gemma 4 target; model {config.model!r} is {target_type!r} "
                             "(use method 'ngram' for other models)")
        loaded = load_model(spec.model, config.dtype, str(config.device), config.load_format,
                            config.seed + 1)
        drafter = loaded.model
        if not hasattr(drafter, "bind_target"):
            raise ValueError(f"speculative model {spec.model!r} ({type(drafter).__name__}) is "
                             "not an MTP drafter (expected e.g. a gemma4_assistant)")
        drafter.bind_target(engine.runner.model)
        return cls(config, engine.runner, drafter)

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
    def capture_all(self, graphs: Any) -> None:
        """FULL_DECODE_ONLY draft graphs on the draft ladder, in the target's pool."""
        if graphs is None or graphs.mode == CUDAGraphMode.NONE:
            return
        if self.runner.backend.graph_support < GraphSupport.UNIFORM_BATCH:
            return
        self.capture_backend = graphs.capture_backend
        comp = self.config.compilation
        sizes = draft_capture_sizes(comp.cudagraph_capture_sizes,
                                    self.runner.input_batch.max_num_reqs,
                                    comp.max_cudagraph_capture_size,
                                    short=self.runner.device.type == "cpu")
        self.dispatcher = Dispatcher(CUDAGraphMode.FULL_DECODE_ONLY, sizes,
                                     self.runner.input_batch.max_num_reqs)
        with torch.inference_mode():
            for size in reversed(sizes):
                start = time.perf_counter()
                desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 0, size, 0, size)
                self.batch.fill([], [bt.np for bt in self.runner.input_batch.block_tables],
                                desc)
                with forward_context(self._context(desc)):
                    graph = self.capture_backend.capture(self._draft_rounds,
                                                         self._inputs(desc))
                self.graphs[size] = graph
                self.records.append({"mode": "DRAFT_FULL", "num_reqs_padded": size,
                                     "seconds": time.perf_counter() - start,
                                     "nbytes": graph.nbytes})

    # --- one draft step -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, desc: BatchExecutionDescriptor, reqs: list[Request],
                result: Any, num_tokens_across_dp: tuple[int, ...] | None = None
                ) -> list[list[int]]:
        assert len(reqs) == desc.num_reqs and desc.num_tokens == desc.num_reqs, (
            "draft steps run one query per real request")
        if not reqs:
            return []
        # NOTE: request rows (metadata, block tables) follow the real requests of
        # for_drafting(); only token rows pad to the data-parallel size (failure class 3).
        draft_desc = self.dispatcher.dispatch(desc.num_reqs, desc.num_reqs, 1,
                                              num_tokens_across_dp)
        tokens = self._run(draft_desc, reqs, result)
        return tokens[:desc.num_reqs].tolist()

    @torch.inference_mode()
    def propose_dummy(self, num_tokens_across_dp: tuple[int, ...]) -> None:
        """Data parallel: no request here while other ranks draft; run their size on pads."""
        draft_desc = self.dispatcher.dispatch(0, 0, 1, num_tokens_across_dp)
        if draft_desc.mode == CUDAGraphMode.NONE:
            draft_desc = BatchExecutionDescriptor.dp_dummy(num_tokens_across_dp)
        self._run(draft_desc, [], None)

    def _run(self, draft_desc: BatchExecutionDescriptor, reqs: list[Request],
             result: Any) -> torch.Tensor:
        """k draft rounds -> drafts [num_tokens_padded, k]; real rows first."""
        self.last_desc = draft_desc
        if self.config.debug_padding:
            self.batch.poison(self._poison_rng, self.runner.num_blocks)
        self.batch.fill(reqs, [bt.np for bt in self.runner.input_batch.block_tables],
                        draft_desc)
        self._gather_hidden(reqs, result, draft_desc)
        with forward_context(self._context(draft_desc)):
            if draft_desc.mode == CUDAGraphMode.FULL:
                return self.graphs[draft_desc.num_reqs_padded].replay(self._inputs(draft_desc))
            return self._draft_rounds(*self._inputs(draft_desc))

    def _gather_hidden(self, reqs: list[Request], result: Any,
                       desc: BatchExecutionDescriptor) -> None:
        """Target hidden state of each request's last sampled token (its logits row)."""
        n = desc.num_reqs
        if n:
            rows = [result.hidden_rows.get(r.request_id, 0) for r in reqs]
            target_hidden = self.runner.last_hidden                  # [num_tokens_padded, H]
            self.batch.hidden[:n].copy_(target_hidden[rows])
        self.batch.hidden[n:desc.num_tokens_padded].zero_()

    def _inputs(self, desc: BatchExecutionDescriptor) -> list[torch.Tensor]:
        n_pad, t_pad = desc.num_reqs_padded, desc.num_tokens_padded
        b = self.batch
        return [b.input_ids.gpu[:t_pad], b.hidden[:t_pad], b.positions.gpu[:t_pad],
                b.query_start_loc.gpu[:n_pad + 1], b.seq_lens.gpu[:n_pad]] + [
                    bt.gpu[:n_pad] for bt in b.block_tables]

    def _context(self, desc: BatchExecutionDescriptor) -> ForwardContext:
        full = desc.mode == CUDAGraphMode.FULL
        real_max = int(self.batch.seq_lens.np[:desc.num_reqs].max(initial=0))
        max_seq_len = self.runner.max_model_len if full else max(real_max, 1)
        commons = self.batch.common_metadata(desc, self.config.block_size, max_seq_len)
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
