"""Triton attention backend: Triton KV write + one paged-attention kernel for every batch.

Graph support is ALWAYS: both kernels size their grids from padded counts and find each
program's request on the device, so a FULL graph of any batch replays correctly.
"""

from __future__ import annotations

import os

import torch

from rung.core.attention_metadata import CommonAttentionMetadata
from rung.core.graph_mode import GraphSupport
from rung.core.kv_cache_spec import KVCacheSpec
from rung.kernels.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
)
from rung.kernels.selector import register_backend

try:
    from rung.kernels.triton.kv_write import _kv_write_kernel, kv_write
    from rung.kernels.triton.paged_attention import paged_attention
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # triton missing or broken: the backend reports why
    _IMPORT_ERROR = str(exc)

MAX_HEAD_DIM = 512


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_kv_write_kernel, InterpretedFunction)


class TritonAttentionImpl(AttentionImpl):
    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kv_write(kv_cache, key, value, slot_mapping)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: CommonAttentionMetadata, output: torch.Tensor) -> None:
        paged_attention(query, kv_cache, output, metadata.query_start_loc, metadata.seq_lens,
                        metadata.block_table, metadata.max_query_len, self.spec.scale,
                        self.spec.sliding_window, self.spec.logit_softcap)


class TritonBackend(AttentionBackend):
    name = "TRITON"
    graph_support = GraphSupport.ALWAYS
    impl_cls = TritonAttentionImpl

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if _IMPORT_ERROR is not None:
            return False, f"triton is not importable ({_IMPORT_ERROR})"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "CUDA is not available"
            return True, ""
        if device.type != "cpu":
            return False, f"TRITON runs on CUDA, or on CPU under its interpreter; got {device}"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return False, "TRITON on CPU needs the Triton interpreter: set TRITON_INTERPRET=1"
        if not _interpreted():
            return False, ("TRITON_INTERPRET=1 was set after rung.kernels.triton was imported; "
                           "set it before the first import")
        return True, ""

    @classmethod
    def validate_layer(cls, layer: AttentionLayerSpec, kv_spec: KVCacheSpec) -> None:
        if not 1 <= layer.head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"TRITON attention supports head_dim 1..{MAX_HEAD_DIM}, "
                             f"got {layer.head_dim}")
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(f"num_heads {layer.num_heads} is not a multiple of "
                             f"num_kv_heads {layer.num_kv_heads}")
        if (kv_spec.head_dim, kv_spec.num_kv_heads) != (layer.head_dim, layer.num_kv_heads):
            raise ValueError(f"KV cache spec ({kv_spec.num_kv_heads} heads x {kv_spec.head_dim}) "
                             f"does not match the layer ({layer.num_kv_heads} x {layer.head_dim})")
        if layer.sliding_window is not None and layer.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {layer.sliding_window}")


register_backend(TritonBackend)
