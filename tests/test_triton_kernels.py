"""Triton KV write and paged attention held to the torch reference (kernels/torch_backend.py).

Runs under TRITON_INTERPRET=1 on CPU (set by conftest.py), so every shape is tiny.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from helpers import DEVICE, Batch, make_batch

from rung.core.errors import ContractError
from rung.core.kv_cache_spec import KVCacheSpec
from rung.kernels.backend import AttentionLayerSpec
from rung.kernels.selector import select_backend
from rung.kernels.torch_backend import TorchAttentionImpl, paged_attention_ref, write_kv
from rung.kernels.triton.kv_write import kv_write
from rung.kernels.triton.paged_attention import paged_attention
from rung.kernels.triton_backend import TritonBackend

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def mixed_lengths(gen: torch.Generator, block_size: int) -> tuple[list[int], list[int]]:
    """One request of each kind: decode, spec verify, prefill, chunked prefill."""
    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    decode = (1, rand(2 * block_size + 1, 4 * block_size))
    verify = (rand(2, 4), rand(block_size + 1, 3 * block_size))
    prefill_len = rand(block_size + 1, 3 * block_size)
    chunk = rand(2, block_size + 2)
    chunked = (chunk, chunk + rand(1, 2 * block_size))
    q_lens, seq_lens = zip(decode, verify, (prefill_len, prefill_len), chunked)
    return list(q_lens), list(seq_lens)


def run_triton(batch: Batch) -> torch.Tensor:
    m, layer = batch.meta, batch.layer
    output = torch.full_like(batch.query, float("nan"))   # pads must be overwritten with 0
    paged_attention(batch.query, batch.kv_cache, output, m.query_start_loc, m.seq_lens,
                    m.block_table, m.max_query_len, layer.scale, layer.sliding_window,
                    layer.logit_softcap)
    return output


def assert_matches_reference(batch: Batch, output: torch.Tensor,
                             kv_cache: torch.Tensor | None = None) -> None:
    cache = batch.kv_cache if kv_cache is None else kv_cache
    expected = paged_attention_ref(batch.query, cache, batch.meta, batch.layer)
    num_tokens = batch.meta.num_tokens
    assert output.dtype == batch.query.dtype
    torch.testing.assert_close(output[:num_tokens].float(), expected[:num_tokens],
                               atol=ATOL[batch.query.dtype], rtol=0)
    assert bool((output[num_tokens:] == 0).all()), "pad tokens must get zeros"


# --- KV write -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_kv_write_writes_real_slots_and_leaves_the_rest_untouched(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = mixed_lengths(gen, block_size=4)
    batch = make_batch(gen, q_lens, seq_lens, dtype=dtype, num_pad_reqs=2, num_pad_tokens=3)
    before = batch.kv_cache.clone()
    kv_write(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)

    num_tokens, slots = batch.meta.num_tokens, batch.real_slots
    expected = before.clone()
    flat = expected.view(2, -1, *expected.shape[3:])     # [2, num_slots, kvh, hd]
    flat[0, slots] = batch.key[:num_tokens]
    flat[1, slots] = batch.value[:num_tokens]
    assert torch.equal(batch.kv_cache, expected)          # real slots written, nothing else

    reference = before.clone()
    write_kv(reference, batch.key, batch.value, batch.meta.slot_mapping)
    ref_flat = reference.view(2, -1, *reference.shape[3:])
    ours = batch.kv_cache.view(2, -1, *reference.shape[3:])
    assert torch.equal(ours[:, slots], ref_flat[:, slots])


def test_kv_write_casts_to_the_cache_dtype():
    gen = torch.Generator().manual_seed(2)
    batch = make_batch(gen, [3, 1], [5, 9], dtype=torch.float32)
    cache = batch.kv_cache.to(torch.bfloat16)
    kv_write(cache, batch.key, batch.value, batch.meta.slot_mapping)
    flat = cache.view(2, -1, *cache.shape[3:])
    for stored, written in ((flat[0], batch.key), (flat[1], batch.value)):
        if DEVICE.type == "cuda":
            assert torch.equal(stored[batch.real_slots], written.to(torch.bfloat16))
        else:   # NOTE: the interpreter truncates fp32 -> bf16: within one bf16 ulp
            torch.testing.assert_close(stored[batch.real_slots].float(), written, atol=0,
                                       rtol=2 ** -7)


# --- paged attention ------------------------------------------------------------------------

CASES = {   # num_heads, num_kv_heads, head_dim, block_size, sliding_window, logit_softcap
    "mha": (2, 2, 32, 4, None, None),
    "gqa2": (4, 2, 32, 4, None, None),
    "gqa3-padded-group": (6, 2, 32, 4, None, None),
    "gqa4-window-short": (4, 1, 32, 4, 3, None),
    "gqa8-softcap-hd16": (8, 1, 16, 8, None, 5.0),
    "gqa2-window-long-softcap-hd64": (4, 2, 64, 4, 64, 3.0),
    "odd-head-dim-odd-block": (2, 1, 24, 3, 5, None),
    "long-several-key-tiles": (4, 2, 32, 16, None, None),
    "long-window-mid-tile": (4, 1, 32, 16, 21, 4.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_mixed_padded_batch_matches_reference(case, dtype, seed):
    num_heads, num_kv_heads, head_dim, block_size, window, softcap = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = mixed_lengths(gen, block_size)
    batch = make_batch(gen, q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=dtype,
                       num_pad_reqs=2, num_pad_tokens=3, sliding_window=window,
                       logit_softcap=softcap)
    kv_write(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    assert_matches_reference(batch, run_triton(batch))


@pytest.mark.parametrize("query_len", [1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1)])
def test_uniform_graph_batch_with_max_model_len_bound(query_len, num_heads, num_kv_heads):
    """Decode / spec verify as a FULL graph replays it: pad rows, max_seq_len = max_model_len."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [5, 13, 9]
    batch = make_batch(gen, [query_len] * 3, seq_lens, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, num_pad_reqs=2, num_pad_tokens=2 * query_len,
                       uniform_query_len=query_len, max_seq_len=64)
    kv_write(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    assert_matches_reference(batch, run_triton(batch))


def test_prefill_only_eager_batch():
    gen = torch.Generator().manual_seed(4)
    batch = make_batch(gen, [7, 1, 12], [7, 1, 12], num_heads=4, num_kv_heads=1)
    kv_write(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    assert_matches_reference(batch, run_triton(batch))


def test_captured_max_query_len_bound_gives_the_same_output():
    """Under a graph max_query_len is the captured bound; it only picks the tile size."""
    gen = torch.Generator().manual_seed(5)
    q_lens, seq_lens = mixed_lengths(gen, block_size=4)
    batch = make_batch(gen, q_lens, seq_lens, num_pad_reqs=1, num_pad_tokens=2)
    kv_write(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    real_bound = run_triton(batch)
    batch.meta.max_query_len = 64
    torch.testing.assert_close(run_triton(batch), real_bound, atol=1e-5, rtol=0)
    assert_matches_reference(batch, real_bound)


def test_attention_reads_only_its_requests_kv():
    """NaN in every slot no request owns (null block, spare blocks, tails past seq_len)."""
    gen = torch.Generator().manual_seed(6)
    q_lens, seq_lens = mixed_lengths(gen, block_size=4)
    batch = make_batch(gen, q_lens, seq_lens, num_pad_reqs=2, num_pad_tokens=3,
                       sliding_window=6)
    kv_write(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    clean = batch.kv_cache.clone()
    owned = torch.zeros(batch.kv_cache[0].numel() // batch.kv_cache[0, 0, 0].numel(),
                        dtype=torch.bool)                     # [num_slots]
    table = batch.meta.block_table.cpu()
    for row, seq_len in enumerate(seq_lens):
        for pos in range(seq_len):
            owned[int(table[row, pos // 4]) * 4 + pos % 4] = True
    flat = batch.kv_cache.view(2, owned.shape[0], -1)
    flat[:, ~owned.to(flat.device)] = float("nan")
    output = run_triton(batch)
    assert not output.isnan().any()
    assert_matches_reference(batch, output, kv_cache=clean)


# --- backend --------------------------------------------------------------------------------

@pytest.mark.parametrize("writes_kv", [True, False])
def test_triton_impl_matches_torch_impl(writes_kv):
    gen = torch.Generator().manual_seed(7)
    q_lens, seq_lens = mixed_lengths(gen, block_size=4)
    batch = make_batch(gen, q_lens, seq_lens, num_pad_reqs=1, num_pad_tokens=2,
                       sliding_window=4, logit_softcap=2.0)
    layer = dataclasses.replace(batch.layer, writes_kv=writes_kv)
    cache_ref = batch.kv_cache.clone()
    cache_before = batch.kv_cache.clone()
    out_ref = torch.empty_like(batch.query)
    TorchAttentionImpl(layer).forward(batch.query, batch.key, batch.value, cache_ref,
                                      batch.meta, out_ref)
    output = torch.full_like(batch.query, float("nan"))
    TritonBackend.impl_cls(layer).forward(batch.query, batch.key, batch.value, batch.kv_cache,
                                          batch.meta, output)
    torch.testing.assert_close(output, out_ref, atol=1e-5, rtol=0)
    slots = batch.real_slots
    ours = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    if writes_kv:
        ref = cache_ref.view(2, -1, *cache_ref.shape[3:])
        assert torch.equal(ours[:, slots], ref[:, slots])
    else:
        assert torch.equal(batch.kv_cache, cache_before), "a KV-sharing layer must not write"


def test_impl_rejects_block_table_not_matching_query_start_loc():
    """Failure class 1: the block table kept at the padded batch, query_start_loc unpadded."""
    gen = torch.Generator().manual_seed(8)
    batch = make_batch(gen, [1, 1], [4, 6], num_pad_reqs=2, num_pad_tokens=2,
                       uniform_query_len=1)
    batch.meta.query_start_loc = batch.meta.query_start_loc[:3]
    output = torch.empty_like(batch.query)
    with pytest.raises(ContractError, match="batch_size must be equal to batch_size_k"):
        TritonBackend.impl_cls(batch.layer).forward(batch.query, batch.key, batch.value,
                                                    batch.kv_cache, batch.meta, output)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="checks the CPU interpreter path")
def test_select_triton_on_cpu_under_the_interpreter():
    assert select_backend("triton", torch.device("cpu")) is TritonBackend


@pytest.mark.skipif(DEVICE.type != "cpu", reason="checks the CPU interpreter path")
def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = TritonBackend.is_available(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET=1" in why
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cpu"))


def test_explicit_flash_attn_on_cpu_names_what_is_missing():
    with pytest.raises(ValueError, match="flash_attn.*unavailable on cpu.*CUDA device") as err:
        select_backend("flash_attn", torch.device("cpu"))
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn package" in str(err.value)


def test_validate_layer_rejects_head_dim_over_limit():
    layer = AttentionLayerSpec(8, 2, 1024, 1024 ** -0.5)
    spec = KVCacheSpec(16, 2, 1024, torch.bfloat16)
    with pytest.raises(ValueError, match=r"1\.\.512, got 1024"):
        TritonBackend.validate_layer(layer, spec)
    TritonBackend.validate_layer(AttentionLayerSpec(8, 2, 512, 512 ** -0.5),
                                 KVCacheSpec(16, 2, 512, torch.bfloat16))
