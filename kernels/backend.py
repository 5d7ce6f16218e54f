"""Attention backend interface: every backend reads CommonAttentionMetadata."""

from __future__ import annotations

import dataclasses
import math
import mmap
from typing import Any, ClassVar

import torch

from rung.core.attention_metadata import AttentionMetadata, CommonAttentionMetadata
from rung.core.errors import ContractError
from rung.core.graph_mode import GraphSupport
from rung.core.kv_cache_spec import KVCacheSpec


@dataclasses.dataclass(frozen=True)
class AttentionLayerSpec:
    """Per-layer constants an attention impl needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    writes_kv: bool = True          # False for layers reading another layer's KV (MTP drafters)
    # every query over the same padded key count on one path (kernels/batch_invariant.py)
    batch_invariant: bool = False


class AttentionMetadataBuilder:
    """Builds backend metadata for one attention group.

    One builder per ``AttentionGroupKey(backend, kv_spec, num_heads_q)``, because builders
    may size scratch space by the number of query heads.
    """

    def __init__(self, kv_spec: KVCacheSpec, num_heads_q: int, device: torch.device) -> None:
        self.kv_spec = kv_spec
        self.num_heads_q = num_heads_q
        self.device = device

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return common


class AttentionImpl:
    def __init__(self, spec: AttentionLayerSpec) -> None:
        self.spec = spec

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        """query/output [num_tokens_padded, num_heads, head_dim]; key/value
        [num_tokens_padded, num_kv_heads, head_dim]; kv_cache
        [2, num_blocks, block_size, num_kv_heads, head_dim]. Writes KV then attends."""
        check_shape_contract(metadata, query.shape[0])
        if self.spec.writes_kv:
            self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        self.attend(query, kv_cache, metadata, output)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter key/value to their slots; slot -1 (pads) writes no live block."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
               output: torch.Tensor) -> None:
        """Paged causal attention into ``output``; pad tokens get zeros."""
        raise NotImplementedError


class AttentionBackend:
    name: ClassVar[str]
    graph_support: ClassVar[GraphSupport]
    impl_cls: ClassVar[type[AttentionImpl]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]] = AttentionMetadataBuilder

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """(available, reason when not)."""
        return True, ""

    @classmethod
    def validate_layer(cls, layer: AttentionLayerSpec, kv_spec: KVCacheSpec) -> None:
        """Raise ValueError for a layer this backend cannot run."""


def check_shape_contract(metadata: CommonAttentionMetadata, num_tokens_padded: int) -> None:
    """The shape contract FlashAttention enforces, checked by every backend so CPU tests
    catch failure class 1 ("batch_size must be equal to batch_size_k")."""
    if metadata.block_table.shape[0] != metadata.query_start_loc.shape[0] - 1:
        raise ContractError(f"batch_size must be equal to batch_size_k: block_table has "
                            f"{metadata.block_table.shape[0]} rows, query_start_loc "
                            f"{metadata.query_start_loc.shape[0] - 1}")
    if metadata.slot_mapping.shape[0] != num_tokens_padded:
        raise ContractError(f"slot_mapping {metadata.slot_mapping.shape[0]} != tokens "
                            f"{num_tokens_padded}")


def kv_cache_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
    # NOTE: block 0 is the null block: never allocated to a request; pad rows point at it.
    return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device | str
                      ) -> torch.Tensor:
    """A zeroed KV cache of ``kv_cache_shape``.

    NOTE: on CPU it is an anonymous memory map, which the OS fills with zero pages as they
    are first touched; torch.zeros writes every byte up front (seconds of every start for
    a default max_model_len) and keeps it all resident from the start.
    """
    shape = kv_cache_shape(spec, num_blocks)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=spec.dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=spec.dtype)
    pages = mmap.mmap(-1, count * spec.dtype.itemsize)   # NOTE: the tensor keeps it alive
    return torch.frombuffer(pages, dtype=spec.dtype, count=count).view(shape)
