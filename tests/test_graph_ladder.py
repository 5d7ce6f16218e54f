"""Capture-size ladder and dispatcher: sizes, padding, modes, downgrades, bad input."""

import logging

import pytest

from rung.core.graph_mode import CUDAGraphMode, GraphSupport
from rung.graphs.dispatcher import Dispatcher, downgrade
from rung.graphs.ladder import capture_sizes, default_ladder


@pytest.mark.parametrize("max_num_seqs", [1, 3, 12, 100, 256, 300, 512])
def test_default_ladder_always_holds_max(max_num_seqs):
    sizes = capture_sizes(None, max_num_seqs, 0, 8192)
    assert sizes[-1] == max_num_seqs
    assert sizes == sorted(set(sizes))
    assert all(s in sizes for s in (1, 2, 4) if s <= max_num_seqs)


def test_default_ladder_steps():
    sizes = default_ladder(300)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert 248 in sizes and 256 in sizes and 272 in sizes and 300 in sizes
    assert 252 not in sizes and 264 not in sizes


def test_spec_decode_rounds_sizes_to_multiples_of_k_plus_one():
    sizes = capture_sizes(None, 12, 3, 8192)
    assert all(s % 4 == 0 for s in sizes)
    assert sizes[-1] == 48


def test_user_sizes_are_sorted_and_deduplicated():
    assert capture_sizes([8, 2, 2, 4, 1], 8, 0, 64) == [1, 2, 4, 8]


@pytest.mark.parametrize("sizes, match", [([0, 4], "size 0"), ([4, -2], "size -2"),
                                          ([8, 128], "128 exceeds max_num_batched_tokens=64")])
def test_bad_user_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        capture_sizes(sizes, 8, 0, 64)


def test_unknown_mode():
    with pytest.raises(ValueError, match="'fullish'"):
        CUDAGraphMode.parse("fullish")


def _all_live(d: Dispatcher) -> Dispatcher:
    for key in d.capture_descriptors():
        d.go_live(key)
    return d


def test_dispatch_decode_mixed_and_oversized():
    d = _all_live(Dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8], max_num_reqs=8))
    decode = d.dispatch(3, 3, 1)
    assert (decode.mode, decode.num_reqs_padded, decode.num_tokens_padded) == (
        CUDAGraphMode.FULL, 4, 4)
    mixed = d.dispatch(2, 7, None)
    assert (mixed.mode, mixed.num_reqs_padded, mixed.num_tokens_padded) == (
        CUDAGraphMode.PIECEWISE, 2, 8)
    big = d.dispatch(9, 9, 1)
    assert (big.mode, big.num_reqs_padded, big.num_tokens_padded) == (CUDAGraphMode.NONE, 9, 9)


def test_spec_verify_batches_pad_whole_requests():
    d = _all_live(Dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [4, 8, 16], max_num_reqs=4,
                             decode_query_len=4))
    desc = d.dispatch(3, 12, 4)
    assert (desc.mode, desc.num_reqs_padded, desc.num_tokens_padded) == (
        CUDAGraphMode.FULL, 4, 16)
    drafting = desc.for_drafting()
    assert (drafting.num_reqs_padded, drafting.num_tokens, drafting.num_tokens_padded) == (3, 3, 3)


def test_full_downgrades_for_backends_that_cannot_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="rung.graphs"):
        mode = downgrade(CUDAGraphMode.FULL, GraphSupport.NEVER, "NOGRAPH")
    assert mode == CUDAGraphMode.PIECEWISE
    assert "NOGRAPH" in caplog.text and "downgraded" in caplog.text
    assert downgrade(CUDAGraphMode.FULL, GraphSupport.UNIFORM_BATCH, "X") == (
        CUDAGraphMode.FULL_AND_PIECEWISE)
    assert downgrade(CUDAGraphMode.FULL_DECODE_ONLY, GraphSupport.NEVER, "X") == (
        CUDAGraphMode.NONE)


def test_capture_order_piecewise_first_largest_first():
    d = Dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4], max_num_reqs=4)
    order = [(x.mode, x.num_tokens_padded) for x in d.capture_descriptors()]
    assert order == [(CUDAGraphMode.PIECEWISE, 4), (CUDAGraphMode.PIECEWISE, 2),
                     (CUDAGraphMode.PIECEWISE, 1), (CUDAGraphMode.FULL, 4),
                     (CUDAGraphMode.FULL, 2), (CUDAGraphMode.FULL, 1)]


def test_a_size_replays_only_once_its_graph_is_live():
    """Graphs go live one at a time (built in the background): until a size's graph is
    live, its batches run eagerly; dispatch hands out only keys that are live."""
    d = Dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4], max_num_reqs=4)
    assert d.dispatch(2, 2, 1).mode == CUDAGraphMode.NONE
    [full_2] = [k for k in d.capture_descriptors()
                if k.mode == CUDAGraphMode.FULL and k.num_tokens_padded == 2]
    d.go_live(full_2)
    decode = d.dispatch(2, 2, 1)
    assert (decode.mode, decode.num_reqs_padded) == (CUDAGraphMode.FULL, 2)
    assert d.graph_key(decode) == full_2
    assert d.dispatch(3, 3, 1).mode == CUDAGraphMode.NONE       # size 4: not live yet
    assert d.dispatch(1, 2, None).mode == CUDAGraphMode.NONE    # mixed: PIECEWISE not live
    with pytest.raises(ValueError, match="not a graph key"):
        d.go_live(decode)                                      # real counts: not a key


def test_a_batch_that_waits_for_its_graph_is_recorded_as_missed():
    """The graph builder builds first the size batches run eagerly for want of: only a
    slot the mode has a graph for counts (not mixed batches of a decode-only mode, nor
    batches above the ladder)."""
    d = Dispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [1, 2, 4], max_num_reqs=4)
    d.dispatch(3, 3, 1)
    assert d.missed == (True, 4)
    d.missed = None
    d.dispatch(1, 3, None)                  # a prefill: decode-only graphs never serve it
    d.dispatch(8, 8, 1)                     # above the ladder
    assert d.missed is None
    [full_4] = [k for k in d.capture_descriptors() if k.num_tokens_padded == 4]
    d.go_live(full_4)
    d.dispatch(3, 3, 1)                     # replays its graph now
    assert d.missed is None
