"""FLASH_ATTN backend: held to the torch reference on CUDA; its config checks run anywhere."""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from rung.core.kv_cache_spec import KVCacheSpec
from rung.kernels.backend import AttentionLayerSpec
from rung.kernels.flash_attn_backend import FlashAttnBackend
from rung.kernels.torch_backend import TorchAttentionImpl

CUDA = torch.device("cuda")
_AVAILABLE, _WHY = FlashAttnBackend.is_available(CUDA)
needs_flash_attn = pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
BLOCK_SIZE = 256


def _layer(head_dim: int = 128) -> AttentionLayerSpec:
    return AttentionLayerSpec(8, 2, head_dim, head_dim ** -0.5)


# --- config checks: pure logic, run on CPU too ----------------------------------------------

def test_block_size_16_rejected_naming_the_multiple():
    with pytest.raises(ValueError, match=r"divisible by 256, got 16"):
        FlashAttnBackend.validate_layer(_layer(), KVCacheSpec(16, 2, 128, torch.bfloat16))


@pytest.mark.parametrize("head_dim", [512, 100])
def test_head_dim_over_256_or_not_multiple_of_8_rejected(head_dim):
    with pytest.raises(ValueError, match=rf"head_dim <= 256 .* got {head_dim}"):
        FlashAttnBackend.validate_layer(_layer(head_dim),
                                        KVCacheSpec(BLOCK_SIZE, 2, head_dim, torch.bfloat16))


def test_fp32_cache_rejected():
    with pytest.raises(ValueError, match="float32"):
        FlashAttnBackend.validate_layer(_layer(), KVCacheSpec(BLOCK_SIZE, 2, 128, torch.float32))


def test_supported_layer_accepted():
    layer = AttentionLayerSpec(8, 2, 256, 256 ** -0.5, sliding_window=512, logit_softcap=30.0)
    FlashAttnBackend.validate_layer(layer, KVCacheSpec(512, 2, 256, torch.float16))


def test_cpu_device_is_unavailable_with_reason():
    ok, why = FlashAttnBackend.is_available(torch.device("cpu"))
    assert not ok and "CUDA device" in why


# --- numerics: CUDA + flash_attn only -------------------------------------------------------

CASES = {   # num_heads, num_kv_heads, head_dim, sliding_window, logit_softcap
    "gqa4": (8, 2, 128, None, None),
    "mha-hd64-window": (4, 4, 64, 100, None),
    "gqa8-softcap-window": (8, 1, 128, 300, 30.0),
}


def _compare(batch) -> None:
    cache_ref = batch.kv_cache.clone()
    expected = torch.empty_like(batch.query)
    TorchAttentionImpl(batch.layer).forward(batch.query, batch.key, batch.value, cache_ref,
                                            batch.meta, expected)
    output = torch.full_like(batch.query, float("nan"))
    FlashAttnBackend.impl_cls(batch.layer).forward(batch.query, batch.key, batch.value,
                                                   batch.kv_cache, batch.meta, output)
    torch.testing.assert_close(output.float(), expected.float(), atol=2e-2, rtol=0)
    assert bool((output[batch.meta.num_tokens:] == 0).all()), "pad tokens must get zeros"


@needs_flash_attn
@pytest.mark.parametrize("case", list(CASES))
def test_mixed_paged_batch_matches_reference(case):
    num_heads, num_kv_heads, head_dim, window, softcap = CASES[case]
    gen = torch.Generator().manual_seed(0)
    # decode, spec verify, prefill, chunked prefill; several cross a 256-token block
    q_lens, seq_lens = [1, 3, 270, 40], [600, 300, 270, 520]
    batch = make_batch(gen, q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                       num_pad_reqs=2, num_pad_tokens=5, sliding_window=window,
                       logit_softcap=softcap, device=CUDA)
    _compare(batch)


@needs_flash_attn
@pytest.mark.parametrize("num_pad_tokens", [2, 7])
def test_uniform_decode_graph_batch_matches_reference(num_pad_tokens):
    """num_pad_tokens 2: tokens == rows (flash-attn's GQA decode path); 7: more tokens."""
    gen = torch.Generator().manual_seed(1)
    uniform = 1 if num_pad_tokens == 2 else None
    batch = make_batch(gen, [1, 1, 1], [700, 5, 257], num_heads=8, num_kv_heads=2,
                       head_dim=128, block_size=BLOCK_SIZE, dtype=torch.bfloat16,
                       num_pad_reqs=2, num_pad_tokens=num_pad_tokens,
                       uniform_query_len=uniform, max_seq_len=2048, device=CUDA)
    _compare(batch)
