"""Building an engine's parts: the target model, the proposer, and the graphs it captures."""

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from rung.graphs.backends import resolve_graph_backend
from rung.graphs.builder import GraphBuilder
from rung.graphs.cpu_compiled.artifact_cache import (
    ArtifactCache,
    default_cache_dir,
    holds_loadable_build,
    prepare_inductor,
)
from rung.graphs.ladder import capture_sizes
from rung.graphs.manager import TARGET, CaptureRecord, GraphManager
from rung.kernels.batch_invariant import make_batch_invariant
from rung.models.loader import LoadedModel, load_model
from rung.models.registry import DraftModel
from rung.runtime.config import EngineConfig
from rung.runtime.engine.prefetch import start_prefetch
from rung.runtime.spec.mtp import MtpProposer
from rung.runtime.spec.ngram import NgramProposer
from rung.runtime.spec.proposer import Proposer
from rung.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_target(config: EngineConfig) -> tuple[LoadedModel, int]:
    """The model to serve and its max_model_len (ValueError for a drafter or a length
    above the model's own)."""
    # NOTE: a blocking start that will compile prepares inductor while the model loads (its
    # imports, vector-ISA pick and torch_key: a large share of a cold compile otherwise); a
    # warm one loads every artifact as its wrapper library, without inductor, and a thread
    # importing it beside the load would only fight the main thread for the GIL. A
    # background start prepares it once an artifact is built (GraphBuilder).
    cache_dir = _cache_dir(config)
    if config.compilation.graph_startup == "blocking" and not config.enforce_eager and \
            resolve_graph_backend(config.compilation.graph_backend,
                                  torch.device(config.device)) == "compiled" and \
            (cache_dir is None or not holds_loadable_build(cache_dir, str(config.model))):
        prepare_inductor()
    loaded = load_model(config.model, config.dtype, str(config.device), config.load_format,
                        quantization=config.quantization, cache_dir=cache_dir)
    if config.batch_invariant:
        make_batch_invariant(loaded.model)
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


def _artifact_cache(runner: ModelRunner, config: EngineConfig) -> ArtifactCache | None:
    """The disk cache of compiled graphs, or None when compilation_config turns it off."""
    root = _cache_dir(config)
    if root is None:
        return None
    model = runner.model
    return ArtifactCache(root, {"model_class": type(model).__name__, "dtype": str(config.dtype),
                                "model_config": getattr(model, "config", None)},
                         origin=str(config.model))


def _cache_dir(config: EngineConfig) -> Path | None:
    """rung's disk cache (compiled graphs, a GGUF file's dequantized weights):
    ``compilation_config.cache_dir``, its default when None, none when ""."""
    root = config.compilation.cache_dir
    if root == "":
        return None
    return Path(root) if root else default_cache_dir()




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
    cache = _artifact_cache(runner, config) if compiled else None
    _warn_if_batches_run_eagerly(sizes, config)
    graphs = GraphManager(runner, comp.cudagraph_mode, sizes, 1 + config.num_spec_tokens,
                          comp.backend, comp.graph_backend, config.debug_padding, cache,
                          comp.compile_threads)
    graphs.per_layer = comp.per_layer_graphs
    return graphs


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


class GraphStartup:
    """The engine's graphs going live: all before serving ("blocking"), or one at a time
    between steps while eager serves ("background"), with a progress bar on stderr."""

    def __init__(self, runner: ModelRunner, proposer: Proposer | None, config: EngineConfig,
                 capture_progress: Callable[[CaptureRecord], None] | None,
                 data_parallel: bool, max_model_len: int) -> None:
        graphs = make_graph_manager(runner, config)
        runner.use_graphs(graphs)
        sizes = graphs.dispatcher.sizes
        logger.info("cudagraph mode %s, %s graphs: %d capture sizes %s", graphs.mode.name,
                    graphs.capture_backend.name, len(sizes), _short(sizes))
        total = graphs.num_graphs_to_capture
        self.bar = tqdm(total=total, desc="Graphs live", unit="graph", leave=False,
                        file=sys.stderr,
                        disable=total == 0 or not logger.isEnabledFor(logging.INFO))

        def progress(record: CaptureRecord) -> None:
            self.bar.update(1)
            if capture_progress is not None:
                capture_progress(record)

        after = None
        if proposer is not None:
            after = functools.partial(proposer.capture_all, graphs, progress)
        startup = config.compilation.graph_startup
        if startup == "auto":
            # NOTE: data parallel ranks must agree on the graphs they replay
            startup = "blocking" if data_parallel else graphs.capture_backend.auto_startup
        prefetch = None
        # NOTE: no subprocess when the disk cache holds every artifact already (a warm
        # start): it would build a whole engine beside the serving one to compile nothing.
        # The first size missing one ends the look (a cold start pays one key).
        if startup == "background" and getattr(graphs.capture_backend, "cache", None) is not None \
                and not all(map(graphs.is_ready, graphs.dispatcher.capture_descriptors())):
            prefetch = start_prefetch(config, max_model_len, graphs.capture_backend.threads,
                                      graphs.capture_backend.cache.root)
        # NOTE: a blocking start serves nothing before every graph is live: CUDA captures
        # run largest first there, so smaller sizes reuse the pool blocks larger ones freed
        self.builder = GraphBuilder(graphs, after, progress, prefetch,
                                    off_thread=startup == "background",
                                    largest_first=startup == "blocking" and
                                    graphs.capture_backend.serving_thread_captures)
        # NOTE: a plain flag, read before every step: once all is live, a step pays one
        # attribute read here, no call into the builder
        self.all_live = self.builder.done
        if startup == "background":
            logger.info("serving eagerly from the first step; %d graphs go live as they are "
                        "built (%s); llm.wait_for_graphs() waits for them", total,
                        "compiling in a subprocess" if prefetch else "built off the "
                        "serving thread" if self.builder.off_thread else "between steps")
            return
        start = time.perf_counter()
        self.wait()
        _log_captured(graphs, time.perf_counter() - start)

    def wait(self, timeout: float | None = None) -> bool:
        """Bring every graph live now (at most ``timeout`` seconds); True when all are."""
        done = self.builder.wait(timeout)
        if done:
            self.all_live = True
            self.bar.close()
        return done

    def detach_compile(self) -> int | None:
        """Let a running background compile outlive this process: its pid, or None."""
        prefetch = self.builder.prefetch
        return prefetch.detach() if prefetch is not None else None

    def advance(self, stepping: bool = True) -> None:
        """Between two steps (``stepping``: a step follows, else an idle engine's tick): at
        most one more graph goes live (see GraphBuilder)."""
        if not self.all_live:
            self.builder.advance(stepping=stepping)
            if self.builder.done:
                self.all_live = True
                self.bar.close()


def _log_captured(graphs: GraphManager, seconds: float) -> None:
    draft = [r for r in graphs.records if r.graph != TARGET]
    logger.info("captured %d graphs%s in %.1f s (one-time tracing %.1f s), %.1f MiB",
                len(graphs.records) - len(draft),
                f" + {len(draft)} draft graphs" if draft else "",
                seconds, graphs.trace_seconds, graphs.pool_bytes / 2**20)


def _short(sizes: list[int]) -> str:
    """[1, 2, 4, 8, 16, 24, 32] -> '[1, 2, 4, ..., 24, 32]' past 8 sizes."""
    if len(sizes) <= 8:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:3]))}, ..., {', '.join(map(str, sizes[-2:]))}]"
