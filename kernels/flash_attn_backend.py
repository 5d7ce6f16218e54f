"""FlashAttention-2 backend: ``flash_attn_varlen_func`` over the paged cache (``block_table=``).

flash_attn is imported lazily, so this module imports on machines without it or CUDA.
KV is written by rung's Triton ``kv_write`` kernel (flash-attn 2 has no standalone one).

Graph support is UNIFORM_BATCH: flash-attn 2 takes ``max_seqlen_q`` as a host int that
sizes its grid and picks its decode path (GQA heads folded into the query tile when
``max_seqlen_q == 1``). A uniform batch fixes it to ``uniform_query_len`` at capture, so
every replay agrees; a mixed batch's longest query changes from step to step, and a FULL
graph captured with one value would silently skip query tiles of a longer one.
"""

from __future__ import annotations

from collections.abc import Callable

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

# NOTE: flash-attn 2's varlen_fwd checks `page_block_size % 256 == 0` for paged KV,
# `head_size <= 256` and `head_size % 8 == 0` (its Python wrapper pads other head sizes,
# which would copy the whole cache), and accepts fp16 / bf16 only.
PAGE_BLOCK_MULTIPLE = 256
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
DTYPES = (torch.float16, torch.bfloat16)


def _varlen_func() -> Callable[..., torch.Tensor]:
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def _flash_attn_import_error() -> str | None:
    try:
        _varlen_func()
    except (ImportError, OSError) as exc:   # missing, or built against another torch / CUDA
        return str(exc)
    return None


class FlashAttnImpl(AttentionImpl):
    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        from rung.kernels.triton.kv_write import kv_write
        kv_write(kv_cache, key, value, slot_mapping)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: CommonAttentionMetadata, output: torch.Tensor) -> None:
        out = self._attend(query, kv_cache, metadata)            # [num_tokens_padded, h, hd]
        # NOTE: flash-attn leaves tokens past query_start_loc[-1] unwritten; pads get 0.
        num_tokens_padded = query.shape[0]
        real = (torch.arange(num_tokens_padded, device=query.device)
                < metadata.query_start_loc[-1])                  # [num_tokens_padded]
        output.copy_(torch.where(real[:, None, None], out, 0.0))

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
                meta: CommonAttentionMetadata) -> torch.Tensor:
        s = self.spec
        num_reqs_padded = meta.seq_lens.shape[0]
        cu_seqlens_k = torch.zeros(num_reqs_padded + 1, dtype=torch.int32,
                                   device=query.device)          # [num_reqs_padded + 1]
        torch.cumsum(meta.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        # NOTE: with max_seqlen_q == 1 flash-attn reshapes q to [num_reqs_padded, ...], which
        # needs one token per row; pass the bound 2 when tokens are padded beyond rows.
        max_seqlen_q = meta.max_query_len
        if max_seqlen_q <= 1 and query.shape[0] != num_reqs_padded:
            max_seqlen_q = 2
        window = (s.sliding_window - 1, 0) if s.sliding_window is not None else (-1, -1)
        return _varlen_func()(
            query, kv_cache[0], kv_cache[1],
            cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=meta.max_seq_len,
            softmax_scale=s.scale, causal=True, window_size=window,
            softcap=s.logit_softcap or 0.0, block_table=meta.block_table)


class FlashAttnBackend(AttentionBackend):
    name = "FLASH_ATTN"
    graph_support = GraphSupport.UNIFORM_BATCH
    impl_cls = FlashAttnImpl

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        missing = []
        if device.type != "cuda":
            missing.append(f"a CUDA device (got {device})")
        elif not torch.cuda.is_available():
            missing.append("CUDA (torch.cuda.is_available() is False)")
        error = _flash_attn_import_error()
        if error is not None:
            missing.append(f"the flash_attn package ({error})")
        if missing:
            return False, "FLASH_ATTN needs " + " and ".join(missing)
        return True, ""

    @classmethod
    def validate_layer(cls, layer: AttentionLayerSpec, kv_spec: KVCacheSpec) -> None:
        if kv_spec.block_size % PAGE_BLOCK_MULTIPLE:
            raise ValueError(f"FLASH_ATTN (flash-attn 2 paged KV) needs block_size divisible "
                             f"by {PAGE_BLOCK_MULTIPLE}, got {kv_spec.block_size}")
        if layer.head_dim > MAX_HEAD_DIM or layer.head_dim % HEAD_DIM_MULTIPLE:
            raise ValueError(f"FLASH_ATTN supports head_dim <= {MAX_HEAD_DIM} and a multiple "
                             f"of {HEAD_DIM_MULTIPLE}, got {layer.head_dim}")
        if kv_spec.dtype not in DTYPES:
            raise ValueError(f"FLASH_ATTN supports float16 / bfloat16 KV caches, "
                             f"got {kv_spec.dtype}")
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(f"num_heads {layer.num_heads} is not a multiple of "
                             f"num_kv_heads {layer.num_kv_heads}")
        if layer.sliding_window is not None and layer.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {layer.sliding_window}")


register_backend(FlashAttnBackend)
