"""The torch backend's eager attention (kernels/torch_backend.py) held to its reference.

`paged_attention` lays a batch out per token (decode, wide mixed batches) or per request
(prefill, spec verify): both must give the reference's output, pads 0.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from rung.kernels import torch_backend
from rung.kernels.torch_backend import paged_attention, paged_attention_ref, write_kv

CASES = {   # num_heads, num_kv_heads, head_dim, block_size, sliding_window
    "mha": (2, 2, 32, 4, None),
    "gqa3": (9, 3, 64, 16, None),          # SmolLM2's head layout
    "gqa4-window": (4, 1, 32, 4, 3),
    "odd-block": (2, 1, 24, 3, 5),
}
BATCHES = {   # q_lens, seq_lens, num_pad_reqs, num_pad_tokens, max_query_len bound
    "prefill": ([13], [13], 0, 0, None),
    "prefill-after-prefix": ([9], [30], 0, 0, None),
    "verify": ([3, 3, 3], [9, 17, 4], 1, 3, None),
    "prefill-and-decode-padded": ([11, 1], [20, 33], 1, 2, None),
    "captured-bound": ([5, 2], [5, 12], 0, 1, 8),
    "decode": ([1, 1, 1], [7, 19, 2], 2, 2, None),
    "wide-mixed": ([1, 1, 1, 1, 12], [5, 9, 3, 8, 12], 0, 0, None),
}


def _layout(batch) -> str:
    m = batch.meta
    rows = m.block_table.shape[0]
    per_request = m.max_query_len > 1 and rows * m.max_query_len <= 2 * batch.query.shape[0]
    return "per_request" if per_request else "per_token"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", list(BATCHES))
def test_eager_attention_matches_reference(case, shape):
    num_heads, num_kv_heads, head_dim, block_size, window = CASES[case]
    q_lens, seq_lens, pad_reqs, pad_tokens, bound = BATCHES[shape]
    gen = torch.Generator().manual_seed(len(case) * 31 + len(shape))
    batch = make_batch(gen, q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, num_pad_reqs=pad_reqs,
                       num_pad_tokens=pad_tokens, max_query_len=bound, sliding_window=window,
                       device=torch.device("cpu"))
    write_kv(batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    got = paged_attention(batch.query, batch.kv_cache, batch.meta, batch.layer)
    want = paged_attention_ref(batch.query, batch.kv_cache, batch.meta, batch.layer)
    num_tokens = batch.meta.num_tokens
    torch.testing.assert_close(got[:num_tokens], want[:num_tokens], atol=1e-5, rtol=0)
    assert bool((got[num_tokens:] == 0).all()), "pad tokens must get zeros"


@pytest.mark.parametrize("shape, layout", [("prefill", "per_request"),
                                           ("verify", "per_request"),
                                           ("prefill-after-prefix", "per_request"),
                                           ("decode", "per_token"),
                                           ("wide-mixed", "per_token")])
def test_prefill_gathers_kv_once_per_request(monkeypatch, shape, layout):
    """A prefill of T tokens gathers its request's K/V once, not T times (O(T^2) memory)."""
    q_lens, seq_lens, pad_reqs, pad_tokens, bound = BATCHES[shape]
    batch = make_batch(torch.Generator().manual_seed(0), q_lens, seq_lens,
                       num_pad_reqs=pad_reqs, num_pad_tokens=pad_tokens, max_query_len=bound,
                       device=torch.device("cpu"))
    assert _layout(batch) == layout
    gathered = []
    real_gather = torch_backend._gather_kv

    def spy(kv_cache, meta, rows, *rest):
        kv = real_gather(kv_cache, meta, rows, *rest)
        gathered.append(kv.shape[1])                 # K/V copies made
        return kv

    monkeypatch.setattr(torch_backend, "_gather_kv", spy)
    paged_attention(batch.query, batch.kv_cache, batch.meta, batch.layer)
    rows = batch.meta.block_table.shape[0]
    assert gathered == [rows if layout == "per_request" else batch.query.shape[0]]
