"""Torch reference attention over a paged KV cache: the oracle for every other backend.

Graph-safe: no host sync, and every shape is fixed by padded counts and
``metadata.max_seq_len`` (max_model_len under a FULL graph), so it is captured whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

    One in-place ``index_put_`` per K and V on the WHOLE cache tensor, never on a view:
    a compiler then updates the cache in place (on a view inductor copied the whole cache
    every step).
    NOTE: slot -1 (pads) is redirected to slot 0 of the null block, and what a pad writes
    there is that slot's own content: the write is masked, as Triton's store is, without
    a host sync. A pad row's key may be garbage (a PIECEWISE capture's piece outputs are
    never computed), and slot 0 is read, masked, by rows shorter than the gather width: a
    NaN there would survive SDPA's boolean mask.
    """
    block_size = kv_cache.shape[2]
    pad = (slot_mapping < 0)[:, None, None]                              # [T, 1, 1]
    slots = slot_mapping.clamp(min=0)
    block, offset = slots // block_size, slots % block_size               # [T] each
    k_half = torch.zeros((), dtype=torch.long, device=kv_cache.device)   # kv_cache[0] = K
    kv_cache.index_put_((k_half, block, offset),
                        torch.where(pad, kv_cache[0, 0, 0], key.to(kv_cache.dtype)))
    kv_cache.index_put_((k_half + 1, block, offset),
                        torch.where(pad, kv_cache[1, 0, 0], value.to(kv_cache.dtype)))


def is_decode_batch(meta: CommonAttentionMetadata, num_tokens_padded: int) -> bool:
    """One query token per block-table row: token t is row t's only query."""
    return meta.desc.uniform_query_len == 1 and meta.block_table.shape[0] == num_tokens_padded


