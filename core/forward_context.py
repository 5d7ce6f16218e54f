"""The one scoped global: what attention ops read inside a compiled forward."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.errors import ContractError


@dataclasses.dataclass
class ForwardContext:
    desc: BatchExecutionDescriptor
    attn_metadata: dict[str, Any]     # layer name -> metadata of its attention group
    layers: dict[str, torch.nn.Module]   # layer name -> bound Attention module
    # True while a compiled CPU graph is traced: attention runs as torch ops the compiler
    # fuses, instead of the opaque op that piecewise graphs split at.
    inline_attention: bool = False
    # the target's CommonAttentionMetadata, one per KV cache group (what a FULL graph reads)
    commons: list[Any] = dataclasses.field(default_factory=list)


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise ContractError("attention called outside `with forward_context(...)`")
    return _current


def current_descriptor() -> BatchExecutionDescriptor | None:
    return None if _current is None else _current.desc
