"""KV cache specs and groups: which layers share a block table."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's paged KV cache. Layers with equal specs share a KV cache group."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None   # attend to the last `sliding_window` positions

    @property
    def page_size_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one spec, one block pool and one block table."""

    group_id: int
    spec: KVCacheSpec
    layer_names: tuple[str, ...]


def group_layers_by_spec(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """One KV cache group per distinct spec, in order of first appearance."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    return [KVCacheGroup(i, spec, tuple(names)) for i, (spec, names) in enumerate(by_spec.items())]
