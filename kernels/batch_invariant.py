"""Batch-invariant linear layers: every row of ``x @ W^T`` comes from a GEMM of one fixed
shape, so a row's value does not depend on how many rows share its batch.

A BLAS picks its kernel and blocking by the row count (a GEMV at 1 row, other micro-kernels
and K splits past it), so the same request's logits round differently alone and in a batch
of 24. Here the rows are padded to a multiple of ``ROW_TILE`` and run as a batched GEMM of
``ROW_TILE``-row tiles against the one weight (broadcast, never copied): each tile is the
same problem, whatever the batch. The price is the padding and the tiles' separate passes
over the weight (docs/performance.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from rung.kernels.attention import Attention

# NOTE: a multiple of the usual GEMM micro-kernel heights (4, 6, 8), so every row of a tile
# sits where it would in any other tile; tile offsets stay 64-byte aligned for K % 2 == 0
ROW_TILE = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x [..., K], weight [N, K]) with rows independent of
    the batch."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    num_rows = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, (-num_rows) % ROW_TILE))        # [num_tiles * T, K]
    tiles = padded.view(-1, ROW_TILE, k)                             # [num_tiles, T, K]
    out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], k, weight.shape[0]))
    out = out.view(-1, weight.shape[0])[:num_rows]
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


class _BatchInvariant:
    """Mixed into an ``nn.Linear`` class (see `make_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


_CLASSES: dict[type, type] = {}


def make_batch_invariant(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` (subclasses included; quantized layers are not
    ``nn.Linear``) computes through `linear`, and every attention layer reads keys on one
    path in a padded count (kernels/torch_backend.py); returns how many linears changed.
    Call it before the attention layers are bound to a backend."""
    changed = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.spec = dataclasses.replace(module.spec, batch_invariant=True)
        cls = type(module)
        if not isinstance(module, nn.Linear) or issubclass(cls, _BatchInvariant):
            continue
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"BatchInvariant{cls.__name__}", (_BatchInvariant, cls), {})
        module.__class__ = _CLASSES[cls]
        changed += 1
    return changed


def is_batch_invariant(module: nn.Module) -> bool:
    return isinstance(module, _BatchInvariant)
