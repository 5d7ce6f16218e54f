"""What `LLMEngine.stats()` reports: KV usage, prefix cache, graph replays, spec decode."""

from __future__ import annotations

import collections
from typing import Any

from rung.core.graph_mode import CUDAGraphMode
from rung.kernels.triton.variants import KERNEL_VARIANTS
from rung.runtime.sched.kv_cache_manager import KVCacheManager


class EngineStats:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        # (mode, num_tokens_padded) -> steps run so (the engine counts: no call per step)
        self.steps: collections.Counter[tuple[CUDAGraphMode, int]] = collections.Counter()
        self.jit_variants_at_warmup = 0

    def warmed_up(self) -> None:
        self.jit_variants_at_warmup = KERNEL_VARIANTS.count()

    def as_dict(self, engine: Any) -> dict[str, Any]:
        graphs, sched = engine.runner.graphs, engine.scheduler
        s = {"kv_free_blocks": engine.kv.num_free_blocks,
             "kv_total_blocks": engine.kv.num_total_blocks,
             **kv_stats(engine.kv),
             "eager_steps": sum(n for (mode, _), n in self.steps.items()
                                if mode == CUDAGraphMode.NONE),
             "graphs_captured": len(graphs.records) if graphs is not None else 0,
             "graphs": (engine.graph_startup.builder.status()
                        if engine.graph_startup is not None
                        else {"live": [], "pending": [], "done": True}),
             "graph_replays": self._graph_replays(),
             "preemptions": self.counts["preemptions"],
             "num_running": len(sched.running),
             "num_waiting": len(sched.waiting),
             # kernel variants JIT-compiled after warm-up: 0 in a healthy serving run
             "triton_compiles_after_warmup":
                 KERNEL_VARIANTS.count() - self.jit_variants_at_warmup}
        draft = engine.proposer.graph_status() if engine.proposer is not None else None
        if draft is not None:
            s["graphs"]["draft"] = draft
        if engine.spec_stats is not None:
            s["spec"] = engine.spec_stats.as_dict()
        if engine.dp is not None:
            dp = engine.dp
            s["data_parallel"] = {"rank": dp.rank, "world_size": dp.world_size,
                                  **dp.stats.as_dict()}
        return s


    def _graph_replays(self) -> dict[str, int]:
        """"MODE:num_tokens_padded" -> steps that replayed a graph of that size."""
        replays: collections.Counter = collections.Counter()
        for (mode, num_tokens_padded), n in self.steps.items():
            if mode != CUDAGraphMode.NONE:
                replays[f"{mode.name}:{num_tokens_padded}"] += n
        return dict(replays)


def kv_stats(kv: KVCacheManager) -> dict[str, Any]:
    """Counts per KV cache group (every group has a pool of kv_total_blocks; free and
    used are those of the fullest group; kv_groups has each): cached-free blocks are
    among the free ones (they are evictable), so
    kv_free_blocks + kv_used_blocks == kv_total_blocks."""
    prefix = kv.prefix_stats
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
