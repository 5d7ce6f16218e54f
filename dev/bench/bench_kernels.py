"""Microbenchmarks: Triton KV write and paged attention against the torch reference.

    python -m pytest dev/bench/bench_kernels.py --benchmark-only -p no:cacheprovider -o addopts=''

On CPU the Triton kernels run under the interpreter, so the sizes are tiny and the numbers
only show the harness works; on CUDA the sizes are real.
"""

from __future__ import annotations

import os

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any Triton kernel is defined

import pytest  # noqa: E402

from rung.core.attention_metadata import CommonAttentionMetadata  # noqa: E402
from rung.core.descriptor import BatchExecutionDescriptor  # noqa: E402
from rung.kernels.backend import AttentionLayerSpec  # noqa: E402
from rung.kernels.torch_backend import paged_attention_ref, write_kv  # noqa: E402
from rung.kernels.triton.kv_write import kv_write  # noqa: E402
from rung.kernels.triton.paged_attention import paged_attention  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
# num_heads, num_kv_heads, head_dim, block_size
SHAPE = (32, 8, 128, 16) if ON_CUDA else (4, 2, 32, 16)
DECODE_REQS = [1, 8, 32, 128] if ON_CUDA else [1, 4]
DECODE_SEQ_LEN = 1024 if ON_CUDA else 32
PREFILL_REQS = [1, 4] if ON_CUDA else [1, 2]
PREFILL_LENS = (256, 512) if ON_CUDA else (8, 16)       # query tokens, sequence length
ROUNDS = 20 if ON_CUDA else 2


def _batch(num_reqs: int, query_len: int, seq_len: int) -> tuple:
    """A uniform eager batch: each request's query is the last query_len of seq_len tokens."""
    num_heads, num_kv_heads, head_dim, block_size = SHAPE
    blocks_per_req = -(-seq_len // block_size)
    num_tokens = num_reqs * query_len
    block_table = (1 + torch.arange(num_reqs * blocks_per_req, dtype=torch.int32)
                   ).view(num_reqs, blocks_per_req)             # [num_reqs, blocks_per_req]
    pos = torch.arange(seq_len - query_len, seq_len).repeat(num_reqs)           # [num_tokens]
    rows = torch.arange(num_reqs).repeat_interleave(query_len)
    slot_mapping = (block_table[rows, pos // block_size].long() * block_size
                    + pos % block_size)                           # [num_tokens] int64
    meta = CommonAttentionMetadata(
        BatchExecutionDescriptor.eager(num_reqs, num_tokens, query_len),
        torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device=DEVICE),
        torch.full((num_reqs,), seq_len, dtype=torch.int32, device=DEVICE),
        block_table.to(DEVICE), slot_mapping.to(DEVICE), block_size, query_len, seq_len)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)

    num_blocks = 1 + num_reqs * blocks_per_req
    layer = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    return (meta, layer, randn(num_tokens, num_heads, head_dim),
            randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim),
            randn(2, num_blocks, block_size, num_kv_heads, head_dim))


def _run(benchmark, fn) -> None:
    def timed() -> None:
        fn()
        if ON_CUDA:
            torch.cuda.synchronize()
    benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=1)


def _triton_attention(meta, layer, query, kv_cache) -> None:
    output = torch.empty_like(query)
    paged_attention(query, kv_cache, output, meta.query_start_loc, meta.seq_lens,
                    meta.block_table, meta.max_query_len, layer.scale)


@pytest.mark.benchmark(group="kv_write")
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("num_reqs", DECODE_REQS)
def test_kv_write(benchmark, impl, num_reqs):
    meta, _, _, key, value, kv_cache = _batch(num_reqs, PREFILL_LENS[0], PREFILL_LENS[0])
    write = kv_write if impl == "triton" else write_kv
    _run(benchmark, lambda: write(kv_cache, key, value, meta.slot_mapping))


@pytest.mark.benchmark(group="decode_attention")
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("num_reqs", DECODE_REQS)
def test_decode_attention(benchmark, impl, num_reqs):
    meta, layer, query, _, _, kv_cache = _batch(num_reqs, 1, DECODE_SEQ_LEN)
    if impl == "triton":
        _run(benchmark, lambda: _triton_attention(meta, layer, query, kv_cache))
    else:
        _run(benchmark, lambda: paged_attention_ref(query, kv_cache, meta, layer))


@pytest.mark.benchmark(group="prefill_attention")
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("num_reqs", PREFILL_REQS)
def test_prefill_attention(benchmark, impl, num_reqs):
    meta, layer, query, _, _, kv_cache = _batch(num_reqs, *PREFILL_LENS)
    if impl == "triton":
        _run(benchmark, lambda: _triton_attention(meta, layer, query, kv_cache))
    else:
        _run(benchmark, lambda: paged_attention_ref(query, kv_cache, meta, layer))
