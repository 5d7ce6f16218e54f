"""The CPU decode attention op (kernels/cpu_attention.py) held to the torch reference.

A compiled CPU graph's decode attention is ``rung::paged_decode_attention``: it must give
``paged_attention_ref``'s output (pads 0) for every head layout, block size, sliding
window and soft-cap, and a token's bits must not depend on its batch or the threads.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from rung.kernels import cpu_attention, gguf_cpu
from rung.kernels.torch_backend import paged_attention_ref, write_kv

pytestmark = pytest.mark.skipif(gguf_cpu.available() is not None,
                                reason=f"no CPU kernel: {gguf_cpu.available()}")

CASES = {   # num_heads, num_kv_heads, head_dim, block_size, sliding_window, logit_softcap
    "mha": (2, 2, 32, 4, None, None),
    "gqa3": (9, 3, 64, 16, None, None),           # SmolLM2's head layout
    "gemma3-sliding": (4, 1, 256, 16, 5, None),   # Gemma 3 270M's, a window shorter than most
    "softcap": (4, 2, 32, 4, None, 30.0),
    "odd-head-dim": (2, 1, 20, 3, 7, None),       # a head_dim past the vector width
}
DECODE = ([1, 1, 1, 1], [7, 19, 2, 33])           # q_lens, seq_lens


def _decode_batch(case: str, seed: int, seq_lens=DECODE[1], num_pad_reqs: int = 2):
    num_heads, num_kv_heads, head_dim, block_size, window, softcap = CASES[case]
    batch = make_batch(torch.Generator().manual_seed(seed), [1] * len(seq_lens),
                       list(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, num_pad_reqs=num_pad_reqs,
                       num_pad_tokens=num_pad_reqs, uniform_query_len=1, sliding_window=window,
                       logit_softcap=softcap, device=torch.device("cpu"))
    write_kv(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    return batch


@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_matches_the_reference(case):
    gguf_cpu.load_kernel()
    batch = _decode_batch(case, seed=len(case))
    assert cpu_attention.serves(batch.query, batch.kv_cache, batch.meta)
    got = cpu_attention.paged_decode_attention(batch.query, batch.kv_cache, batch.meta,
                                               batch.layer)
    want = paged_attention_ref(batch.query, batch.kv_cache, batch.meta, batch.layer)
    num_tokens = batch.meta.num_tokens
    torch.testing.assert_close(got[:num_tokens], want[:num_tokens], atol=2e-6, rtol=1e-5)
    assert bool((got[num_tokens:] == 0).all()), "pad rows must get zeros"


@pytest.mark.parametrize("case", ["gqa3", "gemma3-sliding"])
def test_a_token_is_bit_identical_alone_in_any_batch_and_thread_count(case):
    """Batch invariance: request 1's output alone (one row, no pads) equals, bit for bit,
    its output in a padded batch of four, at 1 and 2 threads."""
    gguf_cpu.load_kernel()
    batch = _decode_batch(case, seed=3)
    one = cpu_attention.paged_decode_attention(
        batch.query[1:2], batch.kv_cache,
        type(batch.meta)(batch.meta.desc, batch.meta.query_start_loc[:2],
                         batch.meta.seq_lens[1:2], batch.meta.block_table[1:2],
                         batch.meta.slot_mapping[1:2], batch.meta.block_size,
                         batch.meta.max_query_len, batch.meta.max_seq_len),
        batch.layer)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            many = cpu_attention.paged_decode_attention(batch.query, batch.kv_cache,
                                                        batch.meta, batch.layer)
            assert torch.equal(many[1:2], one)
    finally:
        torch.set_num_threads(threads)


def test_a_block_outside_the_cache_is_refused():
    gguf_cpu.load_kernel()
    batch = _decode_batch("mha", seed=5)
    table = batch.meta.block_table.clone()
    table[0, 0] = batch.kv_cache.shape[1]              # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.rung.paged_decode_attention(batch.query, batch.kv_cache, table,
                                              batch.meta.seq_lens, 1.0, 0, 0.0)


def test_only_a_cpu_float32_decode_batch_is_served():
    gguf_cpu.load_kernel()
    batch = _decode_batch("mha", seed=6)
    assert not cpu_attention.serves(batch.query, batch.kv_cache.to(torch.bfloat16), batch.meta)
    prefill = make_batch(torch.Generator().manual_seed(7), [5], [9],
                         device=torch.device("cpu"))
    assert not cpu_attention.serves(prefill.query, prefill.kv_cache, prefill.meta)
