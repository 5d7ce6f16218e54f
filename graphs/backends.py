"""Which capture backend a device gets: CUDA graphs, compiled CPU graphs, or emulation."""

from __future__ import annotations

import os
from typing import Callable

import torch

from rung.graphs.artifact_cache import ArtifactCache
from rung.graphs.capture import CudaGraphBackend, EmulatedGraphBackend
from rung.graphs.compiled import CompiledGraphBackend


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
                         artifact_cache: ArtifactCache | None = None
                         ) -> EmulatedGraphBackend | CudaGraphBackend:
    name = resolve_graph_backend(name, device)
    if name == "cuda":
        if device.type != "cuda":
            raise ValueError(f"graph_backend 'cuda' needs a CUDA device, got {device}")
        return CudaGraphBackend()
    if name == "emulated":
        return EmulatedGraphBackend(poison_hook)
    if name == "compiled":
        return CompiledGraphBackend(artifact_cache, poison_hook)
    raise ValueError(f"graph_backend {name!r} not in ('auto', 'cuda', 'emulated', 'compiled')")
