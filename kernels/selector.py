"""Attention backend registry and selection."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rung.kernels.backend import AttentionBackend
from rung.kernels.torch_backend import TorchBackend

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, type[AttentionBackend]] = {"TORCH": TorchBackend}


def register_backend(backend: type[AttentionBackend]) -> None:
    _BACKENDS[backend.name] = backend


def _known() -> dict[str, type[AttentionBackend]]:
    # Optional backends register themselves on import.
    for module in ("rung.kernels.triton_backend", "rung.kernels.flash_attn_backend"):
        try:
            __import__(module)
        except ImportError:
            pass
    return _BACKENDS


def _why_not(backend: type[AttentionBackend] | None, device: torch.device,
             accepts: Callable[[type[AttentionBackend]], None] | None) -> str | None:
    """Why ``backend`` cannot run this model on ``device``, or None when it can."""
    if backend is None:
        return "not installed"
    ok, why = backend.is_available(device)
    if not ok:
        return why
    try:
        if accepts is not None:
            accepts(backend)
    except ValueError as e:
        return str(e)
    return None


def select_backend(name: str, device: torch.device,
                   accepts: Callable[[type[AttentionBackend]], None] | None = None
                   ) -> type[AttentionBackend]:
    """`auto`: CUDA + flash-attn -> FLASH_ATTN, CUDA -> TRITON, CPU -> TORCH, skipping a
    backend that ``accepts`` rejects (ValueError) for this model and config, e.g. a page
    size flash-attn cannot take."""
    key = name.upper()
    auto_order = ["FLASH_ATTN", "TRITON", "TORCH"] if device.type == "cuda" else ["TORCH"]
    # NOTE: the optional backends are imported only when one may be picked: importing
    # Triton costs a CPU engine's start-up time it never uses
    torch_only = key == "TORCH" or (key == "AUTO" and auto_order == ["TORCH"])
    backends = _BACKENDS if torch_only else _known()
    if key == "AUTO":
        order = auto_order
        for candidate in order:
            why_not = _why_not(backends.get(candidate), device, accepts)
            if why_not is None:
                logger.info("attention backend: %s (auto on %s)", candidate, device)
                return backends[candidate]
            logger.info("attention backend %s skipped: %s", candidate, why_not)
        logger.info("attention backend: TORCH (auto on %s, the fallback)", device)
        return TorchBackend
    if key not in backends:
        raise ValueError(f"unknown attention_backend {name!r}; expected auto or one of "
                         f"{', '.join(sorted(b.lower() for b in backends))}")
    ok, why = backends[key].is_available(device)
    if not ok:
        raise ValueError(f"attention_backend {name!r} is unavailable on {device}: {why}")
    return backends[key]
