"""Attention groups: layers of one KV cache group that can share a metadata builder."""

from __future__ import annotations

import dataclasses

import torch

from rung.core.attention_metadata import CommonAttentionMetadata, validate
from rung.core.kv_cache_spec import KVCacheSpec
from rung.kernels.attention import Attention
from rung.kernels.backend import AttentionBackend, AttentionMetadataBuilder


@dataclasses.dataclass(frozen=True)
class AttentionGroupKey:
    # NOTE: num_heads_q is part of the key: builders size scratch by query heads, so a
    # draft with 4 query heads must not share a builder with a target's 8 (failure class 2).
    backend: str
    kv_spec: KVCacheSpec
    num_heads_q: int


@dataclasses.dataclass
class AttentionGroup:
    key: AttentionGroupKey
    kv_group_id: int
    layer_names: list[str]
    builder: AttentionMetadataBuilder


def build_attention_groups(layers: dict[str, Attention], layer_kv_group: dict[str, int],
                           kv_specs: dict[int, KVCacheSpec], backend: type[AttentionBackend],
                           device: torch.device) -> list[AttentionGroup]:
    groups: dict[tuple[int, AttentionGroupKey], AttentionGroup] = {}
    for name, layer in layers.items():
        gid = layer_kv_group[name]
        key = AttentionGroupKey(backend.name, kv_specs[gid], layer.spec.num_heads)
        if (gid, key) not in groups:
            builder = backend.builder_cls(key.kv_spec, key.num_heads_q, device)
            groups[(gid, key)] = AttentionGroup(key, gid, [], builder)
        groups[(gid, key)].layer_names.append(name)
    return list(groups.values())


def build_layer_metadata(groups: list[AttentionGroup], commons: list[CommonAttentionMetadata],
                         check_values: bool) -> dict[str, object]:
    """Build each KV cache group's metadata once per attention group and map every layer
    to its group's metadata. ``check_values`` (debug mode) first holds every group's
    metadata to the descriptor contract (`validate`); production skips the check, as the
    backends check the shapes they rely on (`check_shape_contract`)."""
    if check_values:
        for common in commons:
            validate(common)
    per_layer: dict[str, object] = {}
    for group in groups:
        meta = group.builder.build(commons[group.kv_group_id])
        for name in group.layer_names:
            per_layer[name] = meta
    return per_layer