def token_positions(meta: CommonAttentionMetadata,
                    num_tokens_padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: request row [T] (clamped), absolute position [T], visible KV length [T].

    Pad tokens (beyond query_start_loc[-1]) see 0 keys.
    """
    qsl = meta.query_start_loc.long()
    rows = qsl.shape[0] - 1
    if is_decode_batch(meta, num_tokens_padded):
        # decode: token t is row t's only query; pad rows have seq_len 0, so kv_len 0
        seq_lens = meta.seq_lens.long()
        req = torch.arange(rows, device=qsl.device)
        return req, (seq_lens - 1).clamp(min=0), seq_lens
    tok = torch.arange(num_tokens_padded, device=qsl.device)
    req = torch.searchsorted(qsl[1:], tok, right=True)
    valid = req < rows
    req = req.clamp(max=rows - 1)
    pos = meta.seq_lens.long()[req] - (qsl[req + 1] - tok)
    kv_len = torch.where(valid, pos + 1, torch.zeros_like(pos))
    return req, pos, kv_len


def visible_keys(kv_len: torch.Tensor, pos: torch.Tensor, num_keys: int,
                 layer: AttentionLayerSpec) -> torch.Tensor:
    """[T, num_keys] bool: key j is visible to a token at ``pos`` with ``kv_len`` keys."""
    key_pos = torch.arange(num_keys, device=kv_len.device)
    visible = key_pos[None, :] < kv_len[:, None]                         # [T, L]
    if layer.sliding_window is not None:
        visible &= key_pos[None, :] > (pos[:, None] - layer.sliding_window)
    return visible


def _num_blocks_read(meta: CommonAttentionMetadata, block_size: int) -> int:
    return min(-(-meta.max_seq_len // block_size), meta.block_table.shape[1])


def paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor,
                        meta: CommonAttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
    """Causal attention of every query token over its request's cached KV: the reference.

    query [T, num_heads, head_dim] -> [T, num_heads, head_dim] fp32; pad tokens give 0.
    """
    num_tokens_padded, num_heads, head_dim = query.shape
    num_kv_heads = layer.num_kv_heads
    req, pos, kv_len = token_positions(meta, num_tokens_padded)
    num_blocks_read = _num_blocks_read(meta, kv_cache.shape[2])
    blocks = meta.block_table[:, :num_blocks_read].long()[req]          # [T, nb]
    k = kv_cache[0][blocks].flatten(1, 2).float()                        # [T, L, kvh, hd]
    v = kv_cache[1][blocks].flatten(1, 2).float()
    # NOTE: query head h reads KV head h // (num_heads // num_kv_heads), as HF's repeat_kv;
    # grouped views instead of repeating K/V keep the reference cheap.
    q = query.float().view(num_tokens_padded, num_kv_heads, -1, head_dim)  # [T, kvh, g, hd]
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * layer.scale      # [T, kvh, g, L]
    if layer.logit_softcap:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    visible = visible_keys(kv_len, pos, k.shape[1], layer)              # [T, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)               # all-masked pads -> 0
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))                     # [T, kvh, g, hd]
    return out.reshape(num_tokens_padded, num_heads, head_dim)


# batch-invariant attention reads keys in multiples of this many (masked past the sequence)
INVARIANT_KEY_TILE = 256


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: CommonAttentionMetadata,
                    layer: AttentionLayerSpec) -> torch.Tensor:
    """The reference's result, faster in eager: K and V gathered once (one index_select),
    then SDPA on transposed views (no copy); softcapped layers take the reference path.

    query [T, num_heads, head_dim] -> [T, num_heads, head_dim] fp32; pad tokens give 0.
    """
    if layer.logit_softcap:
        return paged_attention_ref(query, kv_cache, meta, layer)
    if layer.batch_invariant:
        return _paged_attention_per_token(query, kv_cache, meta, layer)
    num_tokens_padded = query.shape[0]
    num_rows = meta.block_table.shape[0]
    # NOTE: per token, a prefill of T tokens would gather T copies of its K/V (O(T^2)
    # memory); per request, a batch pads every query to max_query_len. Decode (one token
    # per row) is the same either way; per request wins while the grid stays small.
    if meta.max_query_len > 1 and num_rows * meta.max_query_len <= 2 * num_tokens_padded:
        return _paged_attention_per_request(query, kv_cache, meta, layer)
    return _paged_attention_per_token(query, kv_cache, meta, layer)


def _gather_kv(kv_cache: torch.Tensor, meta: CommonAttentionMetadata,
               rows: torch.Tensor | None, invariant: bool = False) -> torch.Tensor:
    """K/V of the blocks ``meta.max_seq_len`` covers, for every block-table row (``rows``
    None) or for each entry of ``rows`` [N] -> [2, N, L, kvh, hd] fp32, one index_select."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks_read = _num_blocks_read(meta, block_size)
    if invariant:   # NOTE: a key count the batch cannot change, for SDPA's reductions
        tile = max(INVARIANT_KEY_TILE // block_size, 1)
        num_blocks_read = min(-(-num_blocks_read // tile) * tile, meta.block_table.shape[1])
    blocks = meta.block_table[:, :num_blocks_read].long()               # [R, nb]
    if rows is not None:
        blocks = blocks[rows]                                            # [N, nb]
    kv = kv_cache.index_select(1, blocks.flatten()).float()             # [2, N*nb, bs, kvh, hd]
    return kv.view(2, blocks.shape[0], num_blocks_read * block_size, num_kv_heads, head_dim)


def _paged_attention_per_token(query: torch.Tensor, kv_cache: torch.Tensor,
                               meta: CommonAttentionMetadata,
                               layer: AttentionLayerSpec) -> torch.Tensor:
    """Every token is one SDPA batch entry over its own copy of its request's K/V."""
    num_tokens_padded, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    req, pos, kv_len = token_positions(meta, num_tokens_padded)
    kv = _gather_kv(kv_cache, meta, req, layer.batch_invariant)        # [2, T, L, kvh, hd]
    visible = visible_keys(kv_len, pos, kv.shape[2], layer)            # [T, L]
    q = query.float().view(num_tokens_padded, num_kv_heads, -1, head_dim)  # [T, kvh, g, hd]
    # NOTE: the g query heads of one KV head are SDPA's query positions, so K/V are read
    # once per KV head; SDPA gives all-masked rows (pads) 0.
    out = F.scaled_dot_product_attention(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                         attn_mask=visible[:, None, None, :],
                                         scale=layer.scale)              # [T, kvh, g, hd]
    return out.reshape(num_tokens_padded, num_heads, head_dim)


def _paged_attention_per_request(query: torch.Tensor, kv_cache: torch.Tensor,
                                 meta: CommonAttentionMetadata,
                                 layer: AttentionLayerSpec) -> torch.Tensor:
    """Every request is one SDPA batch entry: K/V gathered once per request, its queries
    laid out on a [R, max_query_len] grid (grid cell (r, i) = query i of request r).

    E.g. query_start_loc [0, 3, 4], max_query_len 3, 5 padded tokens: tokens 0..3 go to
    cells 0, 1, 2, 3 of the flat grid, pad token 4 to the spare cell 6 past the grid.
    """
    num_tokens_padded, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    num_rows, max_query_len = meta.block_table.shape[0], meta.max_query_len
    grid = num_rows * max_query_len
    qsl = meta.query_start_loc.long()
    req, _, kv_len = token_positions(meta, num_tokens_padded)
    tok = torch.arange(num_tokens_padded, device=qsl.device)
    real = kv_len > 0                                                    # [T]; pads see 0 keys
    cell = torch.where(real, req * max_query_len + tok - qsl[req], grid)  # [T]
    q = query.new_zeros((grid + 1, num_heads, head_dim), dtype=torch.float32)
    q.index_copy_(0, cell, query.float())
    group = num_heads // num_kv_heads
    q = (q[:grid].view(num_rows, max_query_len, num_kv_heads, group, head_dim)
         .transpose(1, 2).reshape(num_rows, num_kv_heads, max_query_len * group, head_dim))
    kv = _gather_kv(kv_cache, meta, None)                                # [2, R, L, kvh, hd]
    visible = _grid_visible_keys(meta, qsl, kv.shape[2], layer)         # [R, Q, L]
    mask = visible[:, None, :, None, :].expand(-1, -1, -1, group, -1)   # [R, 1, Q, g, L]
    out = F.scaled_dot_product_attention(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                         attn_mask=mask.flatten(2, 3),
                                         scale=layer.scale)              # [R, kvh, Q*g, hd]
    out = (out.view(num_rows, num_kv_heads, max_query_len, group, head_dim)
           .transpose(1, 2).reshape(grid, num_heads, head_dim))
    out = out[cell.clamp(max=max(grid - 1, 0))]                          # [T, heads, hd]
    return torch.where(real[:, None, None], out, 0.0)


def _grid_visible_keys(meta: CommonAttentionMetadata, qsl: torch.Tensor, num_keys: int,
                       layer: AttentionLayerSpec) -> torch.Tensor:
    """[R, max_query_len, num_keys] bool: what query i of each request sees (the last
    query_len of its seq_len tokens); cells past a request's query_len see nothing."""
    query_lens = (qsl[1:] - qsl[:-1])[:, None]                          # [R, 1]
    i = torch.arange(meta.max_query_len, device=qsl.device)[None, :]    # [1, Q]
    pos = meta.seq_lens.long()[:, None] - query_lens + i                # [R, Q]
    kv_len = torch.where(i < query_lens, pos + 1, 0)
    visible = visible_keys(kv_len.flatten(), pos.flatten(), num_keys, layer)
    return visible.view(*pos.shape, num_keys)


def paged_attention_fusable(query: torch.Tensor, kv_cache: torch.Tensor,
                            meta: CommonAttentionMetadata,
                            layer: AttentionLayerSpec) -> torch.Tensor:
    """The reference's result as elementwise ops and reductions a compiler fuses: the
    block-table gather becomes an indirect load inside the score and output reductions,
    so no K/V copy is made. Eager, it is slow; inside a compiled graph, it is the fast one.
    It reads EVERY block of ``meta.block_table``: a compiled replay cuts the table to the
    batch's longest sequence, so the cost follows the real context.

    query [T, num_heads, head_dim] -> [T, num_heads, head_dim] fp32; pad tokens give 0.
    """
    num_tokens_padded, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    req, pos, kv_len = token_positions(meta, num_tokens_padded)
    num_keys = meta.block_table.shape[1] * block_size
    blocks = meta.block_table.long()[req]                               # [T, nb]
    k = kv_cache[0][blocks].reshape(num_tokens_padded, num_keys, num_kv_heads, 1, head_dim)
    v = kv_cache[1][blocks].reshape(num_tokens_padded, num_keys, num_kv_heads, 1, head_dim)
    q = query.float().view(num_tokens_padded, 1, num_kv_heads, -1, head_dim)  # [T,1,kvh,g,hd]
    scores = (q * k.float()).sum(-1) * layer.scale                       # [T, L, kvh, g]
    if layer.logit_softcap:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    visible = visible_keys(kv_len, pos, num_keys, layer)                # [T, L]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1).nan_to_num(0.0)                # all-masked pads -> 0
    out = (probs[..., None] * v.float()).sum(1)                         # [T, kvh, g, hd]
    return out.reshape(num_tokens_padded, num_heads, head_dim)


class TorchAttentionImpl(AttentionImpl):
    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        write_kv(kv_cache, key, value, slot_mapping)

    def attend(self, query, kv_cache, metadata, output) -> None:
        output.copy_(paged_attention(query, kv_cache, metadata, self.spec))


class TorchBackend(AttentionBackend):
    name = "TORCH"
    graph_support = GraphSupport.ALWAYS
    impl_cls = TorchAttentionImpl
