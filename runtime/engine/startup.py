"""Building an engine's parts: the target model, the proposer, and the graphs it captures."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from tqdm import tqdm

from rung.graphs.capture import resolve_graph_backend
from rung.graphs.ladder import capture_sizes
from rung.graphs.manager import TARGET, CaptureRecord, GraphManager, artifact_cache
from rung.models.loader import LoadedModel, load_model
from rung.models.registry import DraftModel
from rung.runtime.config import EngineConfig
from rung.runtime.spec.mtp import MtpProposer
from rung.runtime.spec.ngram import NgramProposer
from rung.runtime.spec.proposer import Proposer
from rung.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_target(config: EngineConfig) -> tuple[LoadedModel, int]:
    """The model to serve and its max_model_len (ValueError for a drafter or a length
    above the model's own)."""
    loaded = load_model(config.model, config.dtype, str(config.device), config.load_format,
                        quantization=config.quantization)
    if isinstance(loaded.model, DraftModel):
        raise ValueError(f"model {config.model!r} is an MTP drafter, not a model to serve: "
                         "pass it as speculative_config={'method': 'mtp', 'model': "
                         f"{config.model!r}, ...}} next to a Gemma 4 target")
    model_max = int(loaded.config.get("max_position_embeddings", 2048))
    max_model_len = config.max_model_len if config.max_model_len is not None else model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={model_max}")
    return loaded, max_model_len


def make_proposer(config: EngineConfig, runner: ModelRunner) -> Proposer:
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    return MtpProposer.build(config, runner)


def log_setup(config: EngineConfig, loaded: LoadedModel, runner: ModelRunner,
              max_model_len: int) -> None:
    weights = "random weights" if loaded.random_weights else "weights loaded"
    logger.info("model %s (%s, %s): %s on %s, max_model_len %d, max_num_seqs %d",
                config.model, loaded.config.get("model_type"), weights,
                str(config.dtype).removeprefix("torch."), config.device, max_model_len,
                config.max_num_seqs)
    kv_bytes = sum(t.nbytes for t in {id(t): t for t in runner.kv_caches.values()}.values())
    logger.info("attention backend %s; KV cache: %d blocks of %d tokens in %d group(s), "
                "%.1f MiB", runner.backend.name, runner.num_blocks, config.block_size,
                len(runner.kv_groups), kv_bytes / 2**20)


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


def capture_graphs(runner: ModelRunner, proposer: Proposer | None, config: EngineConfig,
                   capture_progress: Callable[[CaptureRecord], None] | None) -> None:
    """Capture the target's graphs and the proposer's, with a progress bar on stderr."""
    graphs = make_graph_manager(runner, config)
    runner.use_graphs(graphs)
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
        if proposer is not None:
            proposer.capture_all(graphs, progress)
    finally:
        bar.close()
    draft = [r for r in graphs.records if r.graph != TARGET]
    logger.info("captured %d graphs%s in %.1f s (one-time tracing %.1f s), %.1f MiB",
                len(graphs.records) - len(draft),
                f" + {len(draft)} draft graphs" if draft else "",
                time.perf_counter() - start, graphs.trace_seconds, graphs.pool_bytes / 2**20)


def _short(sizes: list[int]) -> str:
    """[1, 2, 4, 8, 16, 24, 32] -> '[1, 2, 4, ..., 24, 32]' past 8 sizes."""
    if len(sizes) <= 8:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:3]))}, ..., {', '.join(map(str, sizes[-2:]))}]"
