"""Torch reference attention over a paged KV cache: the oracle for every other backend.

Graph-safe: no host sync, and every shape is fixed by padded counts and
``metadata.max_seq_len`` (max_model_len under a FULL graph), so it is captured whole.
"""

from __future__ import annotations

import torch

from rung.core.attention_metadata import CommonAttentionMetadata
from rung.core.graph_mode import GraphSupport
from rung.kernels.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [num_tokens_padded, num_kv_heads, head_dim] to their slots.

    NOTE: slot -1 (pads) is redirected to slot 0 of the null block, which no request
    reads, so the write is skipped for every live block without a host sync.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping.clamp(min=0)
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


def token_positions(meta: CommonAttentionMetadata,
                    num_tokens_padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: request row [T] (clamped), absolute position [T], visible KV length [T].

    Pad tokens (beyond query_start_loc[-1]) see 0 keys.
    """
    qsl = meta.query_start_loc.long()
    rows = qsl.shape[0] - 1
    tok = torch.arange(num_tokens_padded, device=qsl.device)
    req = torch.searchsorted(qsl[1:], tok, right=True)
    valid = req < rows
    req = req.clamp(max=rows - 1)
    pos = meta.seq_lens.long()[req] - (qsl[req + 1] - tok)
    kv_len = torch.where(valid, pos + 1, torch.zeros_like(pos))
    return req, pos, kv_len


def paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor,
                        meta: CommonAttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
    """Causal attention of every query token over its request's cached KV.

    query [T, num_heads, head_dim] -> [T, num_heads, head_dim] fp32; pad tokens give 0.
    """
    num_tokens_padded, num_heads, head_dim = query.shape
    num_kv_heads = layer.num_kv_heads
    block_size = kv_cache.shape[2]
    req, pos, kv_len = token_positions(meta, num_tokens_padded)
    num_blocks_read = min(-(-meta.max_seq_len // block_size), meta.block_table.shape[1])
    blocks = meta.block_table[:, :num_blocks_read].long()[req]          # [T, nb]
    k = kv_cache[0][blocks].flatten(1, 2).float()                        # [T, L, kvh, hd]
    v = kv_cache[1][blocks].flatten(1, 2).float()
    # NOTE: query head h reads KV head h // (num_heads // num_kv_heads), as HF's repeat_kv;
    # grouped views instead of repeating K/V keep the reference cheap.
    q = query.float().view(num_tokens_padded, num_kv_heads, -1, head_dim)  # [T, kvh, g, hd]
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * layer.scale      # [T, kvh, g, L]
    if layer.logit_softcap:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    key_pos = torch.arange(k.shape[1], device=query.device)
    visible = key_pos[None, :] < kv_len[:, None]                         # [T, L]
    if layer.sliding_window is not None:
        visible &= key_pos[None, :] > (pos[:, None] - layer.sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)               # all-masked pads -> 0
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))                     # [T, kvh, g, hd]
    return out.reshape(num_tokens_padded, num_heads, head_dim)


class TorchAttentionImpl(AttentionImpl):
    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        write_kv(kv_cache, key, value, slot_mapping)

    def attend(self, query, kv_cache, metadata, output) -> None:
        output.copy_(paged_attention_ref(query, kv_cache, metadata, self.spec))


class TorchBackend(AttentionBackend):
    name = "TORCH"
    graph_support = GraphSupport.ALWAYS
    impl_cls = TorchAttentionImpl
