"""Triton kernel: causal paged attention for decode, spec verify and (chunked) prefill.

One kernel serves every batch shape. A program owns a tile of ``BLOCK_Q`` consecutive
query tokens of ONE request times the ``GROUP`` query heads that share one KV head, and
streams that request's KV pages through an online softmax. Query tokens are the LAST
``q_len`` positions of a sequence of ``seq_len`` tokens.

Graph-safe: the grid is sized from padded counts only (``num_tokens_padded``,
``num_reqs_padded``); which request a program serves, and how many keys it reads, is
found on the device. Programs past the last request tile zero the pad tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rung.core.errors import ContractError
from rung.kernels.triton.variants import KERNEL_VARIANTS


@triton.jit
def _tanh(x):
    # NOTE: built from exp so the kernel runs unchanged under the interpreter.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _find_request(qsl_ptr, pid, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                  num_reqs_padded):
    """Largest row r in [0, num_reqs_padded] with qsl[r] // BLOCK_Q + r <= pid.

    NOTE: qsl[r] // BLOCK_Q + r is strictly increasing (query_start_loc never decreases),
    and request r owns tiles [qsl[r] // BLOCK_Q + r, qsl[r + 1] // BLOCK_Q + r + 1).
    """
    lo = pid * 0
    hi = lo + num_reqs_padded + 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _zero_pad_tokens(out_ptr, stride_ot, stride_oh, stride_od, qsl_ptr, tile, kv_head,
                     num_tokens_padded, num_reqs_padded,
                     q_off, group_idx, dims,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_M: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    num_tokens = tl.load(qsl_ptr + num_reqs_padded)   # real tokens end where pads begin
    tok = tile * BLOCK_Q + q_off
    ok = (tok >= num_tokens) & (tok < num_tokens_padded) & (group_idx < GROUP)
    head = kv_head * GROUP + group_idx
    dst = (out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
           + dims[None, :] * stride_od)
    zeros = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=out_ptr.dtype.element_ty)
    tl.store(dst, zeros, mask=ok[:, None] & (dims[None, :] < HEAD_DIM))


# NOTE: counts change every step; specialised (==1, %16) they would compile new variants
# mid-serving. Everything else is fixed by the model and the config.
@triton.jit(do_not_specialize=["num_tokens_padded", "num_reqs_padded", "num_q_tiles"])
def _paged_attention_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,
    out_ptr, stride_ot, stride_oh, stride_od,
    cache_ptr, stride_cx, stride_cb, stride_cs, stride_ch, stride_cd,
    qsl_ptr, seq_lens_ptr, bt_ptr, stride_btr, stride_btc,
    scale, softcap, sliding_window,
    num_tokens_padded, num_reqs_padded, num_q_tiles, block_size,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    q_off = rows // GROUP_P                    # query token within the tile
    group_idx = rows % GROUP_P                 # query head within the KV head's group
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM

    if pid >= num_q_tiles:
        _zero_pad_tokens(out_ptr, stride_ot, stride_oh, stride_od, qsl_ptr, pid - num_q_tiles,
                         kv_head, num_tokens_padded, num_reqs_padded, q_off, group_idx, dims,
                         GROUP, HEAD_DIM, BLOCK_Q, BLOCK_M, HEAD_DIM_P)
        return

    req = _find_request(qsl_ptr, pid, BLOCK_Q, SEARCH_STEPS, num_reqs_padded)
    req_row = tl.minimum(req, num_reqs_padded - 1)
    q_start = tl.load(qsl_ptr + req_row)
    q_len = tl.load(qsl_ptr + req_row + 1) - q_start
    tile_start = (pid - (q_start // BLOCK_Q + req_row)) * BLOCK_Q   # within the request
    # NOTE: pad rows have q_len 0, so they own no tile and read nothing.
    if (req >= num_reqs_padded) | (tile_start >= q_len):
        return

    context_len = tl.load(seq_lens_ptr + req_row) - q_len      # cached tokens before the query
    tok_in_req = tile_start + q_off
    row_ok = (tok_in_req < q_len) & (group_idx < GROUP)
    tok = (q_start + tok_in_req).to(tl.int64)
    pos = context_len + tok_in_req                             # absolute position per row
    head = kv_head * GROUP + group_idx
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0).to(DOT_DTYPE)                       # [BLOCK_M, HEAD_DIM_P]

    key_end = context_len + tl.minimum(tile_start + BLOCK_Q, q_len)   # exclusive, causal
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(context_len + tile_start - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    bt_row = bt_ptr + req_row.to(tl.int64) * stride_btr
    for kv_start in range(key_start, key_end, TILE):
        keys = kv_start + tl.arange(0, TILE)
        key_ok = keys < key_end
        block_id = tl.load(bt_row + (keys // block_size) * stride_btc, mask=key_ok, other=0)
        kv_off = (block_id.to(tl.int64) * stride_cb + (keys % block_size) * stride_cs
                  + kv_head * stride_ch)                                  # [TILE]
        k = tl.load(cache_ptr + kv_off[None, :] + dims[:, None] * stride_cd,
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)    # [HEAD_DIM_P, TILE]
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = row_ok[:, None] & (keys[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible &= keys[None, :] > pos[:, None] - sliding_window
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # to log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(cache_ptr + stride_cx + kv_off[:, None] + dims[None, :] * stride_cd,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)    # [TILE, HEAD_DIM_P]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_paged_attention_kernel, InterpretedFunction)


def _tile_sizes(group_p: int, head_dim_p: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, TILE). Any BLOCK_Q is correct; max_query_len only picks a good one.

    NOTE: BLOCK_Q takes one value per power of two of max_query_len up to 64 rows, so
    warm-up that runs query lengths 1, 2, 4, ..., 64 compiles every variant
    (``WARMUP_QUERY_LENS``).
    """
    max_rows = 64 if head_dim_p <= 128 else 32
    min_q = max(1, 16 // group_p)          # tl.dot wants at least 16 rows
    block_q = max(min_q, min(triton.next_power_of_2(max(max_query_len, 1)),
                             max_rows // group_p))
    tile = 32 if head_dim_p <= 128 else 16
    return block_q, tile


WARMUP_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64)


def search_steps(query_start_loc: torch.Tensor) -> int:
    """Binary-search steps that cover the buffer ``query_start_loc`` is a view of.

    NOTE: rung's query_start_loc is a view of a persistent buffer of max_num_seqs + 1
    rows, so this is a config limit, the same every step (one kernel variant); extra
    steps are harmless (the search stays put once its range is one row).
    """
    rows = query_start_loc.untyped_storage().nbytes() // query_start_loc.element_size()
    return max(rows - 1, query_start_loc.shape[0] - 1, 1).bit_length()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, max_query_len: int, scale: float,
                    sliding_window: int | None = None,
                    logit_softcap: float | None = None) -> None:
    """Causal attention of every query token over its request's cached KV, into output.

    query/output [num_tokens_padded, num_heads, head_dim]; kv_cache
    [2, num_blocks, block_size, num_kv_heads, head_dim]; query_start_loc
    [num_reqs_padded + 1] int32; seq_lens [num_reqs_padded] int32; block_table
    [num_reqs_padded, max_blocks_per_req] int32. Pad tokens get zeros.
    """
    num_tokens_padded, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    num_reqs_padded = seq_lens.shape[0]
    if cache_head_dim != head_dim:
        raise ContractError(f"cache head_dim {cache_head_dim} != query {head_dim}")
    if num_heads % num_kv_heads:
        raise ContractError(f"{num_heads} heads over {num_kv_heads} KV heads")
    if output.shape != query.shape:
        raise ContractError(f"output {tuple(output.shape)} != {tuple(query.shape)}")
    if num_tokens_padded == 0 or num_reqs_padded == 0:
        return
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    block_q, tile = _tile_sizes(group_p, head_dim_p, max_query_len)
    # NOTE: request r owns at most qsl[r+1]//B - qsl[r]//B + 1 tiles, so this many
    # programs cover every real tile of any batch with these padded counts.
    num_q_tiles = num_tokens_padded // block_q + num_reqs_padded
    num_pad_tiles = triton.cdiv(num_tokens_padded, block_q)
    grid = (num_q_tiles + num_pad_tiles, num_kv_heads)
    # NOTE: the interpreter's tl.dot multiplies bf16 / fp16 storage bits as integers, so
    # it gets fp32 operands. fp32 dots use "ieee": TF32 would miss the fp32 tolerance.
    interpreted = _interpreted()
    dot_dtype = tl.float32 if interpreted else _TL_DTYPES[query.dtype]
    args = (query, *query.stride(), output, *output.stride(), kv_cache, *kv_cache.stride(),
            query_start_loc, seq_lens, block_table, *block_table.stride(),
            float(scale), float(logit_softcap or 0.0), int(sliding_window or 0),
            num_tokens_padded, num_reqs_padded, num_q_tiles, block_size)
    constexprs = dict(
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, TILE=tile, USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=bool(logit_softcap), SEARCH_STEPS=search_steps(query_start_loc),
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None)
    if interpreted:
        KERNEL_VARIANTS.note_launch("paged_attention", args, constexprs)
    _paged_attention_kernel[grid](*args, **constexprs, num_warps=8 if head_dim_p >= 256 else 4)


KERNEL_VARIANTS.register("paged_attention", _paged_attention_kernel)
