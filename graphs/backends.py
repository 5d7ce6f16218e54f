"""Which capture backend a device gets: CUDA graphs, compiled CPU graphs, or emulation (each
a `CaptureBackend`)."""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.capture import CaptureBackend, CudaGraphBackend, EmulatedGraphBackend
from rung.graphs.cpu_compiled.artifact_cache import ArtifactCache
from rung.graphs.cpu_compiled.capture_backend import CompiledGraphBackend

logger = logging.getLogger(__name__)


def resolve_graph_backend(name: str, device: torch.device) -> str:
    """"auto": CUDA graphs on CUDA; on CPU compiled graphs, unless RUNG_GRAPH_BACKEND names
    another (the test suite sets "emulated": its poisoned replays are the padding oracle)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "cuda"
    return os.environ.get("RUNG_GRAPH_BACKEND", "compiled")


def make_capture_backend(name: str, device: torch.device,
                         poison_hook: Callable[[], None] | None,
                         artifact_cache: ArtifactCache | None = None,
                         compile_threads: int | None = None
                         ) -> CaptureBackend:
    name = resolve_graph_backend(name, device)
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError(f"graph_backend 'cuda' needs a CUDA device, got {device}")
        return CudaGraphBackend(poison_hook=poison_hook)
    if name == "emulated":
        return EmulatedGraphBackend(poison_hook)
    if name == "compiled":
        if device.type != "cpu":
            # NOTE: its replay reads host values (the longest seq_len) every step: a
            # device sync per replay on a GPU, where CUDA graphs serve instead
            raise ValueError(f"graph_backend 'compiled' is for CPU graphs, got device "
                             f"{device}: use graph_backend 'cuda' (or 'auto') there")
        return CompiledGraphBackend(artifact_cache, poison_hook, compile_threads)
    raise ValueError(f"graph_backend {name!r} not in ('auto', 'cuda', 'emulated', 'compiled')")


def without_cpu_pieces(mode: CUDAGraphMode) -> CUDAGraphMode:
    """The mode without PIECEWISE graphs, for compiled CPU graphs whose pieces would run
    uncompiled: such a replay is the eager ops plus a copy into static outputs, SLOWER than
    eager (docs/performance.md), and costs a dynamo trace of the whole model."""
    new = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full() else CUDAGraphMode.NONE
    logger.info("compiled CPU graphs: cudagraph_mode %s runs as %s (PIECEWISE pieces would "
                "run uncompiled, slower than eager; compilation_config backend='inductor' "
                "compiles them)", mode.name, new.name)
    return new
