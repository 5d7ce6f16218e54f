"""The engine's side of data parallel: the config every rank must share, the expert shards,
the per-step sync of sizes and the dummy step of a rank with no work."""

from __future__ import annotations

from typing import Any

from rung.core.graph_mode import CUDAGraphMode
from rung.models.moe import shard_experts
from rung.runtime.config import EngineConfig
from rung.runtime.dist.data_parallel import DataParallelGroup, DPStep
from rung.runtime.sched.scheduler import SchedulerOutput
from rung.runtime.spec.proposer import Proposer
from rung.runtime.worker.model_runner import ModelRunner


class EngineDataParallel:
    def __init__(self, group: DataParallelGroup, config: EngineConfig, runner: ModelRunner,
                 proposer: Proposer | None, max_model_len: int) -> None:
        self.group = group
        self.runner = runner
        self.proposer = proposer
        # NOTE: before capture: capture runs the model's collectives on every rank
        group.check_same_config(_fingerprint(config, runner, max_model_len))
        self._shard_experts()

    def _shard_experts(self) -> None:
        """Expert parallel: each rank keeps its slice of every MoE layer's experts."""
        rank, size = self.group.rank, self.group.world_size
        shard_experts(self.runner.model, rank, size)
        drafter = getattr(self.proposer, "drafter", None)
        if drafter is not None:
            shard_experts(drafter, rank, size)

    def sync(self, sched: SchedulerOutput, has_unfinished: bool, num_finished: int) -> DPStep:
        """Every rank agrees on this step's padded sizes; a rank with no request while
        another has some runs their sizes on pads (a dummy step) here."""
        graphs = self.runner.graphs
        no_graph = lambda n: None  # noqa: E731
        padded = (graphs.dispatcher.padded_size
                  if graphs is not None and graphs.mode != CUDAGraphMode.NONE else no_graph)
        drafts = getattr(self.proposer, "dispatcher", None)
        step = self.group.sync(sched.num_reqs, sched.num_tokens, has_unfinished, padded,
                               drafts.padded_size if drafts is not None else None,
                               num_finished)
        if step.any_work and not sched.scheduled:
            self.runner.execute_dummy(step.num_tokens_across_dp())
            if self.proposer is not None:
                self.proposer.propose_dummy(step.num_draft_tokens_across_dp())
        return step


def _fingerprint(config: EngineConfig, runner: ModelRunner, max_model_len: int
                 ) -> dict[str, Any]:
    """What every data-parallel rank must agree on (model, ladder, spec config)."""
    c = config
    spec = c.speculative
    return {"model": c.model, "dtype": str(c.dtype), "load_format": c.load_format,
            "quantization": c.quantization,
            "max_model_len": max_model_len, "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "block_size": c.block_size, "enforce_eager": c.enforce_eager,
            "cudagraph_mode": c.compilation.cudagraph_mode.name,
            "cudagraph_capture_sizes": c.compilation.cudagraph_capture_sizes,
            "graph_backend": c.compilation.graph_backend,
            "attention_backend": runner.backend.name,
            "speculative": None if spec is None else (spec.method, spec.model,
                                                      spec.num_speculative_tokens)}
