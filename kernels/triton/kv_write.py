"""Triton kernel: scatter new key/value rows into the paged KV cache at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rung.core.errors import ContractError
from rung.kernels.triton.variants import KERNEL_VARIANTS


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cx, stride_cb, stride_cs, stride_ch, stride_cd,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    # One program per token: all heads x head_dim of its key and value.
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    slot = tl.load(slot_ptr + tok + heads * 0)[:, None]    # [HEADS_P, 1], one slot per token
    # NOTE: slot < 0 masks every store, so pad tokens leave the cache truly untouched.
    mask = (slot >= 0) & (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh
                + dims[None, :] * stride_kd, mask=mask)               # [HEADS_P, HEAD_DIM_P]
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh
                + dims[None, :] * stride_vd, mask=mask)
    safe_slot = tl.maximum(slot, 0)
    dst = (cache_ptr + (safe_slot // block_size) * stride_cb + (safe_slot % block_size) * stride_cs
           + heads[:, None] * stride_ch + dims[None, :] * stride_cd)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cx, v.to(cache_ptr.dtype.element_ty), mask=mask)


def kv_write(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens_padded, num_kv_heads, head_dim] into
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping
    [num_tokens_padded] int64 (slot = block_id * block_size + offset, -1 skips).

    Graph-safe: the grid is the padded token count; no host sync.
    """
    num_tokens_padded, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ContractError(f"value {tuple(value.shape)} != key {tuple(key.shape)}")
    if kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ContractError(f"kv_cache {tuple(kv_cache.shape)} does not hold {num_kv_heads} "
                            f"heads x {head_dim}")
    if slot_mapping.shape != (num_tokens_padded,):
        raise ContractError(f"slot_mapping {tuple(slot_mapping.shape)} != tokens "
                            f"{num_tokens_padded}")
    if num_tokens_padded == 0:
        return
    args = (key, value, kv_cache, slot_mapping, *key.stride(), *value.stride(),
            *kv_cache.stride(), kv_cache.shape[2])
    constexprs = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                      HEADS_P=triton.next_power_of_2(num_kv_heads),
                      HEAD_DIM_P=triton.next_power_of_2(head_dim))
    if _interpreted():
        KERNEL_VARIANTS.note_launch("kv_write", args, constexprs)
    _kv_write_kernel[(num_tokens_padded,)](*args, **constexprs)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_kv_write_kernel, InterpretedFunction)


KERNEL_VARIANTS.register("kv_write", _kv_write_kernel)
