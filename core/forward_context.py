"""The one scoped global: what attention ops read inside a compiled forward.

NOTE: one per thread: a graph is built and checked against eager on a worker thread
while the serving thread runs steps, each forward in its own context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
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


class _Current(threading.local):
    ctx: ForwardContext | None = None


_current = _Current()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    prev, _current.ctx = _current.ctx, ctx
    try:
        yield ctx
    finally:
        _current.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = _current.ctx
    if ctx is None:
        raise ContractError("attention called outside `with forward_context(...)`")
    return ctx


def current_descriptor() -> BatchExecutionDescriptor | None:
    ctx = _current.ctx
    return None if ctx is None else ctx.desc
